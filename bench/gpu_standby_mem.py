"""What a waiting warm standby (`[restart] standby = true`) holds on its GPU, beside the attempt that trains.

The standby's ranks run `training/startup.py` `warm_up` before their gate: the CUDA context on LOCAL_RANK's
device, `warm_device` (cuBLAS/cuBLASLt handles and their workspaces, the matmul and SDPA kernels' modules;
the allocator's cache emptied after) and the process group (NCCL, communicators lazy). This script measures
what that costs on the GPU, in three processes started one after the other on an otherwise idle GPU:

  context      `torch.cuda.set_device(i); torch.empty(1, device=...)`: the CUDA context alone (the control)
  warm_device  the same + `warm_device(i)`: what the standby adds without its imports and process group
  standby      the standby itself, started as the daemon starts it (daemon/job/standby.py `_start`: the
               torchrun launch of `build_launch(..., standby_gate=...)` under the job wrapper, with the four
               ULYSSESD_STANDBY_* variables, preload off) and measured once its rank wrote its ready file

`--nproc N` (N GPUs): the standby has N ranks, one per GPU 0..N-1, each GPU probed; with N > 1 DeepSpeed
0.19.8 makes NCCL's communicator at `init_process_group` (it passes `device_id` when the world size is not 1),
i.e. before the gate, so its buffers are in the figure too (on one GPU they are not: there is none).

Each figure is measured three ways, all as deltas against the idle GPU before the process started:
`nvidia-smi --query-gpu=memory.used` (the whole GPU), the process's own `used_memory` in
`nvidia-smi --query-compute-apps` (absent in some containers: then null) and `torch.cuda.mem_get_info` of
this script's own probe context, which it creates first and keeps (its own size cancels in the delta).

    python bench/gpu_standby_mem.py --out $OUT [--gpu 0] [--nproc 1] [--ready-timeout 70] [--budget 80]
    # on the device machine, from a tree with the wheels in .whl/ (bench/gpu_common.sh installs them):
    CALL_BUDGET_S=90 bash -c 'source bench/gpu_common.sh && timeout 88 $PY bench/gpu_standby_mem.py --out "$OUT" --budget 80'

Prints one JSON line (also written to {out}/standby_mem.json); the standby's log goes to {out}/standby.log.
On a machine without a GPU it still runs the standby (a CPU dry run: the GPU figures are null).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
#: Seconds each figure is sampled over once its process is ready (the maximum of the samples is kept).
SAMPLE_S = 2.0
SAMPLE_EVERY_S = 0.25

CONTEXT_CHILD = """
import json, sys, time, torch
i = int(sys.argv[1])
torch.cuda.set_device(i)
torch.empty(1, device=f"cuda:{i}")
if sys.argv[2] == "warm_device":
    from ulyssesd.training.startup import warm_device
    warm_device(i)
print(json.dumps({"ready": True, "allocated": torch.cuda.memory_allocated(i),
                  "reserved": torch.cuda.memory_reserved(i)}), flush=True)
time.sleep(600)
"""


def smi(args: list[str]) -> list[list[str]] | None:
    """Rows of an `nvidia-smi --format=csv,noheader,nounits` query; None without nvidia-smi or on failure."""
    try:
        out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def gpu_used_mib(gpu: int) -> int | None:
    rows = smi(["-i", str(gpu), "--query-gpu=memory.used"])
    try:
        return int(rows[0][0]) if rows else None
    except (ValueError, IndexError):
        return None


def apps_mib(gpu: int) -> dict[int, int] | None:
    """pid -> used_memory (MiB) of the compute processes on `gpu`; None when nvidia-smi cannot list them."""
    rows = smi(["-i", str(gpu), "--query-compute-apps=pid,used_memory"])
    if rows is None:
        return None
    out = {}
    for row in rows:
        try:
            out[int(row[0])] = int(row[1])
        except (ValueError, IndexError):
            continue
    return out


class Probe:
    """This script's own view of the GPU: free bytes (mem_get_info) and nvidia-smi, before and while."""

    def __init__(self, gpu: int) -> None:
        self.gpu = gpu
        self.torch: Any = None
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.set_device(gpu)
                torch.empty(1, device=f"cuda:{gpu}")  # the probe's context, kept for the whole script
                self.torch = torch
        except Exception as exc:  # noqa: BLE001 - a CPU dry run measures nothing but still runs the standby
            print(f"no CUDA probe: {exc}", file=sys.stderr)

    def free(self) -> int | None:
        return int(self.torch.cuda.mem_get_info(self.gpu)[0]) if self.torch is not None else None

    def snapshot(self) -> dict[str, Any]:
        return {"free": self.free(), "smi_used_mib": gpu_used_mib(self.gpu), "apps": apps_mib(self.gpu)}

    def measure(self, before: dict[str, Any], pids: set[int]) -> dict[str, Any]:
        """Max over SAMPLE_S of each delta against `before`; `pids`: the measured process tree."""
        best: dict[str, Any] = {"mem_get_info_mib": None, "smi_used_delta_mib": None, "process_mib": None}
        end = time.monotonic() + SAMPLE_S
        while True:
            now = self.snapshot()
            if before["free"] is not None and now["free"] is not None:
                best["mem_get_info_mib"] = _max(best["mem_get_info_mib"], (before["free"] - now["free"]) / MiB)
            if before["smi_used_mib"] is not None and now["smi_used_mib"] is not None:
                best["smi_used_delta_mib"] = _max(best["smi_used_delta_mib"],
                                                  now["smi_used_mib"] - before["smi_used_mib"])
            if now["apps"]:
                mine = sum(v for p, v in now["apps"].items() if p in pids)
                if mine:
                    best["process_mib"] = _max(best["process_mib"], mine)
            if time.monotonic() >= end:
                return {k: (round(v, 1) if v is not None else None) for k, v in best.items()}
            time.sleep(SAMPLE_EVERY_S)


def _max(a: float | None, b: float) -> float:
    return b if a is None else max(a, b)


def tree_pids(root: int) -> set[int]:
    """`root` and its descendants (from /proc: the launcher's agent, the wrapper and the ranks)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += children.get(p, [])
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group and every descendant (torchrun starts each rank in a session of its own)."""
    pids = tree_pids(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def settle(probe: Probe, baseline: dict[str, Any], timeout_s: float = 10.0) -> bool:
    """Wait until the GPU is back to the baseline (a killed process's context is freed asynchronously)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        now = probe.snapshot()
        if baseline["free"] is None or now["free"] is None or baseline["free"] - now["free"] < 16 * MiB:
            return True
        time.sleep(0.2)
    return False


def control(probe: Probe, gpu: int, mode: str) -> dict[str, Any]:
    """A bare CUDA context (mode "context") or context + warm_device (mode "warm_device")."""
    before = probe.snapshot()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", CONTEXT_CHILD, str(gpu), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            return {"error": (proc.stderr.read() if proc.stderr else "")[-2000:], "rc": proc.poll()}
        inside = json.loads(line)
        got = probe.measure(before, tree_pids(proc.pid))
        return {**got, "ready_s": round(time.monotonic() - t0, 2),
                "torch_allocated_mib": round(inside["allocated"] / MiB, 1),
                "torch_reserved_mib": round(inside["reserved"] / MiB, 1)}
    finally:
        kill_tree(proc.pid)
        proc.wait()
        settle(probe, before)


def standby(probes: list[Probe], out: Path, device: str, timeout_s: float) -> dict[str, Any]:
    """The standby as the daemon starts it (daemon/job/standby.py `_start`), one rank per probed GPU, measured
    once every rank wrote its ready file. More than one rank: DeepSpeed 0.19.8 passes `device_id` to
    init_process_group (comm/torch.py, world size != 1 on CUDA), so NCCL's communicator is made before the gate."""
    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.job import standby as sb
    from ulyssesd.daemon.job.launcher import build_launch
    from ulyssesd.daemon.spec import JobSection, LauncherSection

    run_dir = Path(tempfile.mkdtemp(prefix="ulysses-standby-mem-"))
    attempt, nproc, gpu = 2, len(probes), probes[0].gpu
    gate = run_dir / sb.STANDBY_DIR / f"gate-{attempt}.json"
    # GPU 0 as the daemon launches it (no CUDA_VISIBLE_DEVICES); another single GPU made the rank's device 0.
    launcher = LauncherSection(kind="torchrun", nproc_per_node=nproc,
                               env={"CUDA_VISIBLE_DEVICES": str(gpu)} if nproc == 1 and gpu and device != "cpu"
                               else {})
    plan = build_launch(launcher, run_id="bench-standby-mem", run_dir=run_dir, attempt=attempt, config_version=1,
                        job=JobSection(), standby_gate=gate)
    plan.env.update({sb.TIMEOUT_ENV: str(int(timeout_s) + 60), sb.PRELOAD_ENV: "0",
                     sb.CKPT_DIR_ENV: str(run_dir / "checkpoints"), sb.DEVICE_ENV: device})
    ready = [run_dir / sb.STANDBY_DIR / f"attempt-{attempt}-rank-{r}.ready" for r in range(nproc)]
    before = [p.snapshot() for p in probes]
    t0 = time.monotonic()
    job = RealOS().spawn(plan.argv, plan.env, plan.cwd, plan.log_path)
    try:
        while not all(r.exists() for r in ready):
            if time.monotonic() - t0 > timeout_s:
                return {"error": f"not every rank ready within {timeout_s:.0f}s", "log_tail": _tail(plan.log_path)}
            if _exited(job.pid):
                return {"error": "the standby exited before it was ready", "log_tail": _tail(plan.log_path)}
            time.sleep(0.1)
        ready_s = time.monotonic() - t0
        pids = tree_pids(job.pid)
        per_gpu = [p.measure(b, pids) for p, b in zip(probes, before, strict=True)]
        infos = [json.loads(r.read_text()) for r in ready]
        # the worst GPU's figures (one GPU: its own); every GPU's with more than one rank
        worst = {k: max((g[k] for g in per_gpu if g[k] is not None), default=None) for k in per_gpu[0]}
        return {**worst, **({"per_gpu": per_gpu} if nproc > 1 else {}), "ranks": nproc,
                "ready_s": round(ready_s, 2), "warm_s": max(i.get("warm_s") or 0 for i in infos),
                "device": infos[0].get("device"),
                "max_rss_mib": round(max(i.get("max_rss_kib", 0) for i in infos) / 1024, 1), "argv": plan.argv}
    finally:
        kill_tree(job.pid)
        _exited(job.pid, wait=True)
        for p, b in zip(probes, before, strict=True):
            settle(p, b)
        try:
            (out / "standby.log").write_bytes(plan.log_path.read_bytes()[-200_000:])
        except OSError:
            pass
        shutil.rmtree(run_dir, ignore_errors=True)


def _exited(pid: int, wait: bool = False) -> bool:
    try:
        got, _ = os.waitpid(pid, 0 if wait else os.WNOHANG)
    except ChildProcessError:
        return True
    return got == pid


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-3000:]
    except OSError:
        return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="the run's train.device the standby is told (cpu: dry run)")
    ap.add_argument("--ready-timeout", type=float, default=70.0, help="seconds the standby gets to get warm")
    ap.add_argument("--cases", default="context,standby,warm_device")
    ap.add_argument("--nproc", type=int, default=1,
                    help="standby ranks, one per GPU 0..N-1 (N > 1: NCCL's communicator is made before the gate)")
    ap.add_argument("--budget", type=float, default=80.0,
                    help="seconds for the whole script: a case is given what is left (the JSON is kept per case)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def left() -> float:
        return a.budget - (time.monotonic() - t0)

    probes = [Probe(g) for g in ([a.gpu] if a.nproc == 1 else range(a.nproc))]
    probe = probes[0]
    result: dict[str, Any] = {"gpu": (smi(["-i", str(a.gpu), "--query-gpu=name,memory.total,driver_version"])
                                      or [[None]])[0]}
    if probe.torch is not None:
        result["torch"] = probe.torch.__version__
        result["cuda"] = probe.torch.version.cuda
    baseline = probe.snapshot()
    result["idle_smi_used_mib"] = baseline["smi_used_mib"]
    result["idle_apps"] = baseline["apps"]

    def save() -> str:
        result["seconds"] = round(time.monotonic() - t0, 1)
        line = json.dumps(result, default=str)
        (a.out / "standby_mem.json").write_text(line + "\n")
        return line

    # The control first (seconds), then the standby (the figure the planner takes), then the split.
    for case in a.cases.split(","):
        if left() < 8:
            result.setdefault("skipped", []).append(case)
        elif case == "standby":
            result["standby"] = standby(probes, a.out, a.device, min(a.ready_timeout, left() - 6))
        elif case in ("context", "warm_device") and probe.torch is not None:
            result[case] = control(probe, probe.gpu, case)
        save()
    line = save()
    print(line)
    return 0 if "error" not in result.get("standby", {}) else 1

if __name__ == "__main__":
    sys.exit(main())
