"""Re-derivation: bring the store's view of a run up to what its run directory holds (config versions,
checkpoints from their manifests, attempts from logs and exit files, a live job found by its environment
marker, the telemetry cursor at the end of the last complete line)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..repository.store import Store

TELEMETRY_TAIL_BYTES = 1 << 20
_ATTEMPT_LOG = re.compile(r"attempt-(\d+)\.log$")
_ATTEMPT_EXIT = re.compile(r"(\d+)\.exit$")
_CONFIG = re.compile(r"v(\d+)\.json$")


def _numbers(d: Path, pattern: re.Pattern[str]) -> set[int]:
    if not d.is_dir():
        return set()
    return {int(m.group(1)) for p in d.iterdir() if (m := pattern.match(p.name))}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes()[: 16 << 20])
    except (OSError, ValueError, RecursionError):
        return None


def _telemetry_tail(path: Path) -> tuple[int, int, bytes] | None:
    """(inode, offset where the tail starts, the file's last TELEMETRY_TAIL_BYTES up to its size when
    opened), or None when it cannot be read."""
    try:
        with path.open("rb") as fh:
            st = os.fstat(fh.fileno())
            start = max(0, st.st_size - TELEMETRY_TAIL_BYTES)
            fh.seek(start)
            return st.st_ino, start, fh.read(st.st_size - start)
    except OSError:
        return None


def _records_newest_first(lines: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects among `lines`, last line first; other lines (torn, garbage, too deep) skipped."""
    for line in lines.splitlines()[::-1]:
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            yield rec


def telemetry_end(path: Path) -> tuple[int, int, int | None] | None:
    """(inode, offset just after the last complete line, last step seen in the file's last MiB)."""
    got = _telemetry_tail(path)
    if got is None:
        return None
    inode, start, tail = got
    end = tail.rfind(b"\n")
    if end < 0:
        return inode, start, None
    last_step = None
    for rec in _records_newest_first(tail[: end + 1]):
        step = rec.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 1 << 62:
            last_step = step
            break
    return inode, start + end + 1, last_step


def _last_exiting_reason(path: Path) -> str | None:
    """`reason` of the last `exiting` event in the telemetry file's last MiB."""
    got = _telemetry_tail(path)
    for rec in _records_newest_first(got[2] if got else b""):
        if rec.get("event") == "exiting":
            reason = rec.get("reason")
            return reason if isinstance(reason, str) else None
    return None


#: The wrapper's module path now, and before daemon/ had sub-packages: a job launched by an older daemon is
#: still found (and re-adopted) after an upgrade.
JOB_WRAPPER_MODULES = ("ulyssesd.daemon.job.wrapper", "ulyssesd.daemon.job_wrapper")


def find_live_job(run_id: str, run_dir: Path, attempt: int) -> tuple[int, float] | None:
    """(pid, create_time) of the attempt's job wrapper if it still runs (found by its environment marker)."""
    import psutil

    from ulyssesd.daemon.job.launcher import job_marker

    key, value = job_marker(run_id, run_dir, attempt)
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or ())
            if not any(module in cmdline for module in JOB_WRAPPER_MODULES):
                continue
            if proc.environ().get(key) == value:
                return proc.info["pid"], proc.info["create_time"]
        except (psutil.Error, OSError):
            continue
    return None


def rederive_run(store: Store, run_id: str, run_dir: Path, *, ckpt_dir: Path | None = None,
                 telemetry: Path | None = None) -> dict[str, Any]:
    """Bring the store's view of one run up to what its run directory holds; returns what was added."""
    from ulyssesd.daemon.host.process import read_exit_file
    from ulyssesd.training import checkpoint as ck

    got: dict[str, Any] = {"config_versions": [], "checkpoints": [], "attempts": [], "telemetry_cursor": None}
    known_cv = {c.version for c in store.list_config_versions(run_id)}
    for v in sorted(_numbers(run_dir / "configs", _CONFIG) - known_cv):
        cfg = _read_json(run_dir / "configs" / f"v{v}.json")
        if isinstance(cfg, dict):
            store.add_config_version(run_id, {**cfg, "launcher": {"env": {}}}, version=v,
                                     parent_version=v - 1 if v > 1 else None, make_current=True,
                                     reason="re-derived from the run directory (store recovery)")
            got["config_versions"].append(v)
    ckpt_dir = ckpt_dir or run_dir / "checkpoints"
    known_ck = {c.tag for c in store.list_checkpoints(run_id, include_pruned=True)}
    for tag in ck.list_tags(ckpt_dir):
        if tag in known_ck:
            continue
        ok, why = ck.validate_tag(ckpt_dir / tag, verify_checksums=False)
        try:
            man = ck.read_manifest(ckpt_dir / tag)
        except ck.ManifestError:
            man = {}
        loss = man.get("loss")
        store.upsert_checkpoint(run_id, tag, int(man.get("step", ck.step_of_tag(tag) or 0)),
                                loss=loss if isinstance(loss, int | float) else None, valid=ok,
                                invalid_reason=None if ok else why)
        got["checkpoints"].append(tag)
    atts = {a.number: a for a in store.list_attempts(run_id)}
    on_disk = _numbers(run_dir / "logs", _ATTEMPT_LOG) | _numbers(run_dir / "attempts", _ATTEMPT_EXIT)
    last = max(on_disk | set(atts), default=0)
    got["live_job"] = None
    for n in sorted(on_disk | set(atts)):
        a = atts.get(n)
        if a is not None and (a.ended_at is not None or n == last):
            continue  # known; the last attempt's exit is noticed by the daemon's normal exit path
        st = read_exit_file(run_dir / "attempts" / f"{n}.exit")
        live = find_live_job(run_id, run_dir, n) if n == last and st is None else None
        if a is None:
            store.add_attempt(run_id, number=n, command=["(re-derived from the run directory)"],
                              pid=live[0] if live else None, pgid=live[0] if live else None,
                              proc_start_time=live[1] if live else None)
            got["attempts"].append(n)
        if live is not None:
            got["live_job"] = {"attempt": n, "pid": live[0]}
        else:  # an earlier attempt the store thought live, or one that ended while the store was damaged
            store.end_attempt(run_id, n, returncode=st.returncode if st else None, signal=st.signal if st else None,
                              diagnosis=None if st else "unknown (ended while the store was damaged)")
    tel = telemetry or run_dir / "telemetry.jsonl"
    end = telemetry_end(tel)
    cur = store.get_telemetry_cursor(run_id)
    if end is not None and (cur is None or cur.inode != end[0] or cur.offset < end[1]):
        store.set_telemetry_cursor(run_id, path=str(tel), inode=end[0], offset=end[1], last_step=end[2])
        got["telemetry_cursor"] = {"offset": end[1], "last_step": end[2],
                                   "was": None if cur is None else {"offset": cur.offset, "last_step": cur.last_step}}
    got["last_attempt"] = last
    # The run had ended COMPLETED: its last attempt exited 0 after saying so (an adopted run is not relaunched).
    st_last = read_exit_file(run_dir / "attempts" / f"{last}.exit") if last else None
    got["completed"] = bool(st_last is not None and st_last.returncode == 0 and end is not None
                            and _last_exiting_reason(tel) == "completed")
    got["last_step"] = end[2] if end else (cur.last_step if cur else None)
    return got
