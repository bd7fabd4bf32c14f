"""Playbook: ladder order as docs/REMEDIATION.md specifies it, and every action's preconditions and bounds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ulyssesd.remediation.config import RemediationConfig
from ulyssesd.remediation.playbook import (
    CRASH_LADDER,
    K_ALLOC,
    K_CLIP,
    K_DTYPE,
    K_FP32,
    K_GA,
    K_LAYERS,
    K_LIVE,
    K_LR,
    K_MB,
    K_OFFLOAD,
    K_PERSIST,
    K_PREFETCH,
    K_REDUCE,
    LADDERS,
    SYMPTOM_LADDER,
    Context,
    Proposal,
    merge_ranges,
)

POLICY = RemediationConfig()

# docs/REMEDIATION.md "The ladders as specified", in order.
EXPECTED = {
    "memory": ["raise_persistence_threshold", "expandable_segments", "halve_live_parameters", "halve_micro_batch",
               "checkpoint_every_layer", "offload_optimizer", "stop_alert"],
    "loss": ["lower_clip", "fp32_layers", "lower_lr", "rollback_skip", "stop_alert"],
    "nan": ["rollback_skip", "lower_clip", "fp32_layers", "lower_lr", "rollback_skip", "fp16_to_bf16", "stop_alert"],
    "slow": ["collect_evidence", "raise_reduce_bucket", "alert"],
    "hang": ["hang_restart", "stop_alert"],
}
# The words of each specified table row that name the rungs, in the row's order.
DESIGN_WORDS = {
    "memory": ("persistence threshold", "expandable_segments", "stage3_max_live_parameters", "halve micro-batch",
               "checkpoint every layer", "offload optimizer", "stop + alert"),
    "loss": ("clip 1.0", "FP32 compute", "LR −10 %", "roll back to known-good"),
    "slow": ("evidence first", "reduce_bucket_size"),
    "hang": ("stack dump", "SIGTERM", "SIGKILL", "restart from latest valid"),
}


@pytest.mark.parametrize("ladder", sorted(EXPECTED))
def test_ladder_order_matches_design(ladder):
    assert [a.kind for a in LADDERS[ladder]] == EXPECTED[ladder]


def test_design_table_lists_rungs_in_this_order():
    doc = Path(__file__).resolve().parents[2] / "docs" / "REMEDIATION.md"
    text = doc.read_text().split("## The ladders as specified", 1)[1]
    rows = {"memory": "memory spike", "loss": "loss oscillation / spike", "slow": "slow steps", "hang": "| hang"}
    for ladder, marker in rows.items():
        row = next(line for line in text.splitlines() if line.startswith("|") and marker in line)
        positions = [row.find(w) for w in DESIGN_WORDS[ladder]]
        assert -1 not in positions, (ladder, DESIGN_WORDS[ladder], row)
        assert positions == sorted(positions), (ladder, row)
    assert re.search(r"NaN/Inf loss.*roll back \+ skip, then the loss ladder; fp16 → bf16", text)


def test_every_symptom_and_crash_label_has_a_ladder():
    assert set(SYMPTOM_LADDER) == {"memory_spike", "loss_spike", "loss_oscillation", "nan_loss", "overflow_storm",
                                   "slow_step", "straggler", "throughput_drop", "hang"}
    labels = {"cuda_oom", "host_oom_killed", "nccl_timeout", "nccl_error", "loss_scale_overflow", "loss_scale_min",
              "nan_loss", "illegal_memory_access", "gpu_hardware", "disk_full", "checkpoint_corrupt",
              "dataloader_crash", "launcher_error", "segfault", "healthy"}
    assert labels <= set(CRASH_LADDER)
    assert all(ladder in LADDERS for ladder, _ in CRASH_LADDER.values())
    assert CRASH_LADDER["cuda_oom"][0] == "memory" and LADDERS["gpu_hardware"][0].apply == "stop"


def _ctx(**values) -> Context:
    return Context(values=dict(values), initial=dict(values), launched=dict(values), policy=POLICY)


def _act(ladder: str, kind: str):
    return next(a for a in LADDERS[ladder] if a.kind == kind)


def test_clip_halves_down_to_the_floor_then_refuses():
    act = _act("loss", "lower_clip")
    ctx = _ctx(**{K_CLIP: 1.0})
    seen = []
    for _ in range(10):
        p = act.build(ctx)
        if isinstance(p, str):
            assert "floor" in p
            break
        seen.append(p.patch[K_CLIP])
        assert p.hot_control == {"gradient_clipping": p.patch[K_CLIP]}
        ctx.values.update(p.patch)
    assert seen == [0.5, 0.25, 0.125, 0.1]
    assert isinstance(act.build(_ctx(**{K_CLIP: 0.0})), Proposal)  # clipping off -> on at 1.0


def test_fp32_layers_capped_by_model_layers():
    act = _act("loss", "fp32_layers")
    p = act.build(_ctx(**{K_FP32: 0, K_LAYERS: 4}))
    assert isinstance(p, Proposal) and p.patch == {K_FP32: 4}
    assert isinstance(act.build(_ctx(**{K_FP32: 4, K_LAYERS: 4})), str)
    assert act.build(_ctx(**{K_FP32: 0, K_LAYERS: 96})).patch == {K_FP32: 10}


def test_lr_steps_down_10_percent_to_the_floor():
    act = _act("loss", "lower_lr")
    ctx = _ctx(**{K_LR: 1e-4})
    lrs = []
    while not isinstance(p := act.build(ctx), str):
        lrs.append(p.patch[K_LR])
        assert p.hot_control["lr_scale"] == pytest.approx(p.patch[K_LR] / 1e-4)
        ctx.values.update(p.patch)
    assert lrs[0] == pytest.approx(0.9e-4) and min(lrs) == pytest.approx(0.5e-4)
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))


def test_micro_batch_halving_keeps_global_batch_and_stops_at_one():
    act = _act("memory", "halve_micro_batch")
    ctx = _ctx(**{K_MB: 6, K_GA: 2})
    while not isinstance(p := act.build(ctx), str):
        ctx.values.update(p.patch)
        assert ctx.values[K_MB] * ctx.values[K_GA] == 12 and ctx.values[K_MB] >= 1
    assert ctx.values[K_MB] == 1 and "already 1" in p


def test_memory_rungs_preconditions():
    assert _act("memory", "raise_persistence_threshold").build(_ctx(**{K_PERSIST: 1e5})).patch == {K_PERSIST: 1000000}
    assert isinstance(_act("memory", "raise_persistence_threshold").build(_ctx(**{K_PERSIST: 2e6})), str)
    p = _act("memory", "expandable_segments").build(_ctx(**{K_ALLOC: "max_split_size_mb:128"}))
    assert p.patch == {K_ALLOC: "max_split_size_mb:128,expandable_segments:True"}
    assert isinstance(_act("memory", "expandable_segments").build(_ctx(**{K_ALLOC: "expandable_segments:True"})), str)
    p = _act("memory", "halve_live_parameters").build(_ctx(**{K_LIVE: 1e9, K_PREFETCH: 5e7}))
    assert p.patch == {K_LIVE: 500000000, K_PREFETCH: 25000000}
    assert isinstance(_act("memory", "halve_live_parameters").build(_ctx(**{K_LIVE: 1e7, K_PREFETCH: 1e6})), str)
    assert isinstance(_act("memory", "offload_optimizer").build(_ctx(**{K_OFFLOAD: "cpu"})), str)


def test_reduce_bucket_doubles_up_to_the_ceiling():
    act = _act("slow", "raise_reduce_bucket")
    assert act.build(_ctx(**{K_REDUCE: 5e7})).patch == {K_REDUCE: 100000000}
    assert isinstance(act.build(_ctx(**{K_REDUCE: 1e8})), str)
    assert isinstance(act.build(_ctx(**{K_REDUCE: 5e8})), str)  # DeepSpeed's default is already above it
    one_slow_rank = _ctx(**{K_REDUCE: 5e7})
    one_slow_rank.evidence = {"rank_spread": 1.8}
    assert "not comm-bound" in act.build(one_slow_rank)


def test_bf16_only_from_fp16_on_bf16_hardware():
    act = _act("nan", "fp16_to_bf16")
    assert act.build(_ctx(**{K_DTYPE: "fp16"})).patch == {K_DTYPE: "bf16"}
    assert isinstance(act.build(_ctx(**{K_DTYPE: "bf16"})), str)
    ctx = _ctx(**{K_DTYPE: "fp16"})
    ctx.policy = RemediationConfig(bf16_supported=False)
    assert "no bf16" in act.build(ctx)


def test_merge_ranges():
    assert merge_ranges([(5, 10), (0, 3), (8, 12), (12, 13)]) == [(0, 3), (5, 13)]
