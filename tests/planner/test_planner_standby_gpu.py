"""The warm standby's GPU memory in the plan (`[restart] standby`): each waiting standby rank holds its own
CUDA context and cuBLAS workspaces on its training rank's GPU for the whole run (training/startup.py
`warm_up`), so the plan has a per-GPU item for it, phases "all", counted in the required memory but never in
the job's allocated peak; the GPU verdict names it and `[restart] standby = false` is a suggestion that fits."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from ulyssesd.daemon.operator.ctl_plan import memory_replanner, plan_view, preflight, register_plan
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.training.planner import (
    Cluster,
    GiB,
    Restart,
    apply_overrides,
    apply_restart_overrides,
    plan,
    predict_peak_gib,
    user_ds_config,
)
from ulyssesd.training.planner.rendering import PHASES as PHASES_ALL
from ulyssesd.training.planner.standby_gpu import STANDBY_GPU, STANDBY_GPU_MIB
from ulyssesd.training.spec import JobSpec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _job() -> JobSpec:
    return JobSpec.model_validate({
        "model": {"preset": "gpt-1b"}, "precision": {"dtype": "bf16"},
        "train": {"seq_len": 4096, "activation_checkpoint_every": 1}})


def _plan(restart: Restart, gpu_mem_gib: float | None = None, gpus: int = 1, search: bool = False):
    cluster = Cluster.preset("h200-141g", gpus_per_node=gpus, host_mem_gib=4096.0)
    if gpu_mem_gib is not None:
        cluster = Cluster(gpus_per_node=gpus, gpu_mem_gib=gpu_mem_gib, host_mem_gib=4096.0)
    return plan(_job(), cluster, search=search, restart=restart)


def _gpu_items(p):
    return {i.name: i for i in p.items if i.where == "gpu"}


def test_the_standby_gpu_item_appears_only_when_the_standby_is_on():
    off = _plan(Restart())
    assert STANDBY_GPU not in _gpu_items(off)
    for restart in (Restart(standby=True), Restart(standby=True, standby_preload=False)):
        it = _gpu_items(_plan(restart))[STANDBY_GPU]
        assert it.bytes == STANDBY_GPU_MIB << 20
        assert it.phases == PHASES_ALL and it.outside_allocator
    # the preload is host memory: it changes nothing on the GPU
    assert _plan(Restart(standby=True)).gpu_required == _plan(Restart(standby=True, standby_preload=False)).gpu_required


def test_it_adds_to_required_exactly_and_never_to_the_jobs_allocated_peak():
    for gpus in (1, 8):
        off, on = _plan(Restart(), gpus=gpus), _plan(Restart(standby=True), gpus=gpus)
        # per GPU: one standby rank per training rank, whatever the world size; no allocator headroom on it
        assert on.gpu_required - off.gpu_required == STANDBY_GPU_MIB << 20
        assert on.phase_bytes == off.phase_bytes and on.gpu_peak_allocated == off.gpu_peak_allocated
    on = _plan(Restart(standby=True))
    assert predict_peak_gib(_job(), on.cluster) == on.gpu_peak_allocated / GiB


def test_the_table_shows_it_after_the_allocated_sums_with_phases_all():
    on, off = _plan(Restart(standby=True)).render(), _plan(Restart()).render()
    lines = on.splitlines()
    (row,) = [ln for ln in lines if ln.strip().startswith(STANDBY_GPU)]
    assert f"{STANDBY_GPU_MIB / 1024:9.2f}" in row and " all " in row, row
    # listed below the job's own sums (it is not part of them), above the required line that includes it
    last_sum = max(i for i, ln in enumerate(lines) if "= allocated, " in ln)
    required = next(i for i, ln in enumerate(lines) if "required (+headroom" in ln)
    assert last_sum < lines.index(row) < required
    assert "required (+headroom, CUDA context, standby)" in lines[required]
    assert "standby: each GPU also holds" in on and "standby:" not in off
    assert STANDBY_GPU not in off and ", standby)" not in off
    # one rank: NCCL's communicator is lazy (nothing before the gate); more: connected at init, said so
    assert "NCCL communicator" not in on
    eight = _plan(Restart(standby=True), gpus=8)
    assert any("with 8 ranks its NCCL communicator is connected before the gate" in n for n in eight.notes)
    assert not any("NCCL" in n for n in _plan(Restart(), gpus=8).notes)


def test_a_gpu_it_does_not_fit_on_names_the_standby_and_the_switch_that_fits():
    off = _plan(Restart())
    tight = off.gpu_required / GiB + 0.5   # fits without the standby, 0.5 GiB short with it
    assert _plan(Restart(), gpu_mem_gib=tight).fits
    on = _plan(Restart(standby=True), gpu_mem_gib=tight, search=True)
    assert not on.fits
    (msg,) = on.problems
    assert msg.startswith("GPU: needs") and STANDBY_GPU in msg and "[restart] standby = false" in msg, msg
    assert "short by 0.5 GiB" in msg, msg
    overrides = [sg.overrides for sg in on.suggestions]
    assert {"restart.standby": False} in overrides, overrides
    # the preload lives in host RAM: turning it off alone never makes the GPU fit
    assert {"restart.standby_preload": False} not in overrides, overrides
    for sg in on.suggestions:   # each suggestion, re-planned on its own, fits
        job, cluster, ds = apply_overrides(_job(), on.cluster, user_ds_config(_job()), sg.overrides)
        assert plan(job, cluster, ds, search=False,
                    restart=apply_restart_overrides(Restart(standby=True), sg.overrides)).fits, sg


def test_the_memory_remediation_view_keeps_states_and_activations_the_jobs_own():
    off, on = plan_view(_plan(Restart())), plan_view(_plan(Restart(standby=True)))
    assert on.model_states_gib == off.model_states_gib and on.activations_gib == off.activations_gib
    assert on.peak_allocated_gib == off.peak_allocated_gib
    assert on.required_gib - off.required_gib == STANDBY_GPU_MIB / 1024


def test_ulyssesctl_plan_json_has_the_item_for_the_shipped_standby_config(tmp_path):
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    register_plan(app)
    shipped = CONFIGS / "gpt-1b-1xh200.toml"
    assert "standby = true" in shipped.read_text()
    off = tmp_path / "no-standby.toml"
    off.write_text(shipped.read_text().replace("standby = true", "standby = false"))

    def gpu_items(spec: Path) -> dict[str, dict]:
        res = CliRunner().invoke(app, ["plan", "--spec", str(spec), "--gpu", "h200-141g", "--json"])
        assert res.exit_code in (0, 1), res.output
        return {i["name"]: i for i in json.loads(res.output)["items"] if i["where"] == "gpu"}

    item = gpu_items(shipped)[STANDBY_GPU]
    assert item["outside_allocator"] is True and item["phases"] == list(PHASES_ALL)
    assert STANDBY_GPU not in gpu_items(off)


def test_the_memory_ladders_replan_counts_the_standby_as_preflight_does(tmp_path):
    shipped = CONFIGS / "gpt-1b-1xh200.toml"
    off = tmp_path / "no-standby.toml"
    off.write_text(shipped.read_text().replace("standby = true", "standby = false"))
    cluster = Cluster.preset("h200-141g", gpus_per_node=1)
    views = {}
    for name, path in (("on", shipped), ("off", off)):
        rs = load_run_spec(path)
        replan = memory_replanner(rs, rs.job.model_dump(mode="json"), {}, cluster)
        assert replan is not None
        views[name] = replan({})
        ok, pre = preflight(rs, cluster)
        assert views[name].required_gib == pre.gpu_required / GiB   # the ladder and the launch agree
    assert views["on"].required_gib - views["off"].required_gib == STANDBY_GPU_MIB / 1024
    assert views["on"].activations_gib == views["off"].activations_gib
