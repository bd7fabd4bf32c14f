"""The fix search (training/planner/fixes.py) on issue 30's case: the spec bench/gpu_oom21.py runs on the device
(gpt-1b, 32K tokens, micro-batch 4, no recompute, preflight off) planned for an H100 80 GB. The search finds the
cheapest fitting lever combination by the cost model (best-first = exhaustive), `ulyssesctl plan` lists such a
fix before any hardware or experiment change, the daemon's memory ladder applies it without touching the
experiment, and with nothing that fits it stops and gives the advice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ulyssesd.daemon.operator import ctl_plan
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.remediation.config import RemediationConfig
from ulyssesd.remediation.engine import RemediationEngine
from ulyssesd.remediation.playbook import K_ALLOC
from ulyssesd.training.planner import Cluster, apply_overrides, apply_restart_overrides, plan, search_fixes
from ulyssesd.training.planner.fixes import levers
from ulyssesd.training.planner.rendering import is_advice
from ulyssesd.training.planner.step_cost import cost_table
from ulyssesd.training.spec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "remediation"))
from gpu_oom21 import build_spec  # noqa: E402  (the device's own spec builder)
from rem_helpers import engine_job  # noqa: E402

H100 = Cluster.preset("h100-80g", gpus_per_node=1, nodes=1)
# Keys a fix may never change: the model, the sequence, the parallel layout (SP/DP: the global batch) and the hardware.
EXPERIMENT_KEYS = ("model.preset", "model.hidden_size", "model.num_layers", "model.num_attention_heads",
                   "model.vocab_size", "train.seq_len", "parallel.", "cluster.")


@pytest.fixture(scope="module")
def oom_spec(tmp_path_factory) -> Path:
    """bench/gpu_oom21.py's "oom" run spec, exactly as it builds it for the device."""
    d = tmp_path_factory.mktemp("oom30")
    text = build_spec(ROOT / "configs" / "gpt-1b-1xh200.toml", "oom", d / "state", d / "s.sock",
                      {"train.seq_len": 32768, "train.steps": 6, "train.device": "cuda",
                       "checkpoint.interval_steps": 1000, "checkpoint.save_at_end": False,
                       "train.micro_batch_size": 4, "train.activation_checkpoint_every": 0}, [])
    (d / "oom.toml").write_text(text)
    return d / "oom.toml"


def _search(rs, cluster=H100, **kw):
    ds = ctl_plan.effective_ds_config(rs, cluster.world_size)
    return search_fixes(rs.job, cluster, ds, allocator_headroom=ctl_plan.allocator_headroom(rs), cuda_context_gib=1.0,
                        restart=rs.restart, alloc_conf=rs.launcher.env.get("PYTORCH_CUDA_ALLOC_CONF"), **kw), ds


def _keeps_experiment(job: JobSpec, overrides: dict) -> None:
    assert not any(k.startswith(EXPERIMENT_KEYS) for k in overrides), overrides
    mb = overrides.get("train.micro_batch_size", job.train.micro_batch_size)
    ga = overrides.get("train.gradient_accumulation_steps", job.train.gradient_accumulation_steps)
    assert mb * ga == job.train.micro_batch_size * job.train.gradient_accumulation_steps   # global batch kept


def test_the_issue_case_has_a_cheap_fix_on_an_h100_that_keeps_the_experiment(oom_spec):
    rs = load_run_spec(oom_spec)
    assert rs.daemon.preflight is False and rs.job.train.micro_batch_size == 4
    base = plan(rs.job, H100, ctl_plan.effective_ds_config(rs, 1), search=False,
                allocator_headroom=ctl_plan.allocator_headroom(rs), restart=rs.restart)
    assert not base.fits   # 244 GiB predicted: the OOM of the issue
    found, ds = _search(rs)
    assert found.fixes and found.complete and not found.exhaustive, found.describe()
    best = found.fixes[0]
    _keeps_experiment(rs.job, best.overrides)
    assert best.overrides["train.micro_batch_size"] < 4 and best.step_cost < 0.113   # cheaper than every layer
    for fx in found.fixes:   # each one, re-planned on its own, fits; cheapest first
        j, c, d = apply_overrides(rs.job, H100, ds, fx.overrides)
        r = apply_restart_overrides(rs.restart, fx.overrides)   # a fix may turn a [restart] switch off
        assert plan(j, c, d, search=False, allocator_headroom=0.03, restart=r).fits, fx.describe()
    costs = [(f.step_cost, f.distance) for f in found.fixes]
    assert costs == sorted(costs)
    # The expert's fix (micro-batch 1 x 4, every layer recomputed, tiled loss) fits too, but costs more by the model.
    expert = {"train.micro_batch_size": 1, "train.gradient_accumulation_steps": 4, "train.activation_checkpoint_every": 1}
    j, c, d = apply_overrides(rs.job, H100, ds, expert)
    assert plan(j, c, d, search=False, allocator_headroom=0.03, restart=rs.restart).fits
    assert best.step_cost < 0.244


def test_best_first_finds_exactly_what_the_exhaustive_search_finds(oom_spec):
    """The pruned search's answer equals planning every combination (a smaller space: micro-batch 2)."""
    rs = load_run_spec(oom_spec)
    rs = rs.model_copy(update={"job": JobSpec.model_validate({**rs.job.model_dump(mode="json"), "train": {
        **rs.job.model_dump(mode="json")["train"], "micro_batch_size": 2}})})
    pruned, _ = _search(rs, exhaustive_max=0)
    full, _ = _search(rs, exhaustive_max=10**9)
    assert full.exhaustive and not pruned.exhaustive and pruned.complete
    assert pruned.plans < full.plans / 5, (pruned.plans, full.plans)
    assert [(round(f.step_cost, 9), f.overrides) for f in pruned.fixes] == \
           [(round(f.step_cost, 9), f.overrides) for f in full.fixes]


def test_plan_cli_lists_a_preserving_fix_first_and_hardware_as_advice(oom_spec):
    app = ctl_plan.typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    ctl_plan.register_plan(app)
    res = CliRunner().invoke(app, ["plan", "--spec", str(oom_spec), "--gpu", "h100-80g"])
    assert res.exit_code == 1, res.output
    out = res.output
    first = out.index("Fixes that keep the experiment and the hardware")
    line1 = out[first:].splitlines()[1]
    assert line1.lstrip().startswith("1. micro-batch 4 -> 1") and "recompute" in line1, line1
    assert "H200" not in line1 and "sequence length" not in line1
    assert out.index("H200-141GB") > first and "advice" in out
    # Planned for another machine: which figures are assumed is said.
    assert "host RAM ASSUMED 2048 GiB" in out and "h100-80g preset" in out


def test_the_daemon_ladder_applies_the_cheapest_fit_and_never_the_experiment(oom_spec):
    rs = load_run_spec(oom_spec)
    cfg = rs.job.model_dump(mode="json")
    engine = RemediationEngine(job=engine_job(rs.job), policy=RemediationConfig())
    engine.values[K_ALLOC] = rs.launcher.env.get("PYTORCH_CUDA_ALLOC_CONF")
    engine.initial = dict(engine.values)
    replan = ctl_plan.memory_replanner(rs, cfg, {}, H100)
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of "
           "79.11 GiB of which 0.60 GiB is free. Including non-PyTorch memory, this process has 78.40 GiB memory in "
           "use. Of the allocated memory 77.10 GiB is allocated by PyTorch, and 0.02 GiB is reserved by PyTorch but "
           "unallocated.")
    [d] = engine.on_crash("cuda_oom", [oom], 100.0, replan=replan)
    assert d.action_kind == "memory_combination" and d.apply == "restart_latest", d.reason
    _keeps_experiment(rs.job, d.config_patch)
    ev = engine.memory_evidence
    assert ev["combination"] and ev["predicted_step_cost"] < 0.113 and ev["combination_patch"] == d.config_patch
    assert any("H200" in a for a in ev["advice"])   # hardware is advice in the incident, not applied
    assert replan(d.config_patch).fits and "step time +" in d.reason
    # The same search the planner's CLI ranks first.
    found, _ = _search(rs)
    assert d.config_patch == found.fixes[0].overrides


def test_a_second_oom_is_calibrated_and_picks_a_safer_fit(oom_spec):
    """The first fit OOMs anyway with 4 GiB more allocated than predicted: the next choice carries that margin."""
    rs = load_run_spec(oom_spec)
    first, _ = _search(rs)
    calibrated, _ = _search(rs, under_gib=4.0)
    assert calibrated.fixes and calibrated.fixes[0].gpu_margin_gib >= 0
    assert calibrated.fixes[0].gpu_required_gib + 4.0 <= H100.gpu_mem_gib
    assert calibrated.fixes[0].step_cost >= first.fixes[0].step_cost


def test_no_fit_stops_clearly_with_the_advice():
    """The seed's 176B on one 8xA100 node: host RAM, not a lever, is short; no combination fits: stop, advice."""
    rs = load_run_spec(ROOT / "configs" / "gpt-176b-8xa100.toml")
    cluster = Cluster.preset("a100-80g", gpus_per_node=8)
    cfg = rs.job.model_dump(mode="json")
    engine = RemediationEngine(job=engine_job(rs.job), policy=RemediationConfig())
    replan = ctl_plan.memory_replanner(rs, cfg, {}, cluster)
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of "
           "79.18 GiB of which 0.90 GiB is free. Including non-PyTorch memory, this process has 78.20 GiB memory in "
           "use. Of the allocated memory 76.50 GiB is allocated by PyTorch, and 0.70 GiB is reserved by PyTorch but "
           "unallocated.")
    [d] = engine.on_crash("cuda_oom", [oom], 100.0, replan=replan)
    assert d.apply == "stop" and engine.failed and d.config_patch == {}
    assert "no combination of memory levers that keeps the experiment and the hardware" in d.reason
    assert "advice (hardware or experiment changes, never applied automatically)" in d.reason and "nodes" in d.reason
    assert engine.memory_evidence["advice"] and all(a for a in engine.memory_evidence["advice"])


def test_levers_hold_the_users_setting_and_the_cost_rows_cite_their_source(oom_spec):
    rs = load_run_spec(oom_spec)
    lv = levers(rs.job, ctl_plan.effective_ds_config(rs, 1), rs.launcher.env.get("PYTORCH_CUDA_ALLOC_CONF"))
    names = {x.name for x in lv}
    assert {"micro-batch", "recompute", "TiledMLP", "activation offload", "persistence", "live parameters",
            "offload"} <= names
    assert "allocator" not in names and "tiled loss" not in names   # the spec has both already
    for x in lv:
        assert sum(s.distance == 0 for s in x.settings) == 1   # the user's own setting, once
        assert [s.cost for s in x.settings] == sorted(s.cost for s in x.settings)
    rows = cost_table(rs.job.resolved_model(), 32768)
    assert all(c.source.startswith(("measured: ", "estimate: ")) for _, c in rows)
    assert all("RESULTS.md" in c.source for _, c in rows if c.measured)
    assert sum(c.measured for _, c in rows) >= 4


def test_suggestions_marked_advice_change_hardware_or_experiment():
    assert is_advice({"cluster.gpu": "h200-141g"}) and is_advice({"train.seq_len": 16384})
    assert not is_advice({"train.micro_batch_size": 1, "train.gradient_accumulation_steps": 4})


# ------------------------------------------------------------------------------------------ the real host
def test_plan_reads_this_host_and_says_what_is_assumed(oom_spec):
    rs = load_run_spec(oom_spec)
    ram = ctl_plan.host_ram_gib()
    assert ram is not None and ram > 0.5   # this machine's /proc/meminfo
    here = Cluster(gpus_per_node=1, gpu_mem_gib=79.2, host_mem_gib=ram, gpu_name="H100").with_origin(
        "measured on this host: GPU memory 79.20 GiB (torch.cuda total_memory of H100), host RAM 125 GiB (/proc/meminfo)")
    measured = ctl_plan._cluster_from_flags(rs, None, None, None, None, None, None, detect=lambda n, g: here)
    assert measured.host_mem_gib == ram and "measured on this host" in measured.origin and "ASSUMED" not in measured.origin
    given = ctl_plan._cluster_from_flags(rs, None, None, None, None, 100.0, None, detect=lambda n, g: here)
    assert given.host_mem_gib == 100.0 and "--host-mem" in given.origin
    none_here = ctl_plan._cluster_from_flags(rs, None, None, None, None, None, None, detect=lambda n, g: None)
    assert "ASSUMED: no GPU on this host" in none_here.origin
    other = ctl_plan._cluster_from_flags(rs, "h100-80g", None, None, None, None, None)
    assert other.host_mem_gib == 2048.0 and "host RAM ASSUMED 2048 GiB" in other.origin
    other_ram = ctl_plan._cluster_from_flags(rs, "h100-80g", None, None, None, 128.0, None)
    assert "ASSUMED" not in other_ram.origin and other_ram.host_mem_gib == 128.0
    assert "Figures: for another machine" in plan(rs.job, other, search=False).render()


def test_plan_json_carries_the_fixes_the_advice_and_the_lever_costs(oom_spec):
    import json

    app = ctl_plan.typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    ctl_plan.register_plan(app)
    res = CliRunner().invoke(app, ["plan", "--spec", str(oom_spec), "--gpu", "h100-80g", "--json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.output)
    assert data["fixes"] and "best-first" in data["fix_search"] and "ASSUMED" in data["cluster"]["origin"]
    assert all(not is_advice(f["overrides"]) for f in data["fixes"])
    assert any(s["advice"] for s in data["suggestions"])
    assert {r["lever"] for r in data["lever_costs"]} >= {"recompute every block", "tiled loss", "TiledMLP"}


def test_pruning_never_removes_a_fit_and_the_cap_is_said_not_called_no_fit(oom_spec):
    """Memory-monotone pruning on a GPU where most settings cannot fit (micro-batch 2, a 20 GiB card): the same
    fits as the unpruned exhaustive search; a plan budget that runs out says so instead of 'nothing fits'."""
    rs = load_run_spec(oom_spec)
    rs = rs.model_copy(update={"job": JobSpec.model_validate({**rs.job.model_dump(mode="json"), "train": {
        **rs.job.model_dump(mode="json")["train"], "micro_batch_size": 2}})})
    small = Cluster.preset("h100-80g", gpus_per_node=1, nodes=1, gpu_mem_gib=20)
    pruned, _ = _search(rs, small, exhaustive_max=10**9)
    full, _ = _search(rs, small, exhaustive_max=10**9, prune=False)
    assert pruned.pruned > 0 and pruned.plans < full.plans, (pruned.describe(), full.describe())
    assert [(round(f.step_cost, 9), f.overrides) for f in pruned.fixes] == \
           [(round(f.step_cost, 9), f.overrides) for f in full.fixes]
    capped, _ = _search(rs, small, exhaustive_max=0, max_plans=3, prune=False)
    assert not capped.complete and "SEARCH INCOMPLETE" in capped.describe()
    tiny = Cluster.preset("h100-80g", gpus_per_node=1, nodes=1, gpu_mem_gib=4)
    none, _ = _search(rs, tiny)
    assert none.complete and not none.fixes and none.proven_none and none.plans < 500, none.describe()
