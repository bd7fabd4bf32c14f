"""A contract-faithful fake of the training job (docs/CONTRACTS.md), for fast supervisor tests.

Same command line, telemetry, control.json, checkpoints (real manifests via ulyssesd.training.checkpoint),
exit codes, SIGTERM semantics, SIGUSR1 stack dumps and `[[faults]]` as the real job, but no torch: a step
is a sleep and the loss is a deterministic function of the step, so "resumed from the right checkpoint and
reached the same final loss" is checkable in a second. Ranks other than 0 only mirror the step loop.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from ulyssesd.training import checkpoint as ck

STEP_S = float(os.environ.get("FAKEJOB_STEP_S", "0.05"))
SAVE_S = float(os.environ.get("FAKEJOB_SAVE_S", "0"))   # each save takes this long (announced: saving -> saved)
EVAL_AT = {int(x) for x in os.environ.get("FAKEJOB_EVAL_AT", "").split(",") if x.strip()}
EVAL_S = float(os.environ.get("FAKEJOB_EVAL_S", "0"))   # an evaluation after these steps (evaluating -> evaluated)


def loss_at(step: int, lr_scale: float = 1.0) -> float:
    return 4.0 * math.exp(-step / 40.0) + 0.5 + 0.01 * math.sin(step)


class Job:
    def __init__(self, args):
        self.args = args
        self.cfg = json.loads(Path(args.config).read_text())
        self.run_dir = Path(args.run_dir)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.ckpt_dir = Path(self.cfg["checkpoint"].get("dir") or self.run_dir / "checkpoints")
        self.tel = open(self.run_dir / "telemetry.jsonl", "a") if self.rank == 0 else None
        self.stop = False
        self.control_version = 0
        self.suspect = False
        self.faults = [f for f in self.cfg.get("faults", [])
                       if args.attempt in (f.get("attempts") if f.get("attempts") is not None else [1])]

    def emit(self, **rec):
        if self.tel is None:
            return
        rec = {"v": 1, "time": time.time(), "attempt": self.args.attempt, **rec}
        for k, v in list(rec.items()):
            if isinstance(v, float) and not math.isfinite(v):
                rec[k] = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        self.tel.write(json.dumps(rec) + "\n")
        self.tel.flush()

    def read_control(self):
        try:
            c = json.loads((self.run_dir / "control.json").read_text())
        except (OSError, ValueError):
            return
        if int(c.get("version", 0)) > self.control_version:
            self.control_version = int(c["version"])
            self.suspect = bool(c.get("suspect", False))
            applied = {k: c[k] for k in ("lr_scale", "gradient_clipping") if k in c}
            if applied:
                self.emit(kind="event", event="control_applied", control_version=self.control_version, **applied)

    def fault(self, kind, step):
        for f in self.faults:
            at, n = f.get("at_step"), int(f.get("steps", 1))
            if f["kind"] == kind and at is not None and at <= step < at + n and f.get("rank", 0) == self.rank:
                return f
        return None

    def save(self, step, loss, samples):
        if self.rank != 0:
            return
        tag = ck.tag_for_step(step)
        self.emit(kind="event", event="checkpoint_saving", step=step, tag=tag)
        time.sleep(SAVE_S)
        d = self.ckpt_dir / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "state.json").write_text(json.dumps({"step": step, "samples": samples}))
        ck.write_manifest(d, step, loss, samples, self.args.config_version)
        ck.point_latest_to(self.ckpt_dir, tag)
        self.emit(kind="event", event="checkpoint_saved", step=step, tag=tag, seconds=0.01, bytes=64)

    def resume(self):
        load = self.cfg["checkpoint"].get("load", "latest")
        if load == "none" or not self.ckpt_dir.exists():
            return None
        if load == "latest":
            def bad(tag, reason):
                if self.rank == 0:
                    self.emit(kind="event", event="checkpoint_invalid", tag=tag, reason=reason)
            tag = ck.latest_valid_tag(self.ckpt_dir, True, on_invalid=bad)
            if tag is None:
                return None
        else:
            tag = load
            ok, reason = ck.validate_tag(self.ckpt_dir / tag)
            if not ok:
                print(f"checkpoint {tag} invalid: {reason}", file=sys.stderr)
                sys.exit(3)
        state = json.loads((self.ckpt_dir / tag / "state.json").read_text())
        self.emit(kind="event", event="checkpoint_loaded", step=state["step"], tag=tag, seconds=0.01)
        return tag, state["step"], state["samples"]

    def run(self) -> int:
        cfg = self.cfg
        if self.fault("exit_at_start", 0) or any(f["kind"] == "exit_at_start" for f in self.faults):
            print("RuntimeError: injected exit at start", file=sys.stderr, flush=True)
            return 1
        steps = int(cfg["train"]["steps"])
        interval = int(cfg["checkpoint"]["interval_steps"])
        mb = int(cfg["train"]["micro_batch_size"])
        skips = [tuple(r) for r in cfg["data"].get("skip_ranges", [])]
        resumed = self.resume()
        step, samples = (resumed[1], resumed[2]) if resumed else (0, 0)
        self.emit(kind="event", event="started", step=step, world_size=self.world, sp=1, dp=self.world,
                  config_version=self.args.config_version, resumed_from=resumed[0] if resumed else None,
                  start_step=step, samples_seen=samples)
        last_loss = None
        while step < steps:
            self.read_control()
            if self.stop:
                if not self.suspect and step > 0:
                    self.save(step, last_loss, samples)
                self.emit(kind="event", event="exiting", reason="sigterm", step=step)
                return 0
            step += 1
            # skip ranges: advance past skipped samples
            start = samples
            while any(a <= start < b for a, b in skips):
                start = next(b for a, b in skips if a <= start < b)
            end = start + mb
            samples = end
            t0 = time.time()
            if self.fault("hang", step):
                self.emit(kind="event", event="fault_injected", step=step, fault="hang")
                while True:
                    time.sleep(1.0)
            if self.fault("sigkill", step):
                self.emit(kind="event", event="fault_injected", step=step, fault="sigkill")
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault("raise", step):
                self.emit(kind="event", event="fault_injected", step=step, fault="raise")
                raise RuntimeError(f"injected fault at step {step}")
            if self.fault("cuda_oom", step):
                self.emit(kind="event", event="fault_injected", step=step, fault="cuda_oom")
                print(os.environ.get("FAKEJOB_OOM_MESSAGE") or  # a test may bring torch's whole message
                      "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 25.96 GiB. GPU 0 has a total "
                      "capacity of 79.18 GiB of which 23.04 GiB is free.", file=sys.stderr, flush=True)
                return 1
            slow = self.fault("slow_rank", step)
            time.sleep(STEP_S + (float(slow["magnitude"]) if slow else 0.0))
            loss = loss_at(step)
            if self.fault("loss_spike", step):
                loss *= float(self.fault("loss_spike", step)["magnitude"])
            if self.fault("nan_loss", step):
                loss = float("nan")
            mem = 1.0 + (float(self.fault("memory_spike", step)["magnitude"]) if self.fault("memory_spike", step) else 0.0)
            last_loss = loss
            dt = time.time() - t0
            self.emit(kind="step", step=step, loss=loss, grad_norm=0.5, lr=3e-4, skipped=False, step_time_s=dt,
                      step_time_max_s=dt, slowest_rank=0, tokens=256 * mb, tokens_per_s=256 * mb / dt,
                      mem_allocated_gib=mem, mem_max_allocated_gib=mem, mem_max_rank=0, mem_reserved_gib=mem,
                      samples=[start, end], config_version=self.args.config_version)
            if step % interval == 0 or step == steps:
                self.save(step, loss, samples)
            if step in EVAL_AT and self.rank == 0:
                self.emit(kind="event", event="evaluating", step=step)
                time.sleep(EVAL_S)
                self.emit(kind="event", event="evaluated", step=step, seconds=EVAL_S)
        self.emit(kind="event", event="exiting", reason="completed", step=step)
        return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--config-version", type=int, default=1)
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    job = Job(args)

    def on_term(signum, frame):
        job.stop = True

    signal.signal(signal.SIGTERM, on_term)
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
