"""One seeded simulated run: the real `Supervisor` (engine, SQLite store, checkpoint budget) against `SimOS`, a
`SimJob` per attempt and a `SimDisk`, with the fault process's events applied in time order and the invariants
checked after every event. The inputs are the seed and the fault list: `run_seed(seed, cfg, faults=...)` with the
faults of a failed run replays it exactly (same seed, same files, same decisions); `minimise` shrinks that list to
the few events that still break the invariant.

Time moves in coarse steps: the supervisor ticks every `SimConfig.tick_s` simulated seconds (and every few
seconds while it stops an attempt, or when a backoff ends), the job writes one record per `JobModel.record_every`
steps, and nothing happens between events. A simulated week is a few hundred ticks.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.core.states import TERMINAL
from ulyssesd.daemon.sim.disk import SimDisk
from ulyssesd.daemon.sim.faults import ExtraRates, Fault, draw_faults
from ulyssesd.daemon.sim.invariants import Checker, StoreReader, Violation
from ulyssesd.daemon.sim.job import JobModel
from ulyssesd.daemon.sim.simos import SimOS
from ulyssesd.daemon.store.enums import RunState

S = RunState

#: Crash texts per effect, as the daemon's log diagnosis sees real ones.
CRASH_TEXT = {
    "crash_gpu": "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
                 "CUDA kernel errors might be asynchronously reported at some other API call",
    "crash_network": "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process "
                     "exited or there was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed "
                     "possibly due to a network error or a remote process exiting prematurely.",
    "crash_python": "KeyError: 'input_ids'",
    "oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
           "of 79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB "
           "memory in use.",
}


#: Faults that end or restart the attempt (the goodput model's interruptions).
INTERRUPTING = frozenset({*CRASH_TEXT, "lost_node", "hang", "nan", "op_restart"})


@dataclass(frozen=True)
class SimConfig:
    """One simulated run's settings (the seed draws the faults; these shape the world)."""

    days: float = 7.0  # simulated duration
    gpus: int = 16_384  # the job's GPUs: the Llama 3 interruption rate scales with it
    tick_s: float = 1800.0  # the supervisor's tick while nothing is pending
    busy_tick_s: float = 10.0  # ... while an attempt is being stopped
    disk_tags: int = 10  # checkpoint disk capacity, in tags
    interval_steps: int = 1500  # steps between saves
    keep_last: int = 3
    extra: ExtraRates = ExtraRates()
    job: JobModel = JobModel()


@dataclass
class RunResult:
    seed: int
    faults: list[Fault]
    violations: list[Violation]
    trace: list[dict[str, Any]] = field(default_factory=list)  # what was applied, in order
    state: str = ""
    sim_s: float = 0.0
    ticks: int = 0
    attempts: int = 0
    incidents: int = 0
    daemons: int = 1
    wall_s: float = 0.0
    end_reason: str = ""  # the last state transition's reason when the run ended before the simulated time
    goodput: float = 0.0  # the furthest step trained x a healthy step's time / simulated time (redone work is lost)
    goodput_model: float = 0.0  # 1 - interruptions x (half a save interval + half a tick + start-up) / time


    @property
    def ok(self) -> bool:
        return not self.violations


def _toml(sections: dict[str, dict[str, Any]]) -> str:
    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v)

    return "\n".join(f"[{name}]\n" + "".join(f"{k} = {val(v)}\n" for k, v in body.items())
                     for name, body in sections.items())


def write_spec(work: Path, seed: int, cfg: SimConfig, tag_bytes: int) -> Path:
    """The run spec: a small model (its predicted tag size is what the simulated job writes), the margin one tag."""
    sections: dict[str, dict[str, Any]] = {
        "run": {"name": f"sim-{seed}"},
        "launcher": {"kind": "local"},
        "daemon": {"state_dir": str(work / "state"), "socket_path": str(work / "d.sock"), "tick_s": 1.0,
                   "stop_grace_s": 120.0, "hang_grace_s": 30.0, "stack_dump_wait_s": 10.0, "backoff_base_s": 10.0,
                   "backoff_max_s": 600.0, "early_death_s": 300.0, "preflight": False,
                   "min_free_gib": tag_bytes / (1 << 30), "checkpoint_anchors": 2, "set_aside_keep": 1,
                   # A store backup copies the whole database: daily, not every 15 min, keeps a week in seconds.
                   # Retention runs after every save anyway; its timer hourly, not every minute.
                   "backup_every_s": 86_400.0, "retention_every_s": 3600.0},
        "model": {"preset": "tiny", "hidden_size": 32, "num_layers": 2, "num_attention_heads": 2, "vocab_size": 256,
                  "max_seq_len": 256},
        "train": {"steps": 10**9, "micro_batch_size": 1},
        "checkpoint": {"interval_steps": cfg.interval_steps, "keep_last": cfg.keep_last, "dir": str(work / "ckpt"),
                       "verify_checksums": True},
    }
    path = work / "run.toml"
    path.write_text(_toml(sections))
    return path


class SimRun:
    """The world of one run: clock, disk, jobs, the daemon of the moment, the checker."""

    def __init__(self, seed: int, cfg: SimConfig, work: Path, faults: list[Fault]) -> None:
        from ulyssesd.daemon.core.housekeeping import LoopScheduler
        from ulyssesd.daemon.spec import load_run_spec

        self.seed, self.cfg, self.work = seed, cfg, work
        from ulyssesd.daemon.host.disk_budget import predicted_from_config

        first = load_run_spec(write_spec(work, seed, cfg, 0))
        tag = predicted_from_config(first.job.model_dump(mode="json")) or cfg.job.tag_bytes
        cfg = replace(cfg, job=replace(cfg.job, tag_bytes=tag, seed=seed))
        self.cfg = cfg
        self.spec = load_run_spec(write_spec(work, seed, cfg, tag))
        (work / "ckpt").mkdir(parents=True, exist_ok=True)
        self.disk = SimDisk(work / "ckpt", capacity_bytes=cfg.disk_tags * cfg.job.tag_bytes + 64 * 1024)
        self.os = SimOS(self.disk, cfg.job)
        self.checker = Checker(work / "ckpt", cfg.job.tag_bytes, StoreReader(self.spec.daemon.resolved_db_path()))
        self.queue: list[tuple[float, int, Fault]] = [(f.at, i, f) for i, f in enumerate(faults)]
        heapq.heapify(self.queue)
        self.seq = len(faults)
        self.result = RunResult(seed, list(faults), self.checker.violations)
        self.sup: Any = None
        self.scheduler_cls = LoopScheduler
        self.due: dict[str, float] = {}

    # ------------------------------------------------------------------ the daemon
    def start_daemon(self) -> None:
        from ulyssesd.daemon.store import open_store
        from ulyssesd.daemon.supervisor import Supervisor

        self.scheduler = self.scheduler_cls(use_thread=False)
        store = open_store(self.spec.daemon.resolved_db_path(), clock=self.os)  # rows stamped on simulated time
        self.sup = Supervisor(self.spec, store, self.os, scheduler=self.scheduler)
        self.sup.start()
        d = self.spec.daemon
        every = {"checkpoint_retention": d.retention_every_s, "store_maintenance": d.maintenance_every_s,
                 "store_backup": d.backup_every_s, "stale_attempt_sweep": d.sweep_every_s}
        self.every = every
        self.due = {name: self.os.m + s for name, s in every.items()}

    def kill_daemon(self) -> None:
        """SIGKILL: nothing of the daemon runs again; its store connection is dropped, the job keeps going."""
        try:
            self.sup.store.close()
        except Exception:  # noqa: BLE001 - a dead daemon's connection: nothing to save
            pass
        self.sup = None

    # ------------------------------------------------------------------ the loop
    def next_dt(self) -> float:
        """Seconds to the next tick: soon while an attempt is being stopped, right after the job's next action
        while it starts (its `started` event, its first record), at a backoff's end, else `tick_s`."""
        sup, cfg = self.sup, self.cfg
        if sup.term is not None or sup.state == S.STOPPING:
            return cfg.busy_tick_s
        if sup.state == S.BACKOFF and sup.backoff_until is not None:
            return max(0.5, min(cfg.tick_s, sup.backoff_until - sup.steady.now() + 0.1))
        live = self.os.live_jobs()
        if sup.state in (S.STARTING, S.RESTARTING, S.REMEDIATING) and live:
            return max(1.0, min(cfg.tick_s, live[0].next_m - self.os.m + 0.1))
        return cfg.tick_s

    def run(self) -> RunResult:
        end = self.cfg.days * 86_400.0
        self.start_daemon()
        ticks = 0
        while self.os.m < end and self.sup.state not in TERMINAL and not self.checker.violations:
            nxt = min(self.os.m + self.next_dt(), end)
            due = []
            while self.queue and self.queue[0][0] <= nxt:
                due.append(heapq.heappop(self.queue)[2])
            if due:
                nxt = max(self.os.m, due[0].at)
                for f in due[1:]:
                    if f.at > nxt:
                        heapq.heappush(self.queue, (f.at, self._next_seq(), f))
                due = [f for f in due if f.at <= nxt]
            self.checker.before(self.sup)
            self.os.advance_to(nxt)  # the job's own actions (its room check before a save deletes too)
            self.checker.kept_checkpoints(self.os.m, self.sup)
            for f in due:
                self.apply(f)
            if self.sup is None:
                continue
            self.checker.before(self.sup)
            for name, at in self.due.items():
                if self.os.m >= at:
                    self.scheduler.enqueue(name)
                    self.due[name] = self.os.m + self.every[name]
            self.sup.tick()
            ticks += 1
            self.checker.after(self.os.m, self.sup, self.os)
        if self.sup is not None and not self.checker.violations:
            self.checker.restart_budget(self.sup, self.os)
            self.checker.settled(self.os.m, self.sup)
        r = self.result
        r.sim_s, r.ticks = round(self.os.m, 1), ticks
        self._goodput(r)
        if self.sup is not None:
            r.state, r.attempts = self.sup.state.value, self.sup.attempt
            r.incidents = len(self.sup.store.list_incidents(self.sup.run_id))
            if self.sup.state in TERMINAL:
                last = self.checker.db.rows("SELECT reason FROM state_transitions WHERE run_id=? ORDER BY id DESC "
                                            "LIMIT 1", self.sup.run_id)
                r.end_reason = last[0][0][:300] if last else ""
            self.sup.store.close()
        self.checker.db.close()
        return r

    def _goodput(self, r: RunResult) -> None:
        """The run's productive fraction and what a first-order model predicts for the interruptions it saw:
        each loses the work since the last save (half an interval on average), the time until the next tick
        notices it (half a tick) and a start-up. Pauses, backoffs and hangs' timeouts are not in the model."""
        if r.sim_s <= 0:
            return
        from ulyssesd.daemon.sim.job import recorded_curve

        m, curve = self.cfg.job, recorded_curve()
        # A healthy step's time: the trace's slowest rank (what the job runs at) plus its share of a save.
        step_s = sum(c.step_time_max_s for c in curve) / len(curve) / 0.1426 * m.step_time_s \
            + m.save_s / self.cfg.interval_steps
        best = max((j.step for j in self.os.jobs.values()), default=0)
        r.goodput = round(min(1.0, best * step_s / r.sim_s), 4)
        hits = sum(1 for t in r.trace if t.get("kind") in INTERRUPTING and not t.get("note"))
        per = self.cfg.interval_steps * m.step_time_s / 2 + self.cfg.tick_s / 2 + m.startup_s
        r.goodput_model = round(max(0.0, 1.0 - hits * per / r.sim_s), 4)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def later(self, f: Fault) -> None:
        heapq.heappush(self.queue, (f.at, self._next_seq(), f))

    # ------------------------------------------------------------------ the faults
    def apply(self, f: Fault) -> None:
        now = self.os.m
        live = self.os.live_jobs()
        job = live[0] if live else None
        note = ""
        k = f.kind
        if k in CRASH_TEXT and job is not None:
            job.crash(now, CRASH_TEXT[k])
        elif k == "lost_node" and job is not None:
            job.signal(9, now)
        elif k == "hang" and job is not None:
            job.hang()
        elif k == "nan" and job is not None:
            job.poisoned = True
        elif k == "spike" and job is not None:
            job.spike_records = int(f.arg)
        elif k == "slow_rank" and job is not None:
            job.slow_factor = 3.0
        elif k == "disk_fill":
            self.disk.external_bytes += 4 * self.cfg.job.tag_bytes
            self.later(Fault(now + f.arg, "disk_release", f.cause))
        elif k == "disk_release":
            self.disk.external_bytes = max(0, self.disk.external_bytes - 4 * self.cfg.job.tag_bytes)
        elif k == "read_only":
            self.disk.read_only = True
        elif k == "daemon_kill":
            before = self.checker.ladder_positions(self.sup)
            self.kill_daemon()
            self.start_daemon()
            self.result.daemons += 1
            self.checker.readopted(now, before, self.sup)
        elif k == "clock_step":
            self.os.step_wall_clock(f.arg)
        elif k.startswith("op_"):
            note = self._operator(f)
        else:
            note = "no live job"
        self.result.trace.append({**f.to_dict(), "at": round(now, 1), "state": self.sup.state.value,
                                  **({"note": note} if note else {})})

    def _operator(self, f: Fault) -> str:
        sup, cmd = self.sup, f.kind[3:]
        if cmd == "ack":
            incs = sup.store.list_incidents(sup.run_id)
            if not incs:
                return "nothing to ack"
            ans = sup.handle_command({"cmd": "ack", "args": {"id": incs[-1].id, "by": "sim"}})
        else:
            ans = sup.handle_command({"cmd": cmd})
        if cmd == "pause" and ans.get("ok"):
            self.later(Fault(self.os.m + f.arg, "op_resume", f.cause))
        return "" if ans.get("ok") else f"refused: {ans.get('code')}"


@contextlib.contextmanager
def no_open_file_scan() -> Iterator[None]:
    """Retention asks which checkpoint files a process still holds open by scanning the real host's /proc
    (`budget.held_entries`), outside the OS seam; simulated processes hold none."""
    from ulyssesd.training.checkpoint import budget as bd

    saved = bd.held_entries
    bd.held_entries = lambda root, proc=Path("/proc"): set()  # type: ignore[assignment]
    try:
        yield
    finally:
        bd.held_entries = saved  # type: ignore[assignment]


def run_seed(seed: int, cfg: SimConfig = SimConfig(), faults: list[Fault] | None = None,
             work: Path | None = None) -> RunResult:
    """One run; `faults` None: drawn from the seed. The work directory is removed unless given."""
    t0 = SYSTEM.monotonic()
    random.seed(seed)  # the daemon's backoff jitter draws from the global generator
    if faults is None:
        faults = draw_faults(random.Random(seed), cfg.days, cfg.gpus, cfg.extra)
    own = work is None
    shm = Path("/dev/shm")  # a memory filesystem when there is one: the daemon fsyncs every small write
    work = Path(tempfile.mkdtemp(prefix=f"ulysses-sim-{seed}-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK)
                                 else None)) if work is None else work
    try:
        sim = SimRun(seed, cfg, work, faults)
        with sim.disk.patched(), no_open_file_scan():
            result = sim.run()
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    result.wall_s = round(SYSTEM.monotonic() - t0, 3)
    return result


def minimise(result: RunResult, cfg: SimConfig, budget: int = 40) -> list[Fault]:
    """The fewest faults (greedy, one removed at a time, at most `budget` replays) that still break the same
    invariant: the trace a human reads and a regression test replays."""
    want = result.violations[0].invariant
    faults = [f for f in result.faults if f.at <= result.violations[0].at]
    i, tries = 0, 0
    while i < len(faults) and tries < budget:
        trial = faults[:i] + faults[i + 1:]
        tries += 1
        r = run_seed(result.seed, cfg, trial)
        if r.violations and r.violations[0].invariant == want:
            faults = trial
        else:
            i += 1
    return faults


def describe(result: RunResult, faults: list[Fault] | None = None, cfg: SimConfig | None = None) -> str:
    """The violation, the seed and the event trace that replays it (`ulyssesd simulate --replay FILE`)."""
    v = result.violations[0]
    doc = {"seed": result.seed, "invariant": v.invariant, "at_s": v.at, "detail": v.detail,
           "config": asdict(cfg) if cfg else None,
           "faults": [f.to_dict() for f in (faults if faults is not None else result.faults)]}
    return json.dumps(doc, indent=1)


def faults_from(doc: dict[str, Any]) -> list[Fault]:
    return [Fault(**f) for f in doc["faults"]]


def config_from(doc: dict[str, Any] | None) -> SimConfig:
    if not doc:
        return SimConfig()
    return replace(SimConfig(), **{k: v for k, v in doc.items() if k not in ("extra", "job")},
                   extra=ExtraRates(**doc.get("extra", {})), job=JobModel(**doc.get("job", {})))
