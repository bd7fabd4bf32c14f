"""The control socket's wire format: the request envelope, its bounds, the error answers, the errors.

Protocol (one request per connection, newline-delimited JSON, at most `MAX_REQUEST_BYTES`):

    request   {"cmd": "pause", "args": {...}, "deadline": 1764444454.2}\\n   ("args", "v": 1, "deadline" optional)
    response  {"ok": true, ...}\\n   or   {"ok": false, "code": "...", "error": "..."}\\n

`code` is one of bad_request, permission_denied, expired, busy, timeout, internal, or the handler's own
(unknown_command, bad_state, not_found). `deadline` (epoch seconds, sent by ulyssesctl with every mutating
request) is the time after which the client no longer waits: a request handled later (the daemon was
SIGSTOPped or busy) is answered `expired` and never applied, so an operator told "timed out" is never
surprised by a pause carried out minutes later. The client waits `ANSWER_GRACE_S` past the deadline, so an
answer the daemon sent just before it still arrives. Bounds: a request is at most `MAX_REQUEST_BYTES` and
nests at most `MAX_REQUEST_DEPTH` levels.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ulyssesd.remediation.records import bounded_repr, nesting_depth_exceeds

MAX_REQUEST_BYTES = 64 * 1024
MAX_REQUEST_DEPTH = 8  # requests are {"cmd", "args": {flat values}}: 2 levels; deep JSON recurses in json
ANSWER_GRACE_S = 2.0  # the client waits this long past the request's deadline for the answer
CMD_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class ControlError(Exception):
    """Base of everything the control socket raises."""


class ControlSocketError(ControlError):
    """The server cannot listen (path taken, another daemon, bad path)."""


class DaemonNotRunning(ControlError):
    """Nothing listens on the control socket."""


class ControlPermissionError(ControlError):
    """The socket exists but this user may not connect to it."""


class ControlTimeout(ControlError):
    """The daemon accepted but did not answer in time (main loop busy or hung)."""


class ControlProtocolError(ControlError):
    """The daemon answered something that is not one JSON object."""


def parse_request(line: bytes, max_bytes: int = MAX_REQUEST_BYTES) -> tuple[dict | None, str | None]:
    """(request, None) for a valid envelope, else (partial-or-None, problem). Never raises: the problem names
    what is wrong (and shows values through a bounded repr)."""
    if len(line) > max_bytes:
        return None, f"request exceeds {max_bytes} bytes"
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"request is not valid JSON: {exc}"
    except RecursionError:
        return None, f"request nests deeper than {MAX_REQUEST_DEPTH} levels"
    except ValueError as exc:  # e.g. an integer beyond Python's digit limit
        return None, f"request is not valid JSON: {bounded_repr(str(exc))}"
    if nesting_depth_exceeds(obj, MAX_REQUEST_DEPTH):
        return None, f"request nests deeper than {MAX_REQUEST_DEPTH} levels"
    if not isinstance(obj, dict):
        return None, f"request must be a JSON object like {{\"cmd\": \"status\"}}, got {type(obj).__name__}"
    unknown = sorted(set(obj) - {"cmd", "args", "v", "deadline"})
    if unknown:
        return obj, f"unknown request key(s) {bounded_repr(unknown)}; allowed: cmd, args, v, deadline"
    cmd = obj.get("cmd")
    if not isinstance(cmd, str) or not CMD_RE.match(cmd):
        return obj, f"'cmd' must be a lowercase command name like \"status\", got {bounded_repr(cmd)}"
    args = obj.get("args", {})
    if not isinstance(args, dict):
        return obj, f"'args' must be a JSON object, got {type(args).__name__}"
    v = obj.get("v", 1)
    if type(v) is not int or v != 1:
        return obj, f"unsupported protocol version {bounded_repr(v)}; this daemon speaks v=1"
    request: dict[str, Any] = {"cmd": cmd, "args": args}
    if obj.get("deadline") is not None:
        deadline = _epoch_seconds(obj["deadline"])
        if deadline is None:
            return obj, f"'deadline' must be epoch seconds (a finite number), got {bounded_repr(obj['deadline'])}"
        request["deadline"] = deadline
    return request, None


def _epoch_seconds(val: Any) -> float | None:
    """A finite float from a JSON number, else None (bools, strings, huge ints that overflow a float)."""
    if isinstance(val, bool) or not isinstance(val, int | float):
        return None
    try:
        f = float(val)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def error_response(code: str, message: str) -> dict:
    """The answer of a refused or failed request: `{"ok": false, "code", "error"}`."""
    return {"ok": False, "code": code, "error": message}


