"""Property tests (hypothesis): healthy traces raise nothing; no sequence of findings or crashes drives any
action past its bounds; decisions are always well-formed."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rem_helpers import healthy

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.detectors import SYMPTOMS, Finding
from ulyssesd.remediation.engine import Decision, RemediationEngine
from ulyssesd.remediation.playbook import (
    APPLIES,
    K_CLIP,
    K_FP32,
    K_GA,
    K_LAYERS,
    K_LIVE,
    K_LR,
    K_MB,
    K_PERSIST,
    K_PREFETCH,
    K_REDUCE,
    K_SKIP,
    LADDERS,
)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LABELS = ["cuda_oom", "host_oom_killed", "nccl_timeout", "nccl_error", "gpu_hardware", "disk_full",
          "checkpoint_corrupt", "segfault", "launcher_error", "dataloader_crash", "nan_loss", "loss_scale_min",
          "loss_scale_overflow", "illegal_memory_access", "healthy"]


@SETTINGS
@given(seed=st.integers(0, 10_000), n=st.integers(150, 1200), loss_noise=st.floats(0.0, 0.06),
       time_noise=st.floats(0.0, 0.1), mem_noise=st.floats(0.0, 0.02))
def test_random_healthy_traces_raise_nothing(seed, n, loss_noise, time_noise, mem_noise):
    eng = RemediationEngine(DetectorsConfig(device_memory_gib=80.0), RemediationConfig())
    for r in healthy(n, seed=seed, loss_noise=loss_noise, time_noise=time_noise, mem_noise=mem_noise):
        out = eng.tick(r.time) + eng.observe(r, r.time)
        assert out == [], [(getattr(o, "symptom", None), o.step) for o in out]


job_strategy = st.fixed_dictionaries({
    "train.gradient_clipping": st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    "train.lr": st.floats(1e-6, 1e-2),
    "precision.fp32_layers": st.integers(0, 4),
    "model.num_layers": st.integers(4, 96),
    "train.micro_batch_size": st.integers(1, 16),
    "train.gradient_accumulation_steps": st.integers(1, 8),
    "precision.dtype": st.sampled_from(["fp16", "bf16", "fp32"]),
    "deepspeed.config.zero_optimization.reduce_bucket_size": st.sampled_from([5e7, 8e7, 5e8]),
})
event_strategy = st.one_of(
    st.tuples(st.just("finding"), st.sampled_from([s for s in SYMPTOMS]), st.integers(1, 300)),
    st.tuples(st.just("crash"), st.sampled_from(LABELS), st.integers(1, 300)),
    st.tuples(st.just("restart"), st.just(""), st.integers(1, 5000)),
    st.tuples(st.just("ckpt"), st.just(""), st.integers(1, 300)),
)


@SETTINGS
@given(job=job_strategy, events=st.lists(event_strategy, min_size=1, max_size=80),
       mode=st.sampled_from(["act", "observe"]))
def test_no_sequence_of_findings_drives_an_action_past_its_bounds(job, events, mode):
    policy = RemediationConfig(mode=mode, max_restarts_per_hour=1000, no_progress_restarts=1000)
    eng = RemediationEngine(DetectorsConfig(), policy, job)
    initial_lr = job["train.lr"]
    global_batch = job["train.micro_batch_size"] * job["train.gradient_accumulation_steps"]
    step, now, attempt, stopped = 1, 0.0, 1, False
    for kind, what, gap in events:
        step += gap
        now += gap
        if kind == "finding":
            out = eng.on_finding(Finding(what, step, "warning", {"since_step": step}, f"step {step}: {what}."), now)
            # Grace symptoms decide on their second report (a recurrence inside the grace window).
        elif kind == "crash":
            out = eng.on_crash(what, ["evidence"], now)
        elif kind == "restart":
            attempt += 1
            eng.on_restart(now, attempt=attempt)
            out = []
        else:
            eng.checkpoint_saved(f"step-{step:08d}", step)
            out = []
        for d in out:
            assert isinstance(d, Decision)
            assert not stopped, "a decision after a stop"
            assert d.apply in APPLIES and d.reason
            assert 0 <= d.ladder_step < len(LADDERS[d.ladder])
            if mode == "observe":
                assert d.apply == "none" and d.reason.startswith("observe-only: would have")
            elif d.apply == "stop":
                stopped = True
            if d.skip_ranges:
                for a, b in d.skip_ranges:
                    assert 0 <= a < b
        v = eng.values
        clip0 = job["train.gradient_clipping"]
        assert v[K_CLIP] == clip0 or policy.clip_floor <= v[K_CLIP] <= max(1.0, clip0)
        assert v[K_LR] >= policy.lr_floor_frac * initial_lr * (1 - 1e-9) and v[K_LR] <= initial_lr
        assert 0 <= v[K_FP32] <= v[K_LAYERS]
        assert v[K_MB] >= 1 and v[K_MB] * v[K_GA] == global_batch
        assert v[K_PERSIST] <= max(policy.persistence_threshold_min, 1e5)
        assert v[K_LIVE] >= policy.max_live_parameters_floor and v[K_PREFETCH] >= policy.prefetch_bucket_floor
        r0 = job["deepspeed.config.zero_optimization.reduce_bucket_size"]
        assert v[K_REDUCE] == r0 or v[K_REDUCE] <= policy.reduce_bucket_ceiling
        for a, b in v[K_SKIP]:
            assert 0 <= a < b


@SETTINGS
@given(events=st.lists(st.sampled_from(["nan_loss", "loss_spike", "memory_spike"]), min_size=1, max_size=40))
def test_rollbacks_skip_between_min_and_max_batches(events):
    policy = RemediationConfig(max_restarts_per_hour=1000, no_progress_restarts=1000, max_rollbacks=50)
    eng = RemediationEngine(DetectorsConfig(), policy, {"train.micro_batch_size": 2})
    for r in healthy(50, seed=1):
        eng.observe(r, r.time)  # 16 samples per step from the records
    step = 50
    for i, symptom in enumerate(events):
        step += 37
        eng.checkpoint_saved(f"step-{step:08d}", step)
        eng.known_good.append((f"step-{step:08d}", step))
        for d in eng.on_finding(Finding(symptom, step + 5, "critical", {}, "x."), float(i)):
            if d.apply == "rollback_skip":
                ((a, b),) = d.skip_ranges
                batches = (b - a) / 16
                assert policy.skip_min_batches <= batches <= policy.skip_max_batches, batches
                assert d.rollback_to_step is not None and d.rollback_to_step < step + 5
