"""The warm standby's host RAM in the plan (`[restart] standby`): each standby rank's RSS and, with the
preload, its optimizer-states file of the newest tag; the host verdict names the items and what to turn off;
the suggestions turn the standby's parts off before buying RAM; `ulyssesctl plan` reads the spec's [restart]."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ulyssesd.daemon.operator.ctl_plan import preflight, register_plan
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.training.planner import (
    Cluster,
    GiB,
    Restart,
    apply_overrides,
    apply_restart_overrides,
    plan,
    user_ds_config,
)
from ulyssesd.training.spec import JobSpec

RSS = "warm standby rank processes"
PRELOAD = "warm standby preloaded tag (memfd)"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# Measured on 1x H200 for gpt-1b (device call 13): the waiting standby's ru_maxrss and the bytes it preloaded
# (bench/results/gpu_call13_ckpt.log: optimizer-states file 16,969,265,577 B + model-states file 55,189 B).
MEASURED_RSS_BYTES = 1_232_564 * 1024
MEASURED_PRELOAD_BYTES = 16_969_320_766


def _job(preset: str = "gpt-1b", async_save: bool = False) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"preset": preset}, "precision": {"dtype": "bf16"},
        "train": {"seq_len": 4096, "activation_checkpoint_every": 1},
        "checkpoint": {"async_save": async_save}})


def _plan(restart: Restart, gpus: int = 1, preset: str = "gpt-1b", host: float = 4096.0, async_save: bool = False,
          search: bool = False):
    return plan(_job(preset, async_save), Cluster.preset("h200-141g", gpus_per_node=gpus, host_mem_gib=host),
                search=search, restart=restart)


def _items(p):
    return {i.name: i.bytes for i in p.items if i.where == "host"}


def test_standby_items_appear_only_when_the_standby_is_on():
    off, on, no_preload = _plan(Restart()), _plan(Restart(standby=True)), \
        _plan(Restart(standby=True, standby_preload=False))
    assert RSS not in _items(off) and PRELOAD not in _items(off)
    assert RSS in _items(on) and PRELOAD in _items(on)
    assert RSS in _items(no_preload) and PRELOAD not in _items(no_preload)
    assert on.host_required - off.host_required == _items(on)[RSS] + _items(on)[PRELOAD]
    assert no_preload.host_required - off.host_required == _items(no_preload)[RSS]
    # the GPU side (its CUDA context, not the preload): tests/planner/test_planner_standby_gpu.py
    assert on.gpu_required == no_preload.gpu_required > off.gpu_required


@pytest.mark.parametrize("preset", ["gpt-1b", "gpt-7b"])
@pytest.mark.parametrize("gpus", [1, 4])
def test_standby_sizes_follow_the_formula(preset, gpus):
    p = _plan(Restart(standby=True), gpus=gpus, preset=preset)
    shard = -(-p.summary["params"] // gpus)
    assert _items(p)[PRELOAD] == 12 * shard * gpus
    assert _items(p)[RSS] == int(1.2 * GiB) * gpus


def test_standby_sizes_match_the_h200_measurement():
    p = _plan(Restart(standby=True))
    # Preload: the optimizer-states file (12 B/param); the pickle and the 55 KB model-states file are left out.
    assert 0 <= MEASURED_PRELOAD_BYTES - _items(p)[PRELOAD] < 100_000
    # RSS: 1.2 GiB per rank, on the safe side of the measured 1.18 GiB.
    assert 0 < _items(p)[RSS] - MEASURED_RSS_BYTES < 0.05 * GiB


def test_host_check_fires_on_a_small_host_naming_the_items_and_the_switches():
    # gpt-1b, one GPU, async saves and the standby: 16.0 pool + 15.8 preload + 1.2 + 3 + 4 GiB OS = 40 GiB.
    restart = Restart(standby=True)
    small, big = _plan(restart, host=32.0, async_save=True), _plan(restart, host=64.0, async_save=True)
    assert big.fits and not big.problems
    assert not small.fits and small.gpu_required <= small.cluster.gpu_mem_gib * GiB
    (msg,) = small.problems
    assert msg.startswith("host: needs 40 GiB") and "short by 8 GiB" in msg, msg
    for name in (PRELOAD, "async-save snapshot pool (registered)"):
        assert name in msg, msg
    for switch in ("[restart] standby_preload = false", "[restart] standby = false", "[checkpoint] async_save = false"):
        assert switch in msg, msg
    # Turning the standby off frees its preload too (17.0 GiB), more than the preload alone (15.8).
    assert "frees its preload too) (-17.0 GiB)" in msg and "from disk) (-15.8 GiB)" in msg, msg
    # The message is right: either switch makes the same node fit.
    assert _plan(Restart(standby=True, standby_preload=False), host=32.0, async_save=True).fits
    assert _plan(Restart(standby=True), host=32.0, async_save=False).fits
    # Without the standby and async saves the small host was never a problem.
    assert _plan(Restart(), host=32.0).fits


def test_suggestions_turn_the_preload_off_first_and_never_add_nodes_to_a_standby():
    p = _plan(Restart(standby=True), host=32.0, async_save=True, search=True)
    assert not p.fits and p.suggestions
    first = p.suggestions[0]
    assert first.overrides == {"restart.standby_preload": False}, first
    assert not any("cluster.nodes" in sg.overrides and "restart.standby" not in sg.overrides for sg in p.suggestions)
    for sg in p.suggestions:   # each one re-planned on its own fits
        job, cluster, ds = apply_overrides(_job(async_save=True), p.cluster, user_ds_config(_job()), sg.overrides)
        r = apply_restart_overrides(Restart(standby=True), sg.overrides)
        assert plan(job, cluster, ds, search=False, restart=r).fits, sg


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    register_plan(app)
    return app


def test_ulyssesctl_plan_and_preflight_read_the_specs_restart_section(app, tmp_path):
    shipped = CONFIGS / "gpt-1b-1xh200.toml"
    assert "standby = true" in shipped.read_text()
    off = tmp_path / "no-standby.toml"
    off.write_text(shipped.read_text().replace("standby = true", "standby = false"))

    def host_items(spec: Path, host: str) -> tuple[int, dict[str, float]]:
        res = CliRunner().invoke(app, ["plan", "--spec", str(spec), "--gpu", "h200-141g", "--host-mem", host, "--json"])
        return res.exit_code, {i["name"]: i["gib"] for i in json.loads(res.output)["items"] if i["where"] == "host"}

    code, on_items = host_items(shipped, "2048")
    assert code == 0 and PRELOAD in on_items and RSS in on_items, on_items
    code, off_items = host_items(off, "2048")
    assert code == 0 and PRELOAD not in off_items
    # 40 GiB is enough without the standby and not with it (the shipped config also saves asynchronously).
    assert host_items(off, "40")[0] == 0 and host_items(shipped, "40")[0] == 1
    small = Cluster.preset("h200-141g", gpus_per_node=1, host_mem_gib=40.0)
    ok, result = preflight(load_run_spec(shipped), small)
    assert not ok and "[restart] standby_preload = false" in result.problems[0], result.problems
    assert preflight(load_run_spec(off), small)[0]
