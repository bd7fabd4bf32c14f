"""`ulyssesctl plan` through typer's CliRunner, and the daemon's preflight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ulyssesd.daemon.operator import ctl_plan
from ulyssesd.daemon.operator.ctl_plan import SkippedPlan, preflight, register_plan
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.training.planner import Cluster

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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


def test_seed_176b_does_not_fit_exit_1(app):
    res = run(app, "--spec", str(CONFIGS / "gpt-176b-8xa100.toml"))
    assert res.exit_code == 1, res.output
    assert "DOES NOT FIT" in res.output and "host:" in res.output and "nodes" in res.output


def test_7b_on_h200_fits_exit_0_and_json(app):
    res = run(app, "--spec", str(CONFIGS / "gpt-7b-2xh200.toml"), "--gpu", "h200-141g", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["fits"] is True and data["cluster"]["gpus_per_node"] == 2 and data["gpu_capacity_gib"] == 139.8


def test_flags_override_the_cluster(app, tmp_path):
    # The same 7B (checkpointing every layer) on 2 GPUs with 40 GiB each does not fit; more nodes make it fit.
    text = (CONFIGS / "gpt-7b-2xh200.toml").read_text()
    assert "activation_checkpoint_layers = 5" in text
    spec = str(tmp_path / "every-layer.toml")
    Path(spec).write_text(text.replace("activation_checkpoint_layers = 5", "activation_checkpoint_every = 1"))
    assert run(app, "--spec", spec, "--gpu-mem", "40").exit_code == 1
    res = run(app, "--spec", spec, "--gpu-mem", "40", "--nodes", "4", "--gpus", "2", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["cluster"]["nodes"] == 4


@pytest.mark.parametrize("args,needle", [
    (["--spec", "/nonexistent/run.toml"], "file not found"),
    (["--spec", str(CONFIGS / "gpt-7b-2xh200.toml"), "--gpu", "v100"], "unknown GPU preset"),
    (["--spec", str(CONFIGS / "gpt-7b-2xh200.toml"), "--gpus", "3"], "not divisible"),
])
def test_bad_input_exit_2(app, args, needle):
    res = run(app, *args)
    assert res.exit_code == 2, res.output
    assert needle in res.output


def test_preflight_cpu_run_is_ok_with_note():
    ok, p = preflight(load_run_spec(CONFIGS / "tiny-cpu.toml"))
    assert ok and isinstance(p, SkippedPlan) and p.notes == ["CPU run: no GPU memory plan"]


def test_preflight_refuses_the_seed_176b_and_accepts_enough_nodes():
    spec = load_run_spec(CONFIGS / "gpt-176b-8xa100.toml")
    ok, p = preflight(spec, Cluster.preset("a100-80g", gpus_per_node=8))
    assert not ok and p.problems and p.suggestions
    ok4, p4 = preflight(spec, Cluster.preset("a100-80g", gpus_per_node=8, nodes=4))
    assert ok4 and p4.fits


def test_preflight_without_gpu_skips(monkeypatch):
    monkeypatch.setattr(ctl_plan.shutil, "which", lambda name: None)
    ok, p = preflight(load_run_spec(CONFIGS / "gpt-7b-2xh200.toml"))
    assert ok and "no GPU detected" in p.notes[0]


def test_preflight_detects_local_gpus(monkeypatch):
    class Done:
        stdout = "NVIDIA H200, 143771\nNVIDIA H200, 143771\n"

    monkeypatch.setattr(ctl_plan.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(ctl_plan.subprocess, "run", lambda *a, **k: Done())
    ok, p = preflight(load_run_spec(CONFIGS / "gpt-7b-2xh200.toml"))
    assert ok and p.cluster.gpu_name == "NVIDIA H200" and p.cluster.gpu_mem_gib == pytest.approx(139.6, abs=0.1)


def test_expandable_segments_lowers_the_headroom(tmp_path):
    text = (CONFIGS / "gpt-176b-8xa100.toml").read_text().replace(
        'nproc_per_node = 8', 'nproc_per_node = 8\nenv = { PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True" }')
    (tmp_path / "run.toml").write_text(text)
    (tmp_path / "ds_config_ulysses.json").write_text((CONFIGS / "ds_config_ulysses.json").read_text())
    cluster = Cluster.preset("a100-80g", gpus_per_node=8, nodes=4)
    _, plain = preflight(load_run_spec(CONFIGS / "gpt-176b-8xa100.toml"), cluster)
    _, expandable = preflight(load_run_spec(tmp_path / "run.toml"), cluster)
    assert expandable.gpu_peak_allocated == plain.gpu_peak_allocated
    assert expandable.gpu_required < plain.gpu_required
