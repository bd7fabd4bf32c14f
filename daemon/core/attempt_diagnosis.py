"""One diagnosis per attempt, the same in the daemon and in `ulyssesctl diagnose`.

The daemon diagnoses an ended attempt from its log tail, its exit status and the host's OOM evidence, and
records all of it next to the attempt's exit file (`<run_dir>/attempts/<N>.diagnosis.json`). `ulyssesctl
diagnose <run_dir>/logs/attempt-<N>.log` finds that record and diagnoses with the same inputs through the same
function, so both say the same label, confidence and reason; an attempt the hang path ended carries the
stack-dump diagnosis the daemon acted on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ulyssesd.remediation.diagnosis import Diagnosis, diagnose, refine_with_host

_ATTEMPT_LOG = re.compile(r"^attempt-(\d+)\.log$")
MAX_RECORD_BYTES = 256 * 1024  # a record is small; anything bigger is not ours


def diagnose_attempt(tail: str, returncode: int | None, signal: int | None, host: dict[str, Any] | None) -> Diagnosis:
    """The attempt's diagnosis: the log tail + exit status, sharpened by the host's OOM evidence when known."""
    rc = returncode if returncode is not None else (-signal if signal else None)
    d = diagnose(tail, rc, signal)
    if host:
        d = refine_with_host(d, host.get("oom_kills"), host.get("kernel_lines"))
    return d


def record_path(run_dir: Path, attempt: int) -> Path:
    return run_dir / "attempts" / f"{attempt}.diagnosis.json"


def record_for_log(log: Path) -> Path | None:
    """`<run_dir>/logs/attempt-N.log` -> `<run_dir>/attempts/N.diagnosis.json` (None for any other file)."""
    m = _ATTEMPT_LOG.match(log.name)
    if not m or log.parent.name != "logs":
        return None
    return record_path(log.parent.parent, int(m.group(1)))


def write_record(path: Path, d: Diagnosis, returncode: int | None, signal: int | None,
                 host: dict[str, Any] | None, decided_by: str) -> None:
    """Write atomically (tmp + rename); a failed write is not fatal to crash handling."""
    data = {"diagnosis": d.to_dict(), "returncode": returncode, "signal": signal, "host": host,
            "decided_by": decided_by}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass


class RecordError(ValueError):
    """The attempt's diagnosis record exists but is not one; the message names the file and the problem."""


def read_record(path: Path) -> dict[str, Any] | None:
    """The record, None when there is none; RecordError when it is unreadable or malformed."""
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise RecordError(f"diagnosis record {path} is larger than {MAX_RECORD_BYTES} bytes")
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RecordError(f"diagnosis record {path} cannot be read: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("diagnosis"), dict) or "label" not in data["diagnosis"]:
        raise RecordError(f"diagnosis record {path} has no diagnosis")
    return data


def from_record(data: dict[str, Any], tail: str) -> tuple[Diagnosis, str]:
    """The diagnosis the daemon decided for this attempt, and how: recomputed from the recorded inputs when
    the log decided it, as recorded when the hang path's stack dumps did."""
    if data.get("decided_by") == "log":
        return diagnose_attempt(tail, data.get("returncode"), data.get("signal"), data.get("host")), "log"
    rec = data["diagnosis"]
    return Diagnosis(rec["label"], list(rec.get("evidence") or []), rec.get("confidence", "high"),
                     rec.get("reason", ""), list(rec.get("secondary") or [])), str(data.get("decided_by"))
