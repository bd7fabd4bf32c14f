"""The control socket's client (what ulyssesctl calls): one request, one answer, bounded in time."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from ulyssesd.daemon.clock import SYSTEM

from .protocol import (
    ANSWER_GRACE_S,
    ControlPermissionError,
    ControlProtocolError,
    ControlTimeout,
    DaemonNotRunning,
)


def send_request(path: str | os.PathLike, payload: dict[str, Any], timeout_s: float = 5.0,
                 with_deadline: bool = False) -> dict:
    """Send one request, return the daemon's JSON response (ok true or false). Raises ControlError subclasses.

    with_deadline: stamp the request with `deadline` = now + timeout_s (for mutating commands). The daemon
    refuses it (`expired`) if it handles it later, and this client waits for the answer until the deadline
    plus ANSWER_GRACE_S, so "timed out" here means "was not and will not be applied". Without it,
    `timeout_s` bounds each socket operation.
    """
    path = str(path)
    if with_deadline:
        deadline = SYSTEM.time() + timeout_s
        payload = {**payload, "deadline": deadline}
        give_up = SYSTEM.monotonic() + timeout_s + ANSWER_GRACE_S
    else:
        give_up = None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    not_applied = " (it carried a deadline: the daemon will not apply it later)" if with_deadline else ""
    try:
        try:
            sock.connect(path)
        except FileNotFoundError as exc:
            raise DaemonNotRunning(f"ulyssesd is not running: no control socket at {path}") from exc
        except ConnectionRefusedError as exc:
            raise DaemonNotRunning(f"ulyssesd is not running: nothing is listening on {path} (stale socket)") from exc
        except PermissionError as exc:
            raise ControlPermissionError(f"permission denied connecting to {path}: run as root or as a member "
                                         f"of the socket's group (ls -l {path})") from exc
        except TimeoutError as exc:
            raise ControlTimeout(f"ulyssesd did not accept a connection on {path} within {timeout_s:g} s"
                                 f"{not_applied}") from exc
        data = (json.dumps(payload) + "\n").encode()
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may already have answered (e.g. refused) and closed; read what it said
        except TimeoutError as exc:
            raise ControlTimeout(f"ulyssesd did not read the request within {timeout_s:g} s{not_applied}") from exc
        buf = bytearray()
        waited = timeout_s + ANSWER_GRACE_S if give_up is not None else timeout_s
        try:
            while b"\n" not in buf:
                if give_up is not None:
                    left = give_up - SYSTEM.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except TimeoutError as exc:
            raise ControlTimeout(f"ulyssesd did not answer within {waited:g} s (main loop busy, hung or "
                                 f"stopped?){not_applied}") from exc
        except ConnectionResetError:
            pass
    finally:
        sock.close()
    line = bytes(buf).split(b"\n", 1)[0]
    if not line:
        raise ControlProtocolError(f"ulyssesd closed the connection on {path} without an answer")
    try:
        response = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ControlProtocolError(f"ulyssesd answered something that is not JSON: {line[:200]!r}") from exc
    if not isinstance(response, dict):
        raise ControlProtocolError(f"ulyssesd answered a {type(response).__name__}, not a JSON object")
    return response
