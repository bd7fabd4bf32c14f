"""The submit-mode attempt: `python -m ulyssesd.daemon.job.slurm_watch --plan {run_dir}/slurm/attempt-N.plan.json`.

It runs under the job wrapper in the place of a launcher, so an attempt is still one local process tree
the daemon spawns, signals and re-adopts (docs/SLURM.md). It:
- submits the attempt's batch script with `sbatch --parsable` (or, when `attempt-N.job.json` already names a
  job, attaches to it: re-adoption by job id) and records the job id in `attempt-N.job.json`;
- polls `scontrol show job` and the job's nodes every `poll_s` (bounded: a Slurm command has a timeout and
  a few retries; `MAX_QUERY_FAILURES` failed polls in a row end the watch as "unknown");
- a node of the running job that goes DOWN or stops responding: the remaining ranks are stuck in a
  collective, so the job is cancelled at once and the node is recorded as lost;
- forwards the daemon's signals through the scheduler: SIGUSR1 -> `scancel --signal=USR1` (stack dumps of
  every rank; not --full: the batch shell would die of it), SIGTERM -> `scancel --signal=TERM` (the ranks
  save and exit), `cancel_grace_s` later `scancel` (kill);
- at the end writes `attempt-N.end.json` (how it ended: `SlurmEnd`, with the scontrol/sacct text as
  evidence), prints a summary into the attempt log and exits 0 for a completed job or a saved time limit.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.job.slurm import (
    SLURM_DIR,
    TERMINAL_STATES,
    TIME_LIMIT_MARK,
    RealSlurm,
    SlurmCommands,
    SlurmEnd,
    SlurmError,
    SubmitRefused,
    classify_end,
    expand_hostlist,
    node_lost,
)

#: Failed polls in a row (controller unreachable) before the watch gives up with an "unknown" end.
MAX_QUERY_FAILURES = 30
#: The watcher's exit code when sbatch refused the job (attempt-N.refused.json says why).
EXIT_REFUSED = 2


@dataclass(frozen=True)
class WatchPlan:
    """What one submit-mode attempt runs; written by the daemon (launcher.py), read by the watcher."""

    run_dir: str  # the run directory (on the filesystem the compute nodes share)
    attempt: int  # the attempt number
    script: str  # the batch script to submit
    sbatch_args: list[str]  # sbatch options (nodes, ntasks, partition, time, signal, exclude, output, …)
    env: dict[str, str]  # the environment sbatch runs with (exported to the job)
    ntasks_per_node: int  # ranks per node (rank -> node mapping)
    poll_s: float  # seconds between polls
    command_timeout_s: float  # timeout of one Slurm command
    cancel_grace_s: float  # SIGTERM -> scancel (kill) grace
    bin_dir: str | None = None  # where the Slurm commands are (None: $PATH)

    @classmethod
    def read(cls, path: Path) -> WatchPlan:
        data = json.loads(path.read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def write(self, path: Path) -> None:
        from ulyssesd.daemon.job.config import write_json_atomic

        write_json_atomic(path, {k: getattr(self, k) for k in self.__dataclass_fields__})

    def path(self, suffix: str) -> Path:
        return Path(self.run_dir) / SLURM_DIR / f"attempt-{self.attempt}.{suffix}"

    @property
    def time_limit_mark(self) -> Path:
        return Path(self.run_dir) / SLURM_DIR / TIME_LIMIT_MARK.format(attempt=self.attempt)


def read_job_id(run_dir: Path, attempt: int) -> str | None:
    """The Slurm job id an attempt submitted (None when it never got one or the record is unreadable)."""
    try:
        data = json.loads((run_dir / SLURM_DIR / f"attempt-{attempt}.job.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    job_id = data.get("job_id") if isinstance(data, dict) else None
    return job_id if isinstance(job_id, str) and job_id.isdigit() else None


def read_end(run_dir: Path, attempt: int) -> SlurmEnd | None:
    try:
        data = json.loads((run_dir / SLURM_DIR / f"attempt-{attempt}.end.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return SlurmEnd.from_json(data) if isinstance(data, dict) else None


def final_end(slurm: SlurmCommands, job_id: str, ntasks_per_node: int, time_limit_signalled: bool,
              lost_while_running: list[str]) -> SlurmEnd:
    """How the job ended, from scontrol, sacct and its nodes' states; every source's text kept as evidence."""
    evidence: dict[str, Any] = {}
    try:
        job = slurm.job(job_id)
    except SlurmError as exc:
        job, evidence["scontrol_error"] = None, str(exc)
    try:
        rows = slurm.sacct(job_id)
    except SlurmError as exc:  # accounting is optional on a cluster: scontrol still knows the job a while
        rows, evidence["sacct_error"] = [], str(exc)
    nodes = expand_hostlist((job or {}).get("NodeList") or (rows[0].get("NodeList", "") if rows else ""))
    states: dict[str, str] = {}
    for n in nodes:
        info = slurm.node(n)
        if info is not None:
            states[n] = info.get("State", "")
            if info.get("Reason"):
                evidence.setdefault("node_reasons", {})[n] = info["Reason"]
    end = classify_end(job_id, job, rows, states, ntasks_per_node, time_limit_signalled, lost_while_running)
    evidence["scontrol_show_job"] = slurm.raw(["scontrol", "show", "job", job_id])
    evidence["sacct"] = slurm.raw(["sacct", "-j", job_id, "--format=JobID,JobName,State,ExitCode,NodeList,Elapsed"])
    for n in end.lost_nodes:
        evidence.setdefault("scontrol_show_node", {})[n] = slurm.raw(["scontrol", "show", "node", n])
    end.evidence = {**evidence, **end.evidence}
    return end


class Watcher:
    """One attempt's Slurm job, polled; `run()` returns how it ended. Signals only set flags (the loop acts)."""

    def __init__(self, plan: WatchPlan, slurm: SlurmCommands, *, clock: Callable[[], float] = SYSTEM.monotonic,
                 sleep: Callable[[float], None] = SYSTEM.sleep, say: Callable[[str], None] | None = None) -> None:
        self.plan, self.slurm, self.clock, self.sleep = plan, slurm, clock, sleep
        self.say = say or (lambda m: print(f"[ulyssesd slurm] {m}", flush=True))
        self.want_dump = False
        self.want_term = 0  # SIGTERMs received
        self.term_sent_at: float | None = None
        self.cancelled = False
        self.lost: list[str] = []

    def submit_or_attach(self) -> str:
        job_id = read_job_id(Path(self.plan.run_dir), self.plan.attempt)
        if job_id is not None:
            self.say(f"attaching to job {job_id} (attempt {self.plan.attempt}; recorded in "
                     f"{self.plan.path('job.json')})")
            return job_id
        from ulyssesd.daemon.job.config import write_json_atomic

        try:
            job_id = self.slurm.sbatch(Path(self.plan.script), self.plan.sbatch_args, self.plan.env)
        except SubmitRefused as exc:
            write_json_atomic(self.plan.path("refused.json"), {"error": str(exc), "sbatch_args": self.plan.sbatch_args})
            raise

        write_json_atomic(self.plan.path("job.json"), {"job_id": job_id, "submitted": SYSTEM.time(),
                                                       "sbatch_args": self.plan.sbatch_args})
        self.say(f"submitted job {job_id}: sbatch {' '.join(self.plan.sbatch_args)}")
        return job_id

    def _cancel(self, job_id: str, why: str) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        self.say(f"scancel {job_id}: {why}")
        try:
            self.slurm.scancel(job_id)
        except SlurmError as exc:
            self.say(f"scancel {job_id} failed: {exc}")

    def _forward(self, job_id: str) -> None:
        if self.want_dump:
            self.want_dump = False
            try:
                self.slurm.scancel(job_id, signal="USR1")
                self.say(f"scancel --signal=USR1 {job_id} (stack dumps)")
            except SlurmError as exc:
                self.say(f"stack dump request failed: {exc}")
        if self.want_term and self.term_sent_at is None:
            self.term_sent_at = self.clock()
            try:
                self.slurm.scancel(job_id, signal="TERM")
                self.say(f"scancel --signal=TERM {job_id} (save and exit); scancel after {self.plan.cancel_grace_s:.0f}s")
            except SlurmError as exc:
                self.say(f"SIGTERM via scancel failed: {exc}")
        if self.term_sent_at is not None and (self.want_term > 1 or
                                              self.clock() - self.term_sent_at >= self.plan.cancel_grace_s):
            self._cancel(job_id, "grace over" if self.want_term <= 1 else "second SIGTERM")

    def watch(self, job_id: str) -> SlurmEnd:
        failures = 0
        while True:
            self._forward(job_id)
            try:
                job = self.slurm.job(job_id)
                failures = 0
            except SlurmError as exc:
                failures += 1
                if failures >= MAX_QUERY_FAILURES:
                    self.say(f"giving up after {failures} failed polls: {exc}")
                    self._cancel(job_id, "the watch cannot reach Slurm")  # never leave a job nobody watches
                    break
                self.sleep(self.plan.poll_s)
                continue
            if job is None:
                break  # Slurm forgot it (MinJobAge passed): sacct says how it ended
            state = (job.get("JobState") or "").split(" ")[0]
            if state in TERMINAL_STATES:
                break
            if state in ("RUNNING", "COMPLETING") and not self.cancelled:
                for node in expand_hostlist(job.get("NodeList", "")):
                    info = self.slurm.node(node)
                    if info is not None and node_lost(info.get("State", "")) and node not in self.lost:
                        self.lost.append(node)
                if self.lost:
                    # Said before the cancel: the daemon's hang path defers to a node loss being handled
                    # (daemon/job/slurm_supervise.py `node_loss_pending`), whichever notices first.
                    from ulyssesd.daemon.job.config import write_json_atomic

                    write_json_atomic(self.plan.path("lost.json"), {"job_id": job_id, "nodes": self.lost})
                    # Its peers cannot finish a collective without it: end the job now, not at a timeout.
                    self._cancel(job_id, f"node {', '.join(self.lost)} lost "
                                         f"({', '.join((self.slurm.node(n) or {}).get('State', '?') for n in self.lost)})")
            self.sleep(self.plan.poll_s)
        end = final_end(self.slurm, job_id, self.plan.ntasks_per_node, self.plan.time_limit_mark.exists(), self.lost)
        return end

    def run(self) -> tuple[SlurmEnd, int]:
        job_id = self.submit_or_attach()
        end = self.watch(job_id)
        from ulyssesd.daemon.job.config import write_json_atomic

        write_json_atomic(self.plan.path("end.json"), end.to_json())
        self.say(f"{end.why} [{end.kind}; state {end.state or '?'}, exit {end.exit_code or '?'}, "
                 f"nodes {','.join(end.nodes) or '?'}]")
        code = 0 if end.kind in ("completed", "time_limit") else 1
        return end, code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] != "--plan":
        print("usage: python -m ulyssesd.daemon.job.slurm_watch --plan PLAN.json", file=sys.stderr)
        return 2
    try:
        plan = WatchPlan.read(Path(argv[1]))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"ulyssesd slurm_watch: unreadable plan {argv[1]}: {exc}", file=sys.stderr)
        return 2
    watcher = Watcher(plan, RealSlurm(plan.command_timeout_s, bin_dir=plan.bin_dir))

    def on_usr1(signum: int, frame: Any) -> None:
        watcher.want_dump = True

    def on_term(signum: int, frame: Any) -> None:
        watcher.want_term += 1

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        _, code = watcher.run()
    except SlurmError as exc:
        print(f"ulyssesd slurm_watch: {exc}", file=sys.stderr, flush=True)
        return EXIT_REFUSED if isinstance(exc, SubmitRefused) else 1
    return code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
