"""`ulyssesctl plan`'s numeric flags (finite, in range, 0 refused), `--gpus`/`--nodes` replacing the launcher's
before the SP layout is checked, and the fix search's host-memory levers (`[restart]`, async saves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ulyssesd.daemon.operator import ctl_plan
from ulyssesd.daemon.operator.ctl_plan import register_plan
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.training.planner import Cluster, apply_overrides, apply_restart_overrides, plan, search_fixes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SPEC_1B = CONFIGS / "gpt-1b-1xh200.toml"


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # a group, so `plan` stays a subcommand as in ulyssesctl
        pass

    register_plan(app)
    return app


def run(app, *args):
    return CliRunner().invoke(app, ["plan", *args])


@pytest.fixture
def mb4(tmp_path) -> Path:
    """gpt-1b at 32K with micro-batch 4 and no recompute: issue 30's OOM, standby and async saves on."""
    p = tmp_path / "mb4.toml"
    p.write_text(SPEC_1B.read_text().replace("micro_batch_size = 1", "micro_batch_size = 4"))
    return p


@pytest.mark.parametrize("flag,value", [
    ("--gpu-mem", "nan"), ("--gpu-mem", "inf"), ("--gpu-mem", "0"), ("--gpu-mem", "1e6"),
    ("--host-mem", "nan"), ("--host-mem", "-inf"), ("--host-mem", "-1"), ("--host-mem", "1e9"),
    ("--nvme", "nan"), ("--nvme", "-1"), ("--nvme", "1e12"),
    ("--gpus", "0"), ("--gpus", "-2"), ("--gpus", "5000"), ("--nodes", "0"), ("--nodes", "1000000"),
])
def test_non_finite_zero_or_absurd_numbers_are_bad_input(app, flag, value):
    res = run(app, "--spec", str(SPEC_1B), "--gpu", "h100-80g", flag, value)
    assert res.exit_code == 2, res.output
    assert flag in res.output and "VERDICT" not in res.output


def test_numbers_in_range_are_planned(app):
    res = run(app, "--spec", str(SPEC_1B), "--gpu-mem", "80", "--host-mem", "512", "--nvme", "0", "--json")
    assert res.exit_code in (0, 1), res.output
    data = json.loads(res.output)
    assert data["gpu_capacity_gib"] == 80 and data["cluster"]["host_mem_gib"] == 512


def test_gpus_replaces_nproc_per_node_before_the_sp_check(app, tmp_path):
    sp2 = tmp_path / "sp2.toml"
    sp2.write_text(SPEC_1B.read_text().replace("sequence_parallel_size = 1", "sequence_parallel_size = 2")
                   .replace("standby = true", "standby = false"))
    res = run(app, "--spec", str(sp2))   # the file's own world (1 GPU) still fails the check
    assert res.exit_code == 2 and "not divisible by parallel.sequence_parallel_size=2" in res.output, res.output
    res = run(app, "--spec", str(sp2), "--gpu", "h100-80g", "--gpus", "2", "--json")
    assert res.exit_code in (0, 1), res.output
    data = json.loads(res.output)
    assert data["cluster"]["gpus_per_node"] == 2 and data["summary"]["sp"] == 2
    res = run(app, "--spec", str(sp2), "--gpu", "h100-80g", "--gpus", "3")
    assert res.exit_code == 2 and "launcher world size 3 (launcher.nnodes × --gpus)" in res.output, res.output


def test_a_small_host_gets_a_fix_with_a_host_lever(mb4):
    """32 GiB of host RAM: the standby's preloaded tag and the async-save pool do not fit beside the job, so every
    GPU fix needs a host switch too; the search finds it, and its own re-plan with the switch applied fits."""
    rs = load_run_spec(mb4)
    cluster = Cluster.preset("h100-80g", 1, 1, host_mem_gib=32)
    ds = ctl_plan.effective_ds_config(rs, 1)
    kw = dict(allocator_headroom=ctl_plan.allocator_headroom(rs), cuda_context_gib=1.0, restart=rs.restart,
              alloc_conf=rs.launcher.env.get("PYTORCH_CUDA_ALLOC_CONF"))
    found = search_fixes(rs.job, cluster, ds, **kw)
    assert found.fixes, found.describe()
    for fx in found.fixes:
        assert any(k.startswith(("restart.", "checkpoint.async_save")) for k in fx.overrides), fx.overrides
        mb = fx.overrides.get("train.micro_batch_size", 4)
        assert mb * fx.overrides.get("train.gradient_accumulation_steps", 1) == 4
        j, c, d = apply_overrides(rs.job, cluster, ds, fx.overrides)
        assert plan(j, c, d, search=False, restart=apply_restart_overrides(rs.restart, fx.overrides),
                    allocator_headroom=kw["allocator_headroom"]).fits, fx.describe()
    # the daemon's own search (its patches are the job's config) has no [restart] levers: nothing fits here
    assert not search_fixes(rs.job, cluster, ds, daemon_levers=False, **kw).fixes
    # a roomy host: no fix carries a host switch that buys nothing (a subset without it fits as cheaply)
    roomy = search_fixes(rs.job, Cluster.preset("h100-80g", 1, 1, host_mem_gib=2048), ds, **kw)
    assert roomy.fixes and not any("checkpoint.async_save" in fx.overrides for fx in roomy.fixes)
    first = roomy.fixes[0].overrides
    assert not any(k.startswith("restart.") for k in first), first


def test_plan_cli_small_host_lists_the_fix_not_no_fix(app, mb4):
    res = run(app, "--spec", str(mb4), "--gpu", "h100-80g", "--host-mem", "32")
    assert res.exit_code == 1, res.output
    assert "Fixes that keep the experiment and the hardware" in res.output
    assert "No fix that keeps" not in res.output
