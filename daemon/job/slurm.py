"""Slurm: the commands the daemon runs (sbatch, squeue, scontrol, sacct, sinfo, scancel) behind one seam, and
the pure decisions on their output (docs/SLURM.md).

`SlurmCommands` is the seam: `RealSlurm` runs the client commands with a timeout and bounded tenacity retries;
the unit tests drive the same decisions with a fake (tests/slurm). Everything else here is pure: parse
`scontrol show -o` / `sacct --parsable2` output, expand hostlists (`n[1-3,5]`), map ranks to nodes, classify how
a job ended (completed, time limit, node lost, crash), bound the `--exclude` list, and write the batch script.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import tenacity

from ulyssesd.daemon.host.logging import get_logger

log = get_logger("ulyssesd.slurm")

#: Where a submit-mode attempt's Slurm records live: {run_dir}/slurm/attempt-N.{plan,job,end}.json.
SLURM_DIR = "slurm"
#: The batch script touches this file when the time-limit signal arrived (the ranks were asked to save).
TIME_LIMIT_MARK = "attempt-{attempt}.timelimit"
#: Job states after which the job holds no resources (squeue drops it; scontrol keeps it MinJobAge seconds).
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
#: Node state words that mean the node cannot run its part of the job any more.
_NODE_LOST_WORDS = frozenset({"DOWN", "NOT_RESPONDING", "POWERED_DOWN"})


class SlurmError(RuntimeError):
    """A Slurm command failed (after its retries) or answered something unreadable; the message says which."""


class SubmitRefused(SlurmError):
    """sbatch refused the job itself (bad partition, gres, time, account, an unknown node in --exclude):
    submitting it again cannot help."""


#: stderr of a Slurm command that may succeed when tried again (the controller busy or unreachable).
TRANSIENT = re.compile(r"timed out|Socket|try again|Unable to contact|Resource temporarily|Zero Bytes", re.I)


# ----------------------------------------------------------------------------------------- parsing
_KV = re.compile(r"(?:^|\s)([A-Za-z][\w:/.]*)=(.*?)(?=\s+[A-Za-z][\w:/.]*=|\s*$)")


def parse_scontrol(line: str) -> dict[str, str]:
    """One `scontrol -o show job|node` record (`Key=value Key=value …`) -> dict; a value may hold spaces."""
    return {m.group(1): m.group(2).strip() for m in _KV.finditer(line.strip())}


def parse_sacct(text: str, fields: Sequence[str]) -> list[dict[str, str]]:
    """`sacct --noheader --parsable2 --format=F1,F2,…` output -> one dict per job/step line."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        rows.append({f: (parts[i] if i < len(parts) else "") for i, f in enumerate(fields)})
    return rows


def expand_hostlist(spec: str) -> list[str]:
    """A Slurm hostlist (`n[1-3,5],gpu[01-02]`, `n1,n2`) -> host names in order; '(null)'/'' -> []."""
    spec = spec.strip()
    if not spec or spec in ("(null)", "None"):
        return []
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,\[]*", spec):
        part = part.strip().strip(",")
        if not part:
            continue
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if m is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            if "-" in rng:
                lo, hi = rng.split("-", 1)
                if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                    raise SlurmError(f"unreadable hostlist range {rng!r} in {spec!r}")
                hosts.extend(f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            elif rng.isdigit():
                hosts.append(f"{prefix}{rng}{suffix}")
            else:
                raise SlurmError(f"unreadable hostlist range {rng!r} in {spec!r}")
    return hosts


def node_lost(state: str) -> bool:
    """A node `State=` value (`IDLE`, `ALLOCATED*`, `DOWN+DRAIN`, `MIXED+NOT_RESPONDING`) means it is gone.
    A drained node keeps running its jobs, so DRAIN alone is not a loss."""
    s = state.strip().upper()
    return s.endswith("*") or bool(set(re.split(r"[+\s]", s)) & _NODE_LOST_WORDS)


def rank_nodes(nodes: Sequence[str], ntasks_per_node: int) -> dict[int, str]:
    """Rank -> node for srun's default block distribution (`--ntasks-per-node=K`: ranks 0..K-1 on the first)."""
    return {node_i * ntasks_per_node + local: node
            for node_i, node in enumerate(nodes) for local in range(ntasks_per_node)}


def bounded_exclude(current: Iterable[str], lost: Iterable[str], partition_nodes: Sequence[str],
                    nodes_needed: int, max_excluded: int | None) -> tuple[list[str], str | None]:
    """The next submission's `--exclude`: the current list plus the lost nodes. Returns (list, None), or
    (current list, why not) when excluding them would leave fewer usable nodes than the job needs (or exceed
    `max_excluded`): the run must then stop with that explanation rather than submit a job that cannot start."""
    cur = list(dict.fromkeys(current))
    new = list(dict.fromkeys([*cur, *lost]))
    if max_excluded is not None and len(new) > max_excluded:
        return cur, (f"excluding {', '.join(n for n in new if n not in cur)} would exclude {len(new)} nodes "
                     f"(slurm.max_excluded={max_excluded}): {', '.join(new)}")
    if partition_nodes:
        usable = [n for n in partition_nodes if n not in new]
        if len(usable) < nodes_needed:
            return cur, (f"excluding {', '.join(new)} leaves {len(usable)} usable node(s) "
                         f"({', '.join(usable) or 'none'}) of the partition's {len(partition_nodes)}; "
                         f"the job needs {nodes_needed}")
    return new, None


# ------------------------------------------------------------------------------- how a job ended
EndKind = Literal["completed", "time_limit", "node_lost", "cancelled", "failed", "unknown"]


@dataclass
class SlurmEnd:
    """How a submitted job ended, read from scontrol/sacct/node states (the incident's evidence)."""

    kind: EndKind
    job_id: str
    state: str  # Slurm's JobState (COMPLETED, TIMEOUT, NODE_FAIL, …) or "" when unknown
    exit_code: str = ""  # Slurm's ExitCode "rc:signal"
    nodes: list[str] = field(default_factory=list)  # the job's node list, expanded
    lost_nodes: list[str] = field(default_factory=list)  # nodes that went DOWN / stopped responding
    lost_ranks: dict[str, list[int]] = field(default_factory=dict)  # node -> the ranks that ran on it
    node_states: dict[str, str] = field(default_factory=dict)
    why: str = ""  # one line for the incident summary
    evidence: dict[str, Any] = field(default_factory=dict)  # scontrol / sacct text

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "job_id": self.job_id, "state": self.state, "exit_code": self.exit_code,
                "nodes": self.nodes, "lost_nodes": self.lost_nodes, "lost_ranks": self.lost_ranks,
                "node_states": self.node_states, "why": self.why, "evidence": self.evidence}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SlurmEnd:
        kind = d.get("kind") if d.get("kind") in ("completed", "time_limit", "node_lost", "cancelled", "failed") \
            else "unknown"
        return cls(kind=kind, job_id=str(d.get("job_id") or ""), state=str(d.get("state") or ""),  # type: ignore[arg-type]
                   exit_code=str(d.get("exit_code") or ""), nodes=[str(n) for n in d.get("nodes") or []],
                   lost_nodes=[str(n) for n in d.get("lost_nodes") or []],
                   lost_ranks={str(k): [int(r) for r in v] for k, v in (d.get("lost_ranks") or {}).items()},
                   node_states={str(k): str(v) for k, v in (d.get("node_states") or {}).items()},
                   why=str(d.get("why") or ""), evidence=dict(d.get("evidence") or {}))


def classify_end(job_id: str, job: dict[str, str] | None, sacct_rows: list[dict[str, str]],
                 node_states: dict[str, str], ntasks_per_node: int, time_limit_signalled: bool,
                 lost_while_running: Sequence[str] = ()) -> SlurmEnd:
    """How the job ended. `job`: its `scontrol show job` record (None once Slurm forgot it); `sacct_rows`: the
    allocation's row first; `node_states`: node -> State= now; `time_limit_signalled`: the batch script saw
    the time-limit signal; `lost_while_running`: nodes the watcher saw lost while the job still ran."""
    row = next((r for r in sacct_rows if r.get("JobID") == job_id), sacct_rows[0] if sacct_rows else {})
    state = ((job or {}).get("JobState") or row.get("State") or "").split()[0:1]
    st = state[0].upper() if state else ""
    st = "CANCELLED" if st.startswith("CANCELLED") else st
    exit_code = (job or {}).get("ExitCode") or row.get("ExitCode") or ""
    nodes = expand_hostlist((job or {}).get("NodeList") or row.get("NodeList") or "")
    ok = st == "COMPLETED" and exit_code.startswith("0:")
    # A node found down only after the job completed cleanly did not end it: not a loss of this attempt.
    lost = list(dict.fromkeys([*lost_while_running, *(n for n in nodes if node_lost(node_states.get(n, ""))
                                                       and not ok)]))
    by_rank = rank_nodes(nodes, ntasks_per_node)
    lost_ranks = {n: sorted(r for r, nn in by_rank.items() if nn == n) for n in lost}
    end = SlurmEnd("unknown", job_id, st, exit_code, nodes, lost, lost_ranks,
                   {n: node_states[n] for n in nodes if n in node_states})
    if st == "NODE_FAIL" or lost:
        end.kind = "node_lost"
        named = ", ".join(f"{n} (rank{'s' if len(lost_ranks.get(n, [])) != 1 else ''} "
                          f"{','.join(map(str, lost_ranks.get(n, []))) or '?'}, state {node_states.get(n, '?')})"
                          for n in lost) or "a node (Slurm did not say which)"
        end.why = f"Slurm job {job_id} lost node {named}; job state {st or 'unknown'}"
    elif st == "TIMEOUT" or (time_limit_signalled and st in ("COMPLETED", "CANCELLED", "FAILED")):
        end.kind = "time_limit"
        end.why = (f"Slurm job {job_id} reached its time limit ({st}"
                   + ("; the ranks were signalled to save first" if time_limit_signalled else "") + ")")
    elif ok:
        end.kind, end.why = "completed", f"Slurm job {job_id} completed"
    elif st == "CANCELLED":
        end.kind, end.why = "cancelled", f"Slurm job {job_id} was cancelled ({(job or row).get('Reason', '')})"
    elif st:
        end.kind, end.why = "failed", f"Slurm job {job_id} ended {st} (exit {exit_code or '?'})"
    else:
        end.why = f"Slurm job {job_id}: neither scontrol nor sacct knows how it ended"
    return end


# ------------------------------------------------------------------------------------- the seam
class SlurmCommands(Protocol):
    def sbatch(self, script: Path, args: list[str], env: dict[str, str]) -> str: ...
    def job(self, job_id: str) -> dict[str, str] | None: ...
    def node(self, name: str) -> dict[str, str] | None: ...
    def sacct(self, job_id: str) -> list[dict[str, str]]: ...
    def partition_nodes(self, partition: str | None) -> list[str]: ...
    def scancel(self, job_id: str, signal: str | None = None, full: bool = False) -> None: ...
    def raw(self, argv: list[str]) -> str: ...


SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "NodeList", "Elapsed", "Start", "End")


class _Transient(Exception):
    """A Slurm command that may succeed when tried again (controller busy, socket timeout)."""


class RealSlurm:
    """The Slurm client commands, each with a timeout and bounded retries (tenacity, exponential backoff)."""

    def __init__(self, timeout_s: float = 20.0, retries: int = 3, bin_dir: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.retries = retries
        self.bin_dir = bin_dir

    def _cmd(self, name: str) -> str:
        return str(Path(self.bin_dir) / name) if self.bin_dir else name

    def _run_once(self, argv: list[str], env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, env=env,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as exc:
            raise _Transient(f"{shlex.join(argv)} timed out after {self.timeout_s:.0f}s") from exc
        except OSError as exc:
            raise SlurmError(f"cannot run {argv[0]}: {exc}") from exc

    def _run(self, argv: list[str], env: dict[str, str] | None = None, retry: bool = True,
             ok_codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        def once() -> subprocess.CompletedProcess[str]:
            cp = self._run_once(argv, env)
            if cp.returncode not in ok_codes and retry and TRANSIENT.search(cp.stderr):
                raise _Transient(f"{shlex.join(argv)}: {cp.stderr.strip()[:300]}")
            return cp

        retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(self.retries + 1 if retry else 1),
                                     wait=tenacity.wait_exponential_jitter(multiplier=0.5, max=5.0, jitter=0.5),
                                     retry=tenacity.retry_if_exception_type(_Transient), reraise=True)
        try:
            return retrying(once)
        except _Transient as exc:
            raise SlurmError(str(exc)) from exc

    def sbatch(self, script: Path, args: list[str], env: dict[str, str]) -> str:
        # Not retried: a submission that timed out may have been accepted; a second one would run twice.
        cp = self._run([self._cmd("sbatch"), "--parsable", *args, str(script)], env=env, retry=False)
        if cp.returncode != 0:
            kind = SlurmError if TRANSIENT.search(cp.stderr) else SubmitRefused
            raise kind(f"sbatch refused the job (exit {cp.returncode}): {cp.stderr.strip()[:500]}")
        job_id = cp.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch --parsable printed {cp.stdout.strip()[:200]!r}, not a job id")
        return job_id

    def job(self, job_id: str) -> dict[str, str] | None:
        cp = self._run([self._cmd("scontrol"), "-o", "show", "job", job_id], ok_codes=(0, 1))
        if cp.returncode != 0 or not cp.stdout.strip():
            if "Invalid job id" in cp.stderr:
                return None
            raise SlurmError(f"scontrol show job {job_id}: {cp.stderr.strip()[:300]}")
        return parse_scontrol(cp.stdout.splitlines()[0])

    def node(self, name: str) -> dict[str, str] | None:
        cp = self._run([self._cmd("scontrol"), "-o", "show", "node", name], ok_codes=(0, 1))
        if cp.returncode != 0 or not cp.stdout.strip():
            return None
        return parse_scontrol(cp.stdout.splitlines()[0])

    def sacct(self, job_id: str) -> list[dict[str, str]]:
        cp = self._run([self._cmd("sacct"), "-j", job_id, "--noheader", "--parsable2",
                        f"--format={','.join(SACCT_FIELDS)}"], ok_codes=(0, 1))
        if cp.returncode != 0:
            raise SlurmError(f"sacct -j {job_id}: {cp.stderr.strip()[:300]}")
        return parse_sacct(cp.stdout, SACCT_FIELDS)

    def partition_nodes(self, partition: str | None) -> list[str]:
        argv = [self._cmd("sinfo"), "-h", "-N", "-o", "%N"] + (["-p", partition] if partition else [])
        cp = self._run(argv)
        if cp.returncode != 0:
            raise SlurmError(f"sinfo: {cp.stderr.strip()[:300]}")
        return list(dict.fromkeys(line.strip() for line in cp.stdout.splitlines() if line.strip()))

    def scancel(self, job_id: str, signal: str | None = None, full: bool = False) -> None:
        argv = [self._cmd("scancel")] + ([f"--signal={signal}"] if signal else []) + (["--full"] if full else [])
        cp = self._run([*argv, job_id])
        if cp.returncode != 0 and "already completing or completed" not in cp.stderr \
                and "Invalid job id" not in cp.stderr:
            raise SlurmError(f"{shlex.join([*argv, job_id])}: {cp.stderr.strip()[:300]}")

    def raw(self, argv: list[str]) -> str:
        """A read-only command's output for evidence (`scontrol show job 12`); the error text if it failed."""
        try:
            cp = self._run([self._cmd(argv[0]), *argv[1:]], ok_codes=(0, 1))
        except SlurmError as exc:
            return f"({exc})"
        return (cp.stdout + (f"\n(stderr) {cp.stderr.strip()}" if cp.stderr.strip() else "")).strip()[:8000]


# --------------------------------------------------------------------------------- the batch script
def batch_script(rank_argv: Sequence[str], *, nodes: int, ntasks_per_node: int, mark_path: Path,
                 master_port: int, srun_args: Sequence[str] = ()) -> str:
    """The `sbatch` script of one attempt: sets MASTER_ADDR (the first node's address) and MASTER_PORT,
    `srun`s one task per rank, and on the time-limit signal (USR2, sent `--signal=B:USR2@N` seconds before
    the limit) marks the file and sends SIGTERM to the ranks: their save-and-exit path (a checkpoint, exit 0)."""
    srun = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={ntasks_per_node}", "--kill-on-bad-exit=1",
            "--distribution=block", *srun_args, *rank_argv]
    return f"""#!/bin/bash
# Written by ulyssesd for one attempt (docs/SLURM.md). The daemon watches this job with squeue/scontrol/sacct.
set -u
on_time_limit() {{
    echo "[ulyssesd] time limit near (SIGUSR2): the ranks save and exit"
    : > {shlex.quote(str(mark_path))}
    scancel --signal=TERM "$SLURM_JOB_ID"
}}
trap on_time_limit USR2
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
addr=$(scontrol -o show node "$first" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
export MASTER_ADDR="${{addr:-$first}}"
export MASTER_PORT={int(master_port)}
echo "[ulyssesd] slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST; MASTER_ADDR=$MASTER_ADDR:$MASTER_PORT"
{shlex.join(srun)} &
step=$!
rc=0
while :; do
    wait "$step"; rc=$?
    kill -0 "$step" 2>/dev/null || break  # a trapped signal interrupts wait; the step still runs
done
echo "[ulyssesd] srun exited $rc"
exit "$rc"
"""


def port_for_job(run_id: str, attempt: int, base: int = 29500, span: int = 20000) -> int:
    """A rendezvous port that differs per run and attempt (two attempts on one node never collide)."""
    import zlib

    return base + (zlib.crc32(f"{run_id}:{attempt}".encode()) % span)


# ------------------------------------------------------------------------------ exclusions on disk
def exclusions_path(run_dir: Path) -> Path:
    return run_dir / SLURM_DIR / "exclude.json"


def read_exclusions(run_dir: Path) -> list[str]:
    """The nodes this run lost and excludes from now on ({run_dir}/slurm/exclude.json; [] when none)."""
    import json

    try:
        data = json.loads(exclusions_path(run_dir).read_text())
    except (OSError, ValueError, RecursionError):
        return []
    nodes = data.get("nodes") if isinstance(data, dict) else None
    return [n for n in nodes if isinstance(n, str) and n] if isinstance(nodes, list) else []


def write_exclusions(run_dir: Path, nodes: list[str], why: str) -> None:
    from ulyssesd.daemon.job.config import write_json_atomic

    (run_dir / SLURM_DIR).mkdir(parents=True, exist_ok=True)
    write_json_atomic(exclusions_path(run_dir), {"nodes": nodes, "why": why})


def sbatch_args(slurm: Any, *, job_name: str, nodes: int, ntasks_per_node: int, exclude: Sequence[str],
                log_path: Path, run_dir: Path) -> list[str]:
    """The sbatch options of one submit-mode attempt (the spec's `[slurm]` + the run's exclusions)."""
    args = [f"--job-name={slurm.job_name or job_name}", f"--nodes={nodes}", f"--ntasks-per-node={ntasks_per_node}",
            f"--output={log_path}", "--open-mode=append", f"--chdir={run_dir}", "--no-requeue", "--export=ALL"]
    if slurm.partition:
        args.append(f"--partition={slurm.partition}")
    if slurm.gres:
        args.append(f"--gres={slurm.gres}")
    if slurm.time:
        args += [f"--time={slurm.time}", f"--signal=B:USR2@{slurm.time_limit_signal_s}"]
    if exclude:
        args.append(f"--exclude={','.join(exclude)}")
    return [*args, *slurm.sbatch_args]
