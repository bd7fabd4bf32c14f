"""A CUDA OOM mid-run that the attempt's own measured footprint does not explain is a transient spike, not the
config (issue 21, H200 device calls 10 and 13): relaunch unchanged; the same OOM at the same step right after
is the step's (skip its batches from the latest checkpoint); elsewhere, or after the skip, the evidence ladder
calibrated by the measured steady peak. OOMs the config explains keep today's path. Real engine, the real
planner over the shipped spec, torch's real OOM message (the one of call 13)."""

from __future__ import annotations

import test_memory_evidence as me

from ulyssesd.remediation.config import RemediationConfig
from ulyssesd.remediation.detectors.memory_spike import MIN_STEADY_STEPS, Footprint
from ulyssesd.remediation.engine import RemediationEngine
from ulyssesd.remediation.playbook import K_ACKPT, K_ALLOC, K_GA, K_MB, K_SKIP
from ulyssesd.remediation.records import EventRecord, StepRecord

# bench/results/gpu_call13_raw.tgz oom/spike_telemetry.jsonl: the shipped 32K config's steps 1-2, and the OOM.
CALL13_PEAKS = (67.7136, 78.2496)
CALL13_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity "
              "of 139.80 GiB of which 339.06 MiB is free. Including non-PyTorch memory, this process has 139.46 GiB "
              "memory in use. Of the allocated memory 138.14 GiB is allocated by PyTorch, and 38.71 MiB is reserved "
              "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def attempt(engine: RemediationEngine, number: int, peaks: tuple[float, ...], *, start: int = 0, version: int = 1,
            save_at: int | None = None, t: float = 0.0) -> None:
    """Attempt `number` as the job reports it: `started` (resumed at `start`), one step record per peak."""
    engine.observe(EventRecord("started", step=start, attempt=number, fields={"start_step": start,
                                                                              "config_version": version}), t)
    for i, peak in enumerate(peaks):
        step = start + 1 + i
        engine.observe(StepRecord(step=step, loss=10.0 - 0.1 * step, time=t + step, attempt=number,
                                  step_time_s=1.2, mem_max_allocated_gib=peak, samples=(step - 1, step),
                                  config_version=version), t + step)
        if save_at == step:
            engine.observe(EventRecord("checkpoint_saved", step=step, attempt=number,
                                       fields={"tag": f"step-{step:08d}"}), t + step)


def shipped(**train):
    engine, replan, _ = me.setup("gpt-1b-1xh200.toml", me.H200, **train)
    return engine, replan


# ------------------------------------------------------------------------------------------ the call-10/13 case
def test_call13_spike_relaunches_unchanged_and_names_its_evidence():
    engine, replan = shipped()
    attempt(engine, 1, CALL13_PEAKS)
    [d] = engine.on_crash("cuda_oom", [CALL13_OOM], 100.0, replan=replan)
    assert d.action_kind == "relaunch_unchanged" and d.apply == "restart_latest" and d.config_patch == {}, d.reason
    assert ("steps 1-2 peaked at 78.2 GiB under this config v1 (planner 79.4); the OOM had 138.1 GiB allocated, "
            "+59.9 GiB beyond it") in d.reason and "transient; relaunching unchanged" in d.reason
    ev = engine.memory_evidence
    assert ev["cause"] == "transient" and ev["steady"]["peak_gib"] == 78.2496 and ev["steady"]["steps"] == 2
    assert ev["oom"]["allocated_gib"] == 138.14 and ev["margin_gib"] < ev["excess_gib"] and ev["oom_step"] == 3
    assert engine.values[K_ACKPT] == 0   # nothing changed: today's path recomputed every layer for the rest of the run


def test_a_recurrence_at_the_same_step_skips_its_batches_then_the_ladder_decides():
    engine, replan = shipped()
    attempt(engine, 1, CALL13_PEAKS, save_at=2)
    [d1] = engine.on_crash("cuda_oom", [CALL13_OOM], 100.0, replan=replan)
    assert d1.action_kind == "relaunch_unchanged"
    engine.on_restart(110.0, attempt=2)
    attempt(engine, 2, (), start=2, t=110.0)   # resumed from step-00000002, out of memory in step 3 again
    [d2] = engine.on_crash("cuda_oom", [CALL13_OOM], 130.0, replan=replan)
    assert d2.action_kind == "rollback_skip" and d2.apply == "rollback_skip", d2.reason
    assert d2.rollback_to_step == 2 and d2.rollback_tag == "step-00000002"   # the weights are sound: the latest tag
    assert d2.config_patch == {K_SKIP: [(2, 3)]} and d2.skip_ranges == [(2, 3)]   # step 3's sample only
    assert "recurred in step 3 after relaunching unchanged (the first in step 3" in d2.reason
    assert engine.memory_evidence["cause"] == "step_driven"
    # It came back after the skip too: not the batch. The evidence ladder, calibrated by the steady peak (78.2
    # measured < 79.4 planned: no shortfall), not by the OOM's 138 GiB.
    engine.on_restart(140.0, attempt=3)
    attempt(engine, 3, (), start=2, version=2, t=140.0)
    [d3] = engine.on_crash("cuda_oom", [CALL13_OOM], 160.0, replan=replan)
    assert d3.action_kind == "checkpoint_every_layer" and d3.config_patch == {K_ACKPT: 1}, d3.reason
    assert "calibrated by the measured steady peak 78.2 GiB" in d3.reason and "the planner missed" not in d3.reason
    assert engine.memory_evidence["planner_shortfall_gib"] == 0.0


def test_a_recurrence_elsewhere_goes_to_the_calibrated_ladder():
    engine, replan = shipped()
    attempt(engine, 1, CALL13_PEAKS)
    [d1] = engine.on_crash("cuda_oom", [CALL13_OOM], 100.0, replan=replan)
    engine.on_restart(110.0, attempt=2)
    attempt(engine, 2, (*CALL13_PEAKS, 78.1, 78.3, 78.2), t=110.0)   # steps 1-5 fine, out of memory in step 6
    [d2] = engine.on_crash("cuda_oom", [CALL13_OOM], 130.0, replan=replan)
    assert d1.action_kind == "relaunch_unchanged" and d2.action_kind == "checkpoint_every_layer", d2.reason
    assert "it recurred after relaunching unchanged" in d2.reason and engine.memory_evidence["steady_peak_gib"] > 78


def test_an_attempt_that_got_well_past_the_spike_gets_a_fresh_relaunch():
    engine, replan = shipped()
    engine.policy = RemediationConfig(verify_steps=5)
    attempt(engine, 1, CALL13_PEAKS)
    engine.on_crash("cuda_oom", [CALL13_OOM], 100.0, replan=replan)
    engine.on_restart(110.0, attempt=2)
    attempt(engine, 2, (78.2,) * 20, t=110.0)   # 18 steps past the first OOM: that one was transient
    [d] = engine.on_crash("cuda_oom", [CALL13_OOM], 200.0, replan=replan)
    assert d.action_kind == "relaunch_unchanged" and engine.memory_evidence["oom_step"] == 21


def test_the_relaunch_stays_under_the_no_progress_rule_and_the_restart_budget():
    engine, replan = shipped()
    for n in range(1, engine.policy.no_progress_restarts + 2):
        engine.on_restart(10.0 * n, attempt=n)
    attempt(engine, engine.policy.no_progress_restarts + 1, CALL13_PEAKS, t=100.0)
    [d] = engine.on_crash("cuda_oom", [CALL13_OOM], 200.0, replan=replan)
    assert d.apply == "stop" and d.symptom == "no_progress" and engine.memory_evidence["cause"] == "transient"
    engine, replan = shipped()
    for n in range(1, engine.policy.max_restarts_per_hour + 2):
        engine.on_restart(float(n), attempt=n)
        engine.observe(EventRecord("checkpoint_saved", step=n, attempt=n, fields={"tag": f"step-{n:08d}"}), n)
    attempt(engine, engine.policy.max_restarts_per_hour + 1, CALL13_PEAKS, start=100, t=100.0)
    [d] = engine.on_crash("cuda_oom", [CALL13_OOM], 200.0, replan=replan)
    assert d.apply == "stop" and d.symptom == "crash_loop" and engine.memory_evidence["cause"] == "transient"


# ------------------------------------------------------------------------------------------ today's path kept
def test_an_oom_in_the_first_step_keeps_todays_path():
    """Issue 21's real OOM (32K, micro-batch 4): attempt 1 died in its first step, no steady peak measured."""
    engine, replan = shipped(seq_len=32768, micro_batch_size=4, activation_checkpoint_every=0)
    attempt(engine, 1, ())
    [d] = engine.on_crash("cuda_oom", [me.oom_new(1.5, 139.81, 0.6, 139.0, 137.95, 0.02)], 100.0, replan=replan)
    assert d.action_kind == "memory_combination" and d.config_patch == {K_MB: 2, K_GA: 2}, d.reason
    # One measured step is no steady peak either (the first step lacks the optimizer moments).
    engine, replan = shipped()
    attempt(engine, 1, CALL13_PEAKS[:MIN_STEADY_STEPS - 1])
    [d] = engine.on_crash("cuda_oom", [CALL13_OOM], 100.0, replan=replan)
    assert d.action_kind == "memory_combination" and engine.memory_evidence["cause"] == "activations", d.reason
    assert replan(d.config_patch).fits


def test_fragmentation_after_steady_steps_is_still_fragmentation():
    engine, replan = shipped(env={"NCCL_NVLS_ENABLE": "0"})
    engine.values[K_ALLOC] = None
    attempt(engine, 1, CALL13_PEAKS)
    line = ("RuntimeError: CUDA out of memory. Tried to allocate 4.00 GiB (GPU 0; 139.81 GiB total capacity; "
            "80.20 GiB already allocated; 2.90 GiB free; 136.00 GiB reserved in total by PyTorch)")
    [d] = engine.on_crash("cuda_oom", [line], 100.0, replan=replan)
    assert d.action_kind == "expandable_segments" and engine.memory_evidence["cause"] == "fragmentation", d.reason


def test_a_small_overshoot_of_a_steady_peak_near_capacity_is_the_config():
    """Steps at 126-128 GiB, then 138.1 GiB allocated: +10 GiB is within the margin (15 % of 139.8 GiB = 21 GiB),
    so the config's own footprint ran out of room: the ladder, calibrated by the OOM as today."""
    engine, replan = shipped()
    attempt(engine, 1, (126.0, 128.0, 127.5))
    [d] = engine.on_crash("cuda_oom", [CALL13_OOM], 100.0, replan=replan)
    assert d.action_kind == "memory_combination" and engine.memory_evidence["cause"] == "activations", d.reason
    assert replan(d.config_patch).fits and engine.memory_evidence["predicted_required_gib"] + 10.0 <= 139.8
    assert engine.memory_evidence["planner_shortfall_gib"] > 50 and "transient" not in d.reason


def test_footprint_counts_only_the_running_config_version_and_attempt():
    fp = Footprint()
    fp.restart(1)
    fp.observe(StepRecord(step=1, loss=1.0, mem_max_allocated_gib=50.0, config_version=1))
    fp.observe(StepRecord(step=2, loss=1.0, mem_max_allocated_gib=float("nan"), config_version=1))
    assert fp.steady_peak() is None and fp.oom_step() == 3   # one measured step; NaN is no measurement
    fp.observe(StepRecord(step=3, loss=1.0, mem_max_allocated_gib=30.0, config_version=2))
    fp.observe(StepRecord(step=4, loss=1.0, mem_max_allocated_gib=31.0, config_version=2))
    assert fp.steady_peak() == 31.0 and fp.first_step == 3   # v1's 50 GiB is another config's footprint
    fp.restart(2)
    assert fp.steady_peak() is None and fp.oom_step() is None
    fp.observe(EventRecord("started", attempt=2, fields={"start_step": 40}))
    assert fp.oom_step() == 41


def test_without_a_planner_the_measured_footprint_still_decides():
    """A CPU host or a command job: no planner, the margin is 15 % of the message's capacity; the call-13 OOM is
    still transient, and an overshoot within the margin walks the plain ladder as today."""
    engine, _ = shipped()
    attempt(engine, 1, CALL13_PEAKS)
    [d] = engine.on_crash("cuda_oom", [CALL13_OOM], 100.0, replan=None)
    assert d.action_kind == "relaunch_unchanged" and "(planner" not in d.reason and "margin 21.0 GiB" in d.reason
    engine, _ = shipped()
    attempt(engine, 1, (130.0, 131.0))
    [d] = engine.on_crash("cuda_oom", [CALL13_OOM], 100.0, replan=None)
    # The plain ladder from its position (the first two rungs do not apply to the shipped spec).
    assert d.action_kind == "halve_live_parameters" and engine.memory_evidence is None, d.reason
