"""Engine behaviour: grace, escalation inside the verification window, revert, budgets, observe-only,
known-good tracking, crash labels, hang."""

from __future__ import annotations

import pytest
from rem_helpers import engine_job, healthy

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.engine import Decision, RemediationEngine
from ulyssesd.remediation.job import job_values
from ulyssesd.remediation.records import EventRecord
from ulyssesd.training.spec import JobSpec

SPEC = JobSpec.model_validate({"model": {"preset": "gpt-7b"},
                               "train": {"lr": 1e-4, "micro_batch_size": 4, "gradient_accumulation_steps": 2}})
JOB = engine_job(SPEC)


def _feed(eng, recs, ckpt_every: int | None = None):
    out = []
    for r in recs:
        if ckpt_every and r.step % ckpt_every == 0:
            eng.observe(EventRecord("checkpoint_saved", step=r.step, fields={"tag": f"step-{r.step:08d}"}), r.time)
        out.extend(eng.observe(r, r.time))
    return out


def _decisions(items):
    return [i for i in items if isinstance(i, Decision)]


def _spike(ranges):
    def m(s, r):
        if any(a <= s < b for a, b in ranges):
            r.loss *= 2.5
    return m


def test_job_values_flatten_jobspec():
    v = job_values(SPEC.model_dump(mode="json"), num_layers=SPEC.resolved_model().num_layers)
    assert v["train.lr"] == 1e-4 and v["model.num_layers"] == 32 and v["train.micro_batch_size"] == 4
    assert job_values({"train": {"lr": 2e-4}, "deepspeed.config.zero_optimization.reduce_bucket_size": 5e7}) == {
        "train.lr": 2e-4, "deepspeed.config.zero_optimization.reduce_bucket_size": 5e7}


def test_job_values_take_plain_values_not_spec_objects():
    # The engine never duck-types a spec: the daemon dumps it; a spec object is refused by name.
    assert job_values({"model": {"preset": "tiny"}}, launcher_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == {
        "model.preset": "tiny", "launcher.env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with pytest.raises(TypeError, match="got JobSpec"):
        RemediationEngine(job=SPEC)  # type: ignore[arg-type]


def test_single_spike_that_recovers_costs_nothing():
    eng = RemediationEngine(job=JOB)
    items = _feed(eng, healthy(600, seed=1, mutate=_spike([(300, 303)])))
    assert [(i.symptom, i.step) for i in items] == [("loss_spike", 300)]
    assert _decisions(items) == []


def _mild(ranges, factor=1.3):
    def m(s, r):
        if any(a <= s < b for a, b in ranges):
            r.loss *= factor
    return m


def test_persistent_mild_spike_gets_the_first_rung_after_the_grace_window():
    eng = RemediationEngine(job=JOB)
    items = _feed(eng, healthy(600, seed=1, mutate=_mild([(300, 340)])))
    (d,) = _decisions(items)
    assert (d.action_kind, d.apply, d.step, d.ladder_step) == ("lower_clip", "hot", 320, 0)
    assert d.config_patch == {"train.gradient_clipping": 0.5} and d.previous == {"train.gradient_clipping": 1.0}
    assert d.hot_control == {"gradient_clipping": 0.5}
    assert "persisted for 20 steps since step 300" in d.reason and "sigma above" in d.reason


def test_severe_persistent_jump_acts_after_the_short_severe_grace():
    # 2.5x the loss (far above the +50 % severe line) that does not come back: act after 10 steps, not 20.
    eng = RemediationEngine(job=JOB)
    items = _feed(eng, healthy(600, seed=1, mutate=_spike([(300, 340)])))
    (d,) = _decisions(items)
    assert (d.action_kind, d.step) == ("lower_clip", 310)
    assert "persisted for 10 steps since step 300 (severe: shorter grace)" in d.reason
    # The same jump that comes back after 3 steps costs nothing (the self-recovering BLOOM-like spike).
    eng = RemediationEngine(job=JOB)
    assert _decisions(_feed(eng, healthy(600, seed=1, mutate=_spike([(300, 303)])))) == []


def test_recurrence_inside_grace_acts_at_once():
    eng = RemediationEngine(job=JOB)
    items = _feed(eng, healthy(600, seed=1, mutate=_spike([(300, 302), (310, 312)])))
    (d,) = _decisions(items)
    assert d.step == 310 and "recurred within the 20-step grace window" in d.reason


def test_recurrence_inside_verification_window_escalates_then_stops_at_the_end_of_the_ladder():
    eng = RemediationEngine(job=JOB, policy=RemediationConfig(max_rollbacks=1))
    # Spikes every 120 steps: each recurs inside the previous action's 200-step verification window.
    spikes = [(300 + 120 * k, 330 + 120 * k) for k in range(8)]
    items = _feed(eng, healthy(1400, seed=2, mutate=_spike(spikes)), ckpt_every=100)
    kinds = [d.action_kind for d in _decisions(items)]
    assert kinds == ["lower_clip", "fp32_layers", "lower_lr", "rollback_skip", "stop_alert"]
    assert "recurred within the verification window of lower_clip" in _decisions(items)[1].reason
    assert eng.failed


def test_rollback_goes_to_known_good_and_skips_a_bounded_sample_range():
    eng = RemediationEngine(job=JOB)
    items = _feed(eng, healthy(1300, seed=3, mutate=lambda s, r: setattr(r, "loss", float("nan")) if s == 1234 else None),
                  ckpt_every=250)
    (d,) = _decisions(items)
    assert (d.action_kind, d.apply, d.symptom) == ("rollback_skip", "rollback_skip", "nan_loss")
    assert d.rollback_tag == "step-00001000" and d.rollback_to_step == 1000  # 1250 is newer but not known-good
    ((start, end),) = d.skip_ranges
    assert 200 * 16 <= end - start <= 500 * 16 and start <= 1233 * 16 < end  # covers the NaN step's samples
    assert d.hot_control["suspect"] is True and d.config_patch["data.skip_ranges"] == [(start, end)]


def test_known_good_needs_an_anomaly_free_window():
    eng = RemediationEngine(job=JOB)
    _feed(eng, healthy(450, seed=4, mutate=_spike([(330, 332)])), ckpt_every=100)
    # 100 and 200 were followed by 100 clean steps; 300 was followed by a spike; 400 only by 50 steps.
    assert [s for _, s in eng.known_good] == [100, 200]


def test_revert_when_an_action_cost_throughput_for_no_gain():
    eng = RemediationEngine(job=JOB)
    mem = lambda s, r: setattr(r, "mem_max_allocated_gib", r.mem_max_allocated_gib * (2 if 300 <= s < 330 or 420 <= s < 450 else 1))  # noqa: E731
    slow = lambda s, r: setattr(r, "tokens_per_s", r.tokens_per_s * (0.8 if s >= 330 else 1))  # noqa: E731

    def both(s, r):
        mem(s, r)
        slow(s, r)
    items = []
    for r in healthy(600, seed=5, mutate=both):
        if r.step == 321:
            eng.on_restart(r.time, attempt=2)  # the memory rung restarted the job
        items.extend(eng.observe(r, r.time))
    ds = _decisions(items)
    assert [d.action_kind for d in ds] == ["raise_persistence_threshold", "expandable_segments"]
    second = ds[1]
    key = "deepspeed.config.zero_optimization.stage3_param_persistence_threshold"
    assert second.reverted == {key: 1e5} and second.config_patch[key] == 1e5
    assert "reverting the last action" in second.reason and "throughput" in second.reason


def test_observe_only_records_what_it_would_have_done():
    eng = RemediationEngine(job=JOB, policy=RemediationConfig(mode="observe"))
    items = _feed(eng, healthy(600, seed=1, mutate=_spike([(300, 340)])))
    (d,) = _decisions(items)
    assert d.apply == "none" and d.would_apply == "hot"
    assert d.reason.startswith("observe-only: would have lower_clip (hot): gradient clipping 1 -> 0.5")


def test_restart_budget_per_hour_stops_the_run():
    eng = RemediationEngine(job=JOB, policy=RemediationConfig(max_restarts_per_hour=3, no_progress_restarts=10,
                                                              max_crash_restarts=10))
    out = []
    for k in range(5):
        out += eng.on_crash("segfault", ["Segmentation fault (core dumped)"], now=100.0 * k)
        eng.on_restart(100.0 * k + 1, attempt=k + 2)
    assert [d.action_kind for d in out[:3]] == ["restart", "restart", "restart"]
    last = out[3]
    assert last.apply == "stop" and last.symptom == "crash_loop" and "3 restarts in the last hour" in last.reason
    assert out[4:] == []  # nothing after a stop


def test_restart_budget_window_slides():
    eng = RemediationEngine(job=JOB, policy=RemediationConfig(max_restarts_per_hour=2, no_progress_restarts=10,
                                                              max_crash_restarts=10))
    for k in range(6):  # one crash every 40 minutes never exceeds 2 per hour
        (d,) = eng.on_crash("nccl_timeout", [], now=2400.0 * k)
        assert d.apply == "restart_latest", d.reason
        eng.on_restart(2400.0 * k + 1, attempt=k + 2)
        eng.checkpoint_saved(f"step-{k:08d}", 100 * (k + 1))


def test_no_progress_rule():
    eng = RemediationEngine(job=JOB, policy=RemediationConfig(max_crash_restarts=10))
    eng.checkpoint_saved("step-00000100", 100)
    out = []
    for k in range(4):
        out += eng.on_crash("dataloader_crash", ["DataLoader worker (pid 12) is killed"], now=1000.0 * k)
        eng.on_restart(1000.0 * k + 1, attempt=k + 2)
    assert [d.apply for d in out] == ["restart_latest"] * 3 + ["stop"]
    assert out[3].symptom == "no_progress" and "3 restarts without a checkpoint advancing past step 100" in out[3].reason


def test_checkpoint_advance_resets_no_progress():
    eng = RemediationEngine(job=JOB, policy=RemediationConfig(max_crash_restarts=10, max_restarts_per_hour=100))
    for k in range(6):
        (d,) = eng.on_crash("segfault", [], now=1000.0 * k)
        assert d.apply == "restart_latest"
        eng.on_restart(1000.0 * k + 1, attempt=k + 2)
        eng.checkpoint_saved(f"step-{k:08d}", 100 * (k + 1))


@pytest.mark.parametrize("label,kind,apply,symptom", [
    ("cuda_oom", "raise_persistence_threshold", "restart_latest", "cuda_oom"),
    ("gpu_hardware", "stop_alert", "stop", "crash"),
    ("disk_full", "prune_and_restart", "restart_latest", "disk_full"),
    ("checkpoint_corrupt", "fall_back_checkpoint", "restart_latest", "checkpoint_corrupt"),
    ("nccl_error", "restart", "restart_latest", "crash"),
    ("host_oom_killed", "halve_micro_batch", "restart_latest", "crash"),
    ("launcher_error", "restart", "restart_latest", "launch_failure"),
    ("something_new", "restart", "restart_latest", "crash"),
])
def test_crash_labels(label, kind, apply, symptom):
    eng = RemediationEngine(job=JOB)
    (d,) = eng.on_crash(label, ["the deciding log line"], now=10.0)
    assert (d.action_kind, d.apply, d.symptom) == (kind, apply, symptom)
    assert f"the job crashed with {label}" in d.reason and "the deciding log line" in d.reason


def test_repeated_nccl_crash_inside_the_window_stops():
    eng = RemediationEngine(job=JOB, policy=RemediationConfig(max_crash_restarts=2))
    a = eng.on_crash("nccl_timeout", [], now=0)
    eng.on_restart(1, attempt=2)
    b = eng.on_crash("nccl_timeout", [], now=100)
    eng.on_restart(101, attempt=3)
    c = eng.on_crash("nccl_timeout", [], now=200)
    assert [x[0].apply for x in (a, b, c)] == ["restart_latest", "restart_latest", "stop"]


def test_hang_via_tick():
    eng = RemediationEngine(job=JOB, start_time=0.0)
    recs = healthy(100, seed=6)
    _feed(eng, recs)
    assert eng.tick(recs[-1].time + 15) == []   # ~1 s steps: the default 20 s floor is the timeout
    f, d = eng.tick(recs[-1].time + 21)
    assert isinstance(f, Finding) and f.symptom == "hang"
    assert d.procedure == ("dump_stacks", "sigterm", "sigkill", "restart_latest") and d.apply == "restart_latest"
    assert d.hot_control["dump_stacks"] is True and "no progress for 21 s" in d.reason


def test_on_restart_same_attempt_is_counted_once():
    eng = RemediationEngine(job=JOB)
    eng.observe(EventRecord("started", step=0, attempt=1), 0.0)
    eng.on_restart(1.0, attempt=1)
    assert len(eng.restart_times) == 0
    eng.on_restart(5.0, attempt=2)
    eng.observe(EventRecord("started", step=0, attempt=2), 5.0)
    assert len(eng.restart_times) == 1


def test_unknown_symptom_is_rejected():
    with pytest.raises(ValueError, match="unknown symptom 'gremlins'"):
        RemediationEngine().on_finding(Finding("gremlins", 1, "warning"), 0.0)


def test_throughput_drop_caused_by_a_straggler_is_not_reported_twice():
    eng = RemediationEngine(DetectorsConfig(), job=JOB)

    def straggle(s, r):
        if 200 <= s < 400:
            r.step_time_max_s = r.step_time_s * 1.6
            r.slowest_rank = 3
            r.tokens_per_s = r.tokens / r.step_time_max_s
    items = _feed(eng, healthy(500, seed=7, mutate=straggle))
    assert {i.symptom for i in items} == {"straggler"}
    assert eng.suppressed >= 1


def test_nan_ladder_after_the_first_rollback_applies_loss_rungs_with_a_rollback():
    eng = RemediationEngine(job=JOB)
    nan_at = {700, 850, 1290}  # 850: inside the verification window; 1290: long after it

    def m(s, r):
        if s in nan_at:
            r.loss = float("nan")
    items = []
    for r in healthy(1300, seed=8, mutate=m):
        if r.step % 250 == 0:
            eng.observe(EventRecord("checkpoint_saved", step=r.step, fields={"tag": f"step-{r.step:08d}"}), r.time)
        if r.step == 710:
            eng.on_restart(r.time, attempt=2)   # the rollback happened (the trace just continues)
        items.extend(eng.observe(r, r.time))
    first, second, third = _decisions(items)
    assert (first.action_kind, first.apply) == ("rollback_skip", "rollback_skip")
    assert (second.action_kind, second.apply) == ("lower_clip", "rollback_skip")
    assert second.config_patch["train.gradient_clipping"] == 0.5 and second.skip_ranges
    (fa, fb), = first.skip_ranges
    assert any(a <= fa and fb <= b for a, b in second.config_patch["data.skip_ranges"])  # earlier skips kept
    # A NaN's onset is exact: the newest clean save before it (750, saved with finite loss before the NaN at
    # 850), not a known-good one rollback_steps_back earlier (test_rem_rollback_exact.py).
    assert second.hot_control["suspect"] is True and second.rollback_tag == "step-00000750"
    # A NaN long after the verified window continues the ladder (the clip patch is still in force).
    assert (third.action_kind, third.apply, third.rollback_tag) == ("fp32_layers", "rollback_skip", "step-00001250")
