"""Evidence-driven memory remediation (remediation/memory_evidence.py + the engine's crash path), with the real
planner over real run specs (daemon/operator/ctl_plan.py `memory_replanner`) and torch's real OOM message formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rem_helpers import engine_job

from ulyssesd.daemon.operator.ctl_plan import memory_replanner
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.remediation.config import RemediationConfig
from ulyssesd.remediation.engine import RemediationEngine
from ulyssesd.remediation.memory_evidence import PlanView, choose, classify, parse_oom
from ulyssesd.remediation.playbook import K_ALLOC, K_GA, K_MB, K_OFFLOAD, Context
from ulyssesd.training.planner import Cluster
from ulyssesd.training.spec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
FIXTURES = ROOT / "tests" / "fixtures" / "logs"
H200 = Cluster.preset("h200-141g", gpus_per_node=1, nodes=1)
A100 = Cluster.preset("a100-80g", gpus_per_node=1, nodes=1)


def oom_new(requested: float, total: float, free: float, in_use: float, allocated: float, unallocated: float) -> str:
    """torch >= 2.5's message (the format of tests/fixtures/logs/cuda_oom/01-*.log), with these sizes."""
    return (f"[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {requested:.2f} GiB. GPU 0 has a "
            f"total capacity of {total:.2f} GiB of which {free:.2f} GiB is free. Including non-PyTorch memory, this "
            f"process has {in_use:.2f} GiB memory in use. Of the allocated memory {allocated:.2f} GiB is allocated by "
            f"PyTorch, and {unallocated:.2f} GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
            "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def setup(spec: str, cluster: Cluster, env: dict | None = None, **train):
    """(engine, replan, config) for `spec` with `train` overrides, as the daemon holds them."""
    rs = load_run_spec(CONFIGS / spec)
    cfg = rs.job.model_dump(mode="json")
    sp = train.pop("sp", None)
    if sp:
        cfg["parallel"]["sequence_parallel_size"] = sp
    cfg["train"].update(train)
    env = dict(rs.launcher.env) if env is None else env
    engine = RemediationEngine(job=engine_job(JobSpec.model_validate(cfg)), policy=RemediationConfig())
    engine.values[K_ALLOC] = env.get("PYTORCH_CUDA_ALLOC_CONF")
    engine.initial = dict(engine.values)
    rs = rs.model_copy(update={"launcher": rs.launcher.model_copy(update={"env": env})})
    return engine, memory_replanner(rs, cfg, {}, cluster), cfg


# ------------------------------------------------------------------------------------------ parsing
def test_parse_torch_25_format_from_a_real_log():
    log = (FIXTURES / "cuda_oom" / "01-rank3-oom-peers-nccl-error-torchrun.log").read_text()
    oom = parse_oom(log.splitlines())
    assert oom is not None
    assert (oom.requested_gib, oom.total_gib, oom.free_gib) == (25.96, 79.18, 23.04)
    assert (oom.allocated_gib, oom.reserved_unallocated_gib, oom.in_use_gib) == (51.20, 3.41, 56.13)


def test_parse_legacy_format_mib_and_zero_bytes():
    legacy = [json.loads(p.read_text()) for p in sorted((FIXTURES / "cuda_oom").glob("02-*.json"))]
    assert legacy  # the fixture exists; its text below is the format it documents
    oom = parse_oom("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 39.59 GiB total capacity; "
                    "35.12 GiB already allocated; 1.04 GiB free; 36.80 GiB reserved in total by PyTorch)")
    assert oom is not None and oom.total_gib == 39.59 and oom.allocated_gib == 35.12 and oom.free_gib == 1.04
    assert oom.reserved_unallocated_gib == pytest.approx(36.80 - 35.12)
    small = parse_oom("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 978.00 MiB (GPU 0; 4.00 GiB "
                      "total capacity; 1.68 GiB already allocated; 0 bytes free; 2.72 GiB reserved in total by PyTorch)")
    assert small is not None and small.requested_gib == pytest.approx(978 / 1024) and small.free_gib == 0.0


def test_absurd_sizes_are_not_evidence():
    huge = "9" * 400
    assert parse_oom([f"CUDA out of memory. Tried to allocate {huge} GiB"]) is None
    oom = parse_oom([oom_new(2.0, 139.81, 1.2, 138.6, 136.1, 1.4).replace("136.10 GiB is allocated",
                                                                          f"{huge} GiB is allocated")])
    assert oom is not None and oom.allocated_gib is None and oom.requested_gib == 2.0


@pytest.mark.parametrize("line", ["RuntimeError: CUDA error: out of memory", "loss 2.31 step 10",
                                  "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"])
def test_no_sizes_no_report(line):
    assert parse_oom([line]) is None


# ------------------------------------------------------------------------------------------ the issue's case
def test_issue_case_activations_jump_to_the_micro_batch_rung():
    """gpt-1b at 32K, micro-batch 4, no recompute, on a 141 GB H200: activations dominate; the fix search's cheapest
    fitting combination is micro-batch 2 x accumulation 2 (no step-time cost measured for it), not the persistence
    threshold the blind ladder starts with."""
    engine, replan, _ = setup("gpt-1b-1xh200.toml", H200, seq_len=32768, micro_batch_size=4,
                              activation_checkpoint_every=0)
    line = oom_new(2.0, 139.81, 1.20, 138.60, 136.10, 1.40)
    [d] = engine.on_crash("cuda_oom", [line], 100.0, replan=replan)
    assert d.action_kind == "memory_combination" and d.apply == "restart_latest"
    assert d.config_patch == {K_MB: 2, K_GA: 2}
    assert engine.memory_evidence["predicted_step_cost"] == 0.0 and engine.memory_evidence["combination"]
    assert engine.memory_evidence["cause"] == "activations" and engine.memory_evidence["oom"]["allocated_gib"] == 136.10
    assert "activations 221" in d.reason and "re-planned" in d.reason and "136.10 GiB allocated" in d.reason
    assert replan(d.config_patch).fits   # the choice was re-planned: the config it launches fits
    # The blind ladder (no planner, no fragmentation in the message) would not have started there.
    blind, _, _ = setup("gpt-1b-1xh200.toml", H200, seq_len=32768, micro_batch_size=4, activation_checkpoint_every=0)
    [b] = blind.on_crash("cuda_oom", [line], 100.0)
    assert b.action_kind != "halve_micro_batch"


def test_fragmentation_goes_to_expandable_segments_with_and_without_planner():
    env = {"NCCL_NVLS_ENABLE": "0"}   # no expandable segments
    # The shipped gpt-1b spec (32K, no recompute: ~80 GiB allocated) whose allocator holds 56 GiB it cannot use.
    line = ("RuntimeError: CUDA out of memory. Tried to allocate 4.00 GiB (GPU 0; 139.81 GiB total capacity; "
            "80.20 GiB already allocated; 2.90 GiB free; 136.00 GiB reserved in total by PyTorch)")
    for with_planner in (True, False):
        engine, replan, _ = setup("gpt-1b-1xh200.toml", H200, env=env)
        [d] = engine.on_crash("cuda_oom", [line], 100.0, replan=replan if with_planner else None)
        assert d.action_kind == "expandable_segments", d.reason
        assert d.config_patch == {K_ALLOC: "expandable_segments:True"}
        assert "55.80 GiB reserved but unallocated" in d.reason and "fragmentation" in d.reason
        assert engine.memory_evidence.get("predicted_required_gib", 0) < 139.8
    # The same numbers with expandable segments already on are not fragmentation.
    assert classify(parse_oom(line), None, {K_ALLOC: "expandable_segments:True"})[0] == "unknown"
    # A healthy-looking allocator (little reserved-but-unallocated) is not fragmentation either.
    tight = parse_oom(oom_new(4.0, 139.81, 1.0, 138.0, 135.0, 1.5))
    assert classify(tight, None, {})[0] == "unknown"


def test_model_states_go_to_offload_and_only_the_change_that_is_needed():
    # gpt-7b on one A100-80GB, 4K tokens, recompute every layer: 104 GiB of model states, 16 GiB activations.
    engine, replan, _ = setup("gpt-7b-2xh200.toml", A100, seq_len=4096, micro_batch_size=1,
                              activation_checkpoint_every=1, sp=1)
    base = replan({})
    assert not base.fits and base.model_states_gib > base.activations_gib
    [d] = engine.on_crash("cuda_oom", [oom_new(1.0, 79.18, 0.9, 78.2, 76.5, 0.7)], 100.0, replan=replan)
    assert d.action_kind == "memory_combination" and engine.memory_evidence["cause"] == "model_states"
    # Only optimizer offload brings 104 GiB of model states under 79 GiB; with it the recompute is no longer needed
    # and dropping it is the cheaper step (+50 % offload - 24 % recompute by the lever cost model).
    assert d.config_patch[K_OFFLOAD] == "cpu" and d.config_patch["train.activation_checkpoint_every"] == 0, d.reason
    assert engine.memory_evidence["predicted_step_cost"] < 0.5
    assert replan(d.config_patch).fits


def test_cannot_converge_stops_at_once_with_the_planners_explanation():
    engine, replan, _ = setup("gpt-176b-8xa100.toml", A100, sp=1)
    [d] = engine.on_crash("cuda_oom", [oom_new(1.0, 79.18, 0.9, 78.2, 76.5, 0.7)], 100.0, replan=replan)
    assert d.apply == "stop" and d.action_kind == "stop_alert"
    assert "no combination of memory levers that keeps the experiment and the hardware is predicted to fit" in d.reason
    assert "short by" in d.reason and "host:" in d.reason and "advice" in d.reason
    assert engine.failed


# ------------------------------------------------------------------------------------------ no-progress rule
def test_converging_ladder_is_not_cut_off_by_no_progress_but_a_blind_one_is():
    """Three restarts without a checkpoint (OOMs before the first save) reach no_progress_restarts=3. A memory
    change predicted to fit still goes ahead; the planner was wrong once (calibrated by the second OOM), the
    next change follows; without evidence the same situation stops the run."""
    engine, replan, cfg = setup("gpt-1b-1xh200.toml", H200, seq_len=32768, micro_batch_size=4,
                                activation_checkpoint_every=0)
    t = 100.0
    for attempt in range(1, 5):
        engine.on_restart(t, attempt=attempt)
        t += 60
    assert engine.restarts_without_progress >= engine.policy.no_progress_restarts
    [d1] = engine.on_crash("cuda_oom", [oom_new(2.0, 139.81, 1.2, 138.6, 136.1, 1.4)], t, replan=replan)
    assert d1.apply == "restart_latest" and d1.config_patch[K_MB] == 2
    # Relaunched with mb 2 (the daemon's new config version); it OOMs again at 137.5 + 3 GiB, more than the
    # planner's peak for mb 2: the shortfall is added to every candidate, which moves on to mb 1.
    cfg["train"].update(micro_batch_size=2, gradient_accumulation_steps=2)
    rs = load_run_spec(CONFIGS / "gpt-1b-1xh200.toml")
    replan2 = memory_replanner(rs, cfg, {}, H200)
    engine.on_restart(t + 60, attempt=5)
    [d2] = engine.on_crash("cuda_oom", [oom_new(3.0, 139.81, 0.5, 139.3, 137.5, 1.8)], t + 120, replan=replan2)
    assert d2.apply == "restart_latest" and d2.config_patch == {K_MB: 1, K_GA: 4}, d2.reason
    assert engine.memory_evidence["planner_shortfall_gib"] > 0 and "the planner missed" in d2.reason
    # Without a planner and without fragmentation in the message, the plain ladder meets the no-progress rule.
    blind, _, _ = setup("gpt-1b-1xh200.toml", H200, seq_len=32768, micro_batch_size=4, activation_checkpoint_every=0)
    for attempt in range(1, 5):
        blind.on_restart(100.0 + 60 * attempt, attempt=attempt)
    [b] = blind.on_crash("cuda_oom", [oom_new(2.0, 139.81, 1.2, 138.6, 136.1, 1.4)], 500.0)
    assert b.apply == "stop" and b.symptom == "no_progress"


def test_a_planner_that_thought_the_failing_config_fits_predicts_nothing():
    # The shipped gpt-1b spec is predicted to fit (78 GiB of 139.8); an OOM without allocator numbers cannot
    # correct that, so the change made is no prediction and the no-progress rule still applies.
    engine, replan, _ = setup("gpt-1b-1xh200.toml", H200)
    assert replan({}).fits
    for attempt in range(1, 5):
        engine.on_restart(100.0 + 60 * attempt, attempt=attempt)
    [d] = engine.on_crash("cuda_oom", ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 25.96 GiB"],
                          500.0, replan=replan)
    assert d.apply == "stop" and d.symptom == "no_progress", d.reason
    fresh, replan, _ = setup("gpt-1b-1xh200.toml", H200)
    [d] = fresh.on_crash("cuda_oom", ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 25.96 GiB"],
                         500.0, replan=replan)
    assert d.apply == "restart_latest" and "not a prediction" in d.reason


def test_restart_budget_still_bounds_a_converging_ladder():
    engine, replan, _ = setup("gpt-1b-1xh200.toml", H200, seq_len=32768, micro_batch_size=4,
                              activation_checkpoint_every=0)
    for attempt in range(1, engine.policy.max_restarts_per_hour + 2):
        engine.on_restart(100.0 + attempt, attempt=attempt)
    [d] = engine.on_crash("cuda_oom", [oom_new(2.0, 139.81, 1.2, 138.6, 136.1, 1.4)], 200.0, replan=replan)
    assert d.apply == "stop" and d.symptom == "crash_loop"


def test_a_failing_planner_falls_back_to_the_message():
    def broken(patch):
        raise RuntimeError("planner exploded")

    ctx = Context({K_ALLOC: None}, {}, {}, RemediationConfig())
    frag = ("RuntimeError: CUDA out of memory. Tried to allocate 4.00 GiB (GPU 0; 139.81 GiB total capacity; "
            "118.50 GiB already allocated; 3.10 GiB free; 134.60 GiB reserved in total by PyTorch)")
    choice = choose([frag], ctx, broken)
    assert choice is not None and choice.action.kind == "expandable_segments" and choice.predicted_fit is None
    assert choose(["no oom here"], ctx, None) is None
    view = PlanView(True, 10.0, 80.0, 9.0, 4.0, 5.0)
    assert classify(None, view, {})[0] == "activations"


# ------------------------------------------------------------------------------------------ the daemon's wiring
def test_daemon_builds_the_replanner_from_its_current_config(monkeypatch):
    from types import SimpleNamespace

    from ulyssesd.daemon.core import exits
    from ulyssesd.daemon.operator import ctl_plan

    rs = load_run_spec(CONFIGS / "gpt-1b-1xh200.toml")
    cfg = rs.job.model_dump(mode="json")
    cfg["train"].update(micro_batch_size=4)   # the daemon's current config version, not the spec as written
    sup = SimpleNamespace(spec=rs, config=cfg, launch_env={})
    monkeypatch.setattr(ctl_plan, "detect_local_cluster", lambda nnodes, nproc: H200)
    replan = exits._memory_replanner(sup)
    assert replan is not None
    assert not replan({}).fits and replan({K_MB: 1, K_GA: 4}).fits
    # No GPU on this host: no planner (the message alone decides); a planner error is not a crash of the tick.
    monkeypatch.setattr(ctl_plan, "detect_local_cluster", lambda nnodes, nproc: None)
    assert exits._memory_replanner(sup) is None

    def boom(nnodes, nproc):
        raise OSError("nvidia-smi hung")

    monkeypatch.setattr(ctl_plan, "detect_local_cluster", boom)
    assert exits._memory_replanner(sup) is None
    command = SimpleNamespace(spec=rs.model_copy(update={"job_section": rs.job_section.model_copy(
        update={"kind": "command"})}), config=cfg, launch_env={})
    assert exits._memory_replanner(command) is None
    # A CPU run on a GPU host: its memory is no GPU plan's business.
    monkeypatch.setattr(ctl_plan, "detect_local_cluster", lambda nnodes, nproc: H200)
    cpu_job = rs.job.model_copy(update={"train": rs.job.train.model_copy(update={"device": "cpu"})})
    assert exits._memory_replanner(SimpleNamespace(spec=rs.model_copy(update={"job": cpu_job}), config=cfg,
                                                   launch_env={})) is None
