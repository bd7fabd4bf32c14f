"""A simulated training job: the built-in job's side of the contract (docs/CONTRACTS.md), on the simulated clock.

It reads its launch (`--config configs/vN.json`, `$ULYSSESD_RUN_DIR`, `$ULYSSESD_ATTEMPT`), resumes from the
checkpoint the config names, writes telemetry (one step record per `record_every` steps: loss from a real
recorded curve, step times from its real trace), saves checkpoints as real files with manifests (the job's own
room check before each save, `budget.room_for_save`), obeys SIGTERM (save, then exit 0; no save when control.json
says `suspect` or once it has reported a non-finite loss, as the real job does), SIGUSR1 (stacks into its log) and SIGKILL, and acts out the faults the runner injects.
Everything it does is a function of the simulated clock and the run's seed: no wall clock, no threads.
"""

from __future__ import annotations

import json
import logging
import random
import signal
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.sim.disk import SimDisk

_log = logging.getLogger("ulyssesd.sim.job")
#: Name of the file the job puts in each tag: whether the weights it holds were poisoned (NaN) when saved.
POISON_FILE = "sim_weights.json"
INF = float("inf")


@dataclass(frozen=True)
class CurveRow:
    step: int
    loss: float
    step_time_s: float
    step_time_max_s: float
    slowest_rank: int
    mem_gib: float
    grad_norm: float


#: Recorded rows a record's step times are averaged over: one record stands for hundreds of steps, and the
#: recording's single-step times carry the shared machine's contention.
SMOOTH_ROWS = 8
#: Rows each side of the running median that makes the loss trend.
LOSS_MEDIAN_ROWS = 25
#: Relative standard deviation of the seeded loss noise around the trend.
LOSS_NOISE = 0.02


@cache
def recorded_curve() -> tuple[CurveRow, ...]:
    """The real tiny-CPU run's records (recorded_curve.json: its provenance says how it was made), step times
    averaged over SMOOTH_ROWS rows."""
    data = json.loads(resources.files("ulyssesd.daemon.sim").joinpath("recorded_curve.json").read_text())
    rows = [CurveRow(*row) for row in data["rows"]]
    out = []
    for i, r in enumerate(rows):
        win = rows[i:i + SMOOTH_ROWS]
        st, mx = sum(w.step_time_s for w in win) / len(win), sum(w.step_time_max_s for w in win) / len(win)
        # The loss trend: the recording mixes three synthetic data sources whose per-batch losses differ by 10x
        # (it was reduced to the single loss, without loss_by_source); its running median is the curve.
        around = sorted(w.loss for w in rows[max(0, i - LOSS_MEDIAN_ROWS):i + LOSS_MEDIAN_ROWS + 1])
        out.append(CurveRow(r.step, around[len(around) // 2], st, mx, r.slowest_rank, r.mem_gib, r.grad_norm))
    return tuple(out)


def loss_noise(seed: int, step: int) -> float:
    """A record's relative loss noise (about 2 %), a function of the run's seed and the step only: the same
    step of a replayed or rolled-back trajectory gets the same value."""
    return random.Random(seed * 1_000_003 + step).gauss(0.0, LOSS_NOISE)


@dataclass(frozen=True)
class JobModel:
    """How the simulated job behaves (one per run; the runner draws nothing from it)."""

    step_time_s: float = 2.0  # median step time: the recorded trace's times are scaled to it
    record_every: int = 300  # steps per step record (coarse: one record stands for this many steps)
    horizon_steps: int = 300_000  # the recorded curve is stretched over this many steps
    startup_s: float = 90.0  # launch to the first step (process start, load, warm-up)
    save_s: float = 40.0  # one checkpoint write
    tag_bytes: int = 32 * 1024  # real bytes of one tag on the simulated disk
    mem_scale: float = 150.0  # the recorded memory (GiB) times this: a large-model figure
    seed: int = 0  # the run's seed (the loss noise)


@dataclass
class SimJob:
    """One attempt's launcher and ranks."""

    pid: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    disk: SimDisk
    model: JobModel
    started_m: float  # monotonic time of the spawn
    wall_offset: float  # wall - monotonic at the spawn (a clock step later moves the wall clock, not this job)
    ranks: list[int] = field(default_factory=list)
    alive: bool = True
    status: ExitStatus | None = None
    phase: str = "starting"  # starting, training, saving, hung, exiting
    next_m: float = 0.0  # monotonic time of its next action
    step: int = 0
    resumed_from: str | None = None
    poisoned: bool = False  # its weights are NaN (a NaN fault, or resumed from a poisoned tag)
    spike_records: int = 0  # records left of a loss spike
    slow_factor: float = 1.0  # a slow rank: its step time times this
    exit_after_save: bool = False  # a SIGTERM's save: exit 0 once written
    saw_nonfinite: bool = False  # it reported a non-finite loss this attempt: no exit save (training/recovery/exit_guard.py)
    saving_tag: str | None = None
    resumes: list[tuple[str, bool]] = field(default_factory=list)  # (tag, poisoned) this attempt loaded
    was_hung: bool = False  # a hang fault stopped it (the truth a hang incident is checked against)

    def __post_init__(self) -> None:
        self.ranks = [self.pid + 1, self.pid + 2]
        self.next_m = self.started_m + self.model.startup_s
        self.config = json.loads(Path(self.argv[self.argv.index("--config") + 1]).read_text())
        self.run_dir = Path(self.env["ULYSSESD_RUN_DIR"])
        self.attempt = int(self.env["ULYSSESD_ATTEMPT"])
        ck = self.config.get("checkpoint") or {}
        self.ckpt_dir = Path(ck.get("dir") or self.run_dir / "checkpoints")
        self.interval = max(1, int(ck.get("interval_steps") or 1000))
        self.keep_last = int(ck.get("keep_last") or 3)
        self.total_steps = int((self.config.get("train") or {}).get("steps") or 10**9)
        self._say("starting")

    # ------------------------------------------------------------------------------ output
    def _say(self, line: str) -> None:
        with open(self.log_path, "a") as fh:
            fh.write(line + "\n")

    def _emit(self, now_m: float, rec: dict[str, Any]) -> None:
        rec = {"v": 1, "time": round(now_m + self.wall_offset, 3), "attempt": self.attempt, **rec}
        with open(self.run_dir / "telemetry.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def _exit(self, now_m: float, code: int | None, sig: int | None = None) -> None:
        self.alive, self.phase, self.next_m = False, "exited", INF
        self.status = ExitStatus(code, sig, "wait")
        exit_file = self.run_dir / "attempts" / f"{self.attempt}.exit"
        exit_file.parent.mkdir(parents=True, exist_ok=True)
        exit_file.write_text(json.dumps({"returncode": code, "signal": sig, "ended": now_m + self.wall_offset}))

    # ------------------------------------------------------------------------------ the run
    def advance(self, now_m: float) -> None:
        """Everything the job does up to monotonic time `now_m`."""
        while self.alive and self.next_m <= now_m:
            t = self.next_m
            if self.phase == "starting":
                self._start(t)
            elif self.phase == "training":
                self._train(t)
            elif self.phase == "saving":
                self._finish_save(t)
            else:
                self.next_m = INF

    def _start(self, t: float) -> None:
        from ulyssesd.training import checkpoint as ck

        want = (self.config.get("checkpoint") or {}).get("load")
        tags = ck.list_tags(self.ckpt_dir)
        candidates = list(reversed(tags)) if want in (None, "latest") else [want] if want not in ("none", "") else []
        if want in (None, "latest") and ck.read_latest(self.ckpt_dir) in tags:
            first = ck.read_latest(self.ckpt_dir)
            candidates = [first] + [c for c in candidates if c != first]
        chosen = None
        for tag in candidates:
            ok, reason = ck.validate_tag(self.ckpt_dir / tag, True)
            if ok:
                chosen = tag
                break
            self._emit(t, {"kind": "event", "event": "checkpoint_invalid", "tag": tag, "reason": reason})
        if candidates and chosen is None:
            self._emit(t, {"kind": "event", "event": "exiting", "reason": "no_checkpoint", "step": 0,
                           "problems": ["no valid checkpoint"]})
            self._exit(t, 3)
            return
        if chosen is not None:
            self.step = ck.step_of_tag(chosen) or 0
            self.poisoned = _poisoned(self.ckpt_dir / chosen)
            self.resumed_from = chosen
            self.resumes.append((chosen, self.poisoned))
        self._emit(t, {"kind": "event", "event": "started", "step": self.step, "start_step": self.step,
                       "resumed_from": self.resumed_from, "world_size": 2, "config_version":
                       int(self.env.get("ULYSSESD_CONFIG_VERSION", "1"))})
        if chosen is not None:
            self._emit(t, {"kind": "event", "event": "checkpoint_loaded", "tag": chosen, "seconds": 10.0})
        self.phase = "training"
        self.next_m = t + self._chunk_time(self._chunk())

    def _chunk(self) -> int:
        to_save = self.interval - self.step % self.interval
        return max(1, min(self.model.record_every, to_save, self.total_steps - self.step))

    def _row(self) -> CurveRow:
        curve = recorded_curve()
        i = min(len(curve) - 1, int(len(curve) * self.step / self.model.horizon_steps))
        return curve[i]

    def _chunk_time(self, steps: int) -> float:
        row, med = self._row(), 0.1426  # the recorded trace's median step time (s)
        return steps * row.step_time_max_s / med * self.model.step_time_s * self.slow_factor

    def _train(self, t: float) -> None:
        steps = self._chunk()
        self.step += steps
        row, scale = self._row(), self.model.step_time_s / 0.1426
        loss: Any = row.loss * (1.0 + loss_noise(self.model.seed, self.step))
        if self.poisoned:
            loss = "nan"
            self.saw_nonfinite = True
        elif self.spike_records > 0:
            self.spike_records -= 1
            loss = row.loss * 12.0 + 3.0
        st, stmax = row.step_time_s * scale, row.step_time_max_s * scale * self.slow_factor
        self._emit(t, {"kind": "step", "step": self.step, "loss": loss, "step_time_s": round(st, 4),
                       "step_time_max_s": round(stmax, 4), "slowest_rank": row.slowest_rank,
                       "grad_norm": "nan" if self.poisoned else row.grad_norm, "tokens": 65536,
                       "tokens_per_s": round(65536 / max(stmax, 1e-6), 1),
                       "mem_max_allocated_gib": round(row.mem_gib * self.model.mem_scale, 2),
                       "samples": [self.step - 1, self.step]})  # this step's samples (one a step)
        if self.step >= self.total_steps:
            self._emit(t, {"kind": "event", "event": "exiting", "reason": "completed", "step": self.step})
            self._exit(t, 0)
        elif self.step % self.interval == 0:
            self._begin_save(t)
        else:
            self.next_m = t + self._chunk_time(self._chunk())

    # ------------------------------------------------------------------------------ saves
    def _begin_save(self, t: float) -> None:
        from ulyssesd.training import checkpoint as ck
        from ulyssesd.training.checkpoint import budget as bd

        tag = ck.tag_for_step(self.step)
        skipped = None if self.disk.read_only else bd.room_for_save(
            self.ckpt_dir, self.run_dir, tag, self.keep_last, under_daemon=True, log=_log,
            predicted_bytes=self.model.tag_bytes)
        if skipped is not None:
            self._emit(t, {"kind": "event", "event": "checkpoint_skipped", "step": self.step, **skipped})
            self._after_save(t)
            return
        self._emit(t, {"kind": "event", "event": "checkpoint_saving", "step": self.step, "tag": tag})
        err = self.disk.write_error(self.model.tag_bytes)
        if err is not None:
            self._save_failed(t, tag, err)
            return
        d = self.ckpt_dir / tag
        if d.exists():  # a tag of this step from an abandoned trajectory: the new save replaces it
            import shutil

            shutil.rmtree(d)
        d.mkdir(parents=True)
        (d / "mp_rank_00_model_states.pt").write_bytes(bytes([self.step % 251]) * self.model.tag_bytes)
        self.saving_tag, self.phase, self.next_m = tag, "saving", t + self.model.save_s

    def _save_failed(self, t: float, tag: str, err: int) -> None:
        import errno as errno_mod

        name = errno_mod.errorcode.get(err, "unknown")
        self._say(f"OSError: [Errno {err}] {name}: checkpoint {tag}")
        self._emit(t, {"kind": "event", "event": "checkpoint_save_failed", "step": self.step, "tag": tag,
                       "errno": name, "errno_code": err, "path": str(self.ckpt_dir / tag),
                       "bytes_free": self.disk.free(), "error": f"[Errno {err}] {name}", "rank": 0,
                       "failed_ranks": [0, 1]})
        self._emit(t, {"kind": "event", "event": "exiting", "reason": "checkpoint_save_failed", "step": self.step})
        self._exit(t, 4)

    def _finish_save(self, t: float) -> None:
        from ulyssesd.training import checkpoint as ck

        tag = self.saving_tag
        assert tag is not None
        d = self.ckpt_dir / tag
        if self.disk.read_only:
            self._save_failed(t, tag, 30)  # EROFS: the remount came during the write
            return
        (d / POISON_FILE).write_text(json.dumps({"poisoned": self.poisoned, "attempt": self.attempt}))
        ck.write_manifest(d, self.step, None, self.step, int(self.env.get("ULYSSESD_CONFIG_VERSION", "1")))
        ck.point_latest_to(self.ckpt_dir, tag)
        self.saving_tag = None
        self._emit(t, {"kind": "event", "event": "checkpoint_saved", "step": self.step, "tag": tag,
                       "seconds": self.model.save_s, "bytes": self.model.tag_bytes})
        self._after_save(t)

    def _after_save(self, t: float) -> None:
        if self.exit_after_save:
            self._emit(t, {"kind": "event", "event": "exiting", "reason": "sigterm", "step": self.step})
            self._exit(t, 0)
            return
        self.phase, self.next_m = "training", t + self._chunk_time(self._chunk())

    # ------------------------------------------------------------------------------ signals and faults
    def signal(self, sig: int, now_m: float) -> None:
        if not self.alive:
            return
        if sig == signal.SIGKILL:
            self._exit(now_m, None, signal.SIGKILL)
        elif sig == signal.SIGUSR1:
            self._say(f"Current thread 0x{self.pid:x} (most recent call first):\n"
                      f"  File \"train.py\", line 1 in {'all_reduce' if self.phase == 'hung' else 'step'}")
        elif sig == signal.SIGTERM and self.phase != "hung" and not self.exit_after_save:
            self.exit_after_save = True
            if self.phase == "saving":
                return  # the save in flight is the final one
            if self.phase == "starting" or self._suspect() or self.saw_nonfinite:
                self._emit(now_m, {"kind": "event", "event": "exiting", "reason": "sigterm", "step": self.step})
                self._exit(now_m, 0)
                return
            self.step = self.step  # the save is of the step reached
            self._begin_save(now_m)

    def _suspect(self) -> bool:
        try:
            return bool(json.loads((self.run_dir / "control.json").read_text()).get("suspect"))
        except (OSError, ValueError, AttributeError):
            return False

    def crash(self, now_m: float, text: str, code: int | None = 1, sig: int | None = None) -> None:
        self._say("Traceback (most recent call last):\n  File \"train.py\", line 1, in <module>\n" + text)
        self._exit(now_m, code, sig)

    def hang(self) -> None:
        if self.phase in ("training", "starting"):
            self.phase, self.next_m, self.was_hung = "hung", INF, True


def _poisoned(tag_dir: Path) -> bool:
    try:
        return bool(json.loads((tag_dir / POISON_FILE).read_text()).get("poisoned"))
    except (OSError, ValueError, AttributeError):
        return False
