"""What the planner's standby GPU item rests on (training/planner/standby_gpu.py): a waiting standby rank creates
a CUDA context on its training rank's GPU (LOCAL_RANK) and warms cuBLAS/SDPA there, and nothing on a CPU run.
If `warm_up` ever stays off the GPU until the gate, these fail and the item must go. Plus the CPU dry run of
bench/gpu_standby_mem.py: it starts the standby as the daemon does and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ulyssesd.training import startup

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda made to say a GPU is there; every call that would touch it is recorded instead."""
    calls: list[tuple[str, object]] = []
    real_empty = torch.empty

    def empty(*args, device=None, **kw):
        if device is not None and "cuda" in str(device):
            calls.append(("empty", str(device)))
            device = None
        return real_empty(*args, device=device, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(startup, "warm_device", lambda i: calls.append(("warm_device", i)))
    monkeypatch.setattr(startup, "LAZY_MODULES", ())   # their imports are not what is tested here
    monkeypatch.delenv("WORLD_SIZE", raising=False)    # no launcher: no process group
    monkeypatch.setenv("LOCAL_RANK", "3")
    # DeepSpeed picks its accelerator at import from torch.cuda.is_available: keep it on the CPU for this session
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return calls


def test_on_a_gpu_node_the_waiting_standby_takes_a_context_on_its_ranks_gpu(fake_gpu):
    assert startup.warm_up("auto") == "cuda:3"
    assert fake_gpu == [("set_device", 3), ("empty", "cuda:3"), ("warm_device", 3)]
    fake_gpu.clear()
    assert startup.warm_up("cuda") == "cuda:3" and fake_gpu[0] == ("set_device", 3)


def test_on_a_cpu_run_the_standby_never_touches_the_gpu(fake_gpu):
    assert startup.warm_up("cpu") == "cpu"
    assert fake_gpu == []


@pytest.mark.slow   # a real torchrun + DeepSpeed standby process: 14 s on the 2-core box
def test_the_bench_dry_run_starts_the_standby_as_the_daemon_does_and_leaves_nothing(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_standby_mem.py"), "--out", str(tmp_path),
                          "--device", "cpu", "--budget", "120"], capture_output=True, text=True, env=env,
                         timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == json.loads((tmp_path / "standby_mem.json").read_text())
    sb = got["standby"]
    assert sb["device"] == "cpu" and sb["ready_s"] > 0 and sb["max_rss_mib"] > 0, sb
    assert "--standby-gate" in sb["argv"] and "torch.distributed.run" in sb["argv"], sb["argv"]
    assert sb["smi_used_delta_mib"] is None and sb["mem_get_info_mib"] is None   # no GPU here: no figure
    assert "standby warm in" in (tmp_path / "standby.log").read_text()
    # every process of the standby is gone (torchrun starts the rank in a session of its own)
    gate = next(a for a in sb["argv"] if a.endswith("gate-2.json"))
    deadline = time.monotonic() + 10
    while _cmdlines_with(gate) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _cmdlines_with(gate)


def _cmdlines_with(needle: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids
