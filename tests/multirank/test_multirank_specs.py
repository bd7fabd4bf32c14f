"""The 8-GPU example specs: valid, planned to fit 8×H200, and the SP rules rejected before any launch.

Fast tests (spec loading + planner arithmetic), plus one slow check that 8 real ranks started with a bad
spec all refuse it (exit 2) before DeepSpeed is even imported.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from ulyssesd.daemon.spec import load_run_spec, run_spec_from_dict
from ulyssesd.training.planner import Cluster, plan
from ulyssesd.training.spec import SpecError, job_spec_from_dict

REPO = Path(__file__).resolve().parents[2]
SPECS = {"gpt-7b-8xh200": REPO / "configs" / "gpt-7b-8xh200.toml",
         "gpt-1b-8xh200-sp8": REPO / "configs" / "gpt-1b-8xh200-sp8.toml"}
H200X8 = Cluster.preset("h200-141g", gpus_per_node=8, host_mem_gib=1024.0)


def _raw(name: str) -> dict:
    with SPECS[name].open("rb") as fh:
        return tomllib.load(fh)


def _with(raw: dict, **dotted) -> dict:
    data = copy.deepcopy(raw)
    for key, value in dotted.items():
        section, field = key.split("__")
        data.setdefault(section, {})[field] = value
    return data


@pytest.mark.parametrize("name", sorted(SPECS))
def test_example_spec_is_the_8_way_ulysses_topology(name):
    spec = load_run_spec(SPECS[name])
    assert spec.launcher.world_size == 8
    assert spec.job.parallel.sequence_parallel_size == 8
    assert spec.job.deepspeed.config["zero_optimization"]["stage"] == 3
    assert spec.job.precision.dtype == "bf16"
    assert spec.job.train.seq_len == 32768


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("sp", [8, 4])
def test_planner_fits_8xh200_at_32k_for_sp8_and_dp2_sp4(name, sp):
    job = job_spec_from_dict(_with(_raw(name), parallel__sequence_parallel_size=sp))
    p = plan(job, H200X8, search=False)
    assert p.fits, p.render()
    assert p.gpu_margin_gib > 50  # 32K is far from the limit: the long-sequence cases are where it binds


def test_planner_negative_control_a_65b_model_does_not_fit_without_offload():
    raw = _with(_raw("gpt-7b-8xh200"), model__preset=None, model__hidden_size=8192, model__num_layers=80,
                model__num_attention_heads=64, model__vocab_size=50304, model__max_seq_len=32768)
    assert not plan(job_spec_from_dict(raw), H200X8, search=False).fits


@pytest.mark.parametrize("change, message", [
    (dict(model__num_attention_heads=4),
     "model.num_attention_heads=4 is not divisible by parallel.sequence_parallel_size=8"),
    (dict(train__seq_len=32772),
     "train.seq_len=32772 is not divisible by parallel.sequence_parallel_size=8"),
    (dict(parallel__sequence_parallel_size=16),  # 32 heads / 16 fine, but 8 ranks cannot hold SP=16
     "launcher world size 8 (launcher.nnodes × launcher.nproc_per_node) is not divisible by "
     "parallel.sequence_parallel_size=16"),
])
def test_sp_rules_rejected_by_the_daemon_before_launch(change, message):
    with pytest.raises(SpecError) as err:
        run_spec_from_dict(_with(_raw("gpt-7b-8xh200"), **change), "x8.toml")
    assert any(message in p for p in err.value.problems), err.value.problems


def _write_toml(path: Path, raw: dict) -> Path:
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_bench import to_toml  # the benchmark's own tiny TOML writer

    launcher = raw.pop("launcher", None)  # its inline env table is not needed by the job
    path.write_text(to_toml(raw))
    if launcher is not None:
        raw["launcher"] = launcher
    return path


@pytest.mark.slow
def test_8_real_ranks_refuse_heads_not_divisible_by_sp_with_exit_2(tmp_path):
    """torchrun starts 8 ranks; they refuse the spec (exit 2, naming the problem) before importing DeepSpeed."""
    raw = _with(_raw("gpt-7b-8xh200"), model__num_attention_heads=4, train__device="cpu")
    spec = _write_toml(tmp_path / "bad.toml", raw)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8",
           "-m", "ulyssesd.training", "--spec", str(spec), "--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    wall = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "model.num_attention_heads=4 is not divisible by parallel.sequence_parallel_size=8" in out, out[-3000:]
    # torchrun SIGTERMs the other ranks as soon as the first exits, so not every rank gets to print; but
    # each rank either refused the spec (2) or was stopped by torchrun (-15): none crashed or trained.
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert "2" in codes and set(codes) <= {"2", "-15"}, codes
    assert not (tmp_path / "run" / "telemetry.jsonl").exists()  # nothing started
    assert wall < 120
