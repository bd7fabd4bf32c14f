"""The control socket: a unix stream server polled by the main loop, and its client.

Protocol (one request per connection, newline-delimited JSON, at most `max_request_bytes`):

    request   {"cmd": "pause", "args": {...}, "deadline": 1764444454.2}\\n   ("args", "v": 1, "deadline" optional)
    response  {"ok": true, ...}\\n   or   {"ok": false, "code": "...", "error": "..."}\\n

`code` is one of bad_request, permission_denied, expired, busy, timeout, internal, or the handler's own
(unknown_command, bad_state, not_found). `deadline` (epoch seconds, sent by ulyssesctl with every mutating
request) is the time after which the client no longer waits: a request handled later (the daemon was
SIGSTOPped or busy) is answered `expired` and never applied, so an operator told "timed out" is never
surprised by a pause carried out minutes later. The client waits `ANSWER_GRACE_S` past the deadline, so an
answer the daemon sent just before it still arrives. Bounds: a request is at most `max_request_bytes` and
nests at most `MAX_REQUEST_DEPTH` levels. A handler that raises answers `internal` with a short message (the
daemon log has the traceback) and the server goes on. The server never runs a thread: `poll(timeout_s)` waits for activity (it doubles as the main
loop's sleep), reads what is ready without blocking, answers complete requests and returns. A slow or
silent client is cut off after `read_timeout_s`; a flood beyond `max_connections` gets "busy".

Access: the socket file is 0660 (the first gate is file permission), and every peer's SO_PEERCRED is
checked (second gate) at accept, before a byte is read: an unauthorized peer gets `permission_denied` and the
connection is never read (half-closed, closed after REFUSED_LINGER_S), so nothing it sends is ever parsed. Root, the daemon's own uid, `allowed_uids`,
or members of `group` (primary or supplementary, via pwd/grp/os.getgrouplist) may talk to it. The handler gets the validated envelope plus
`"peer": {"pid", "uid", "gid"}` so actions can be attributed.
"""

from __future__ import annotations

import errno
import grp
import json
import math
import os
import pwd
import re
import selectors
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.remediation.records import bounded_repr, nesting_depth_exceeds

MAX_REQUEST_BYTES = 64 * 1024
MAX_REQUEST_DEPTH = 8  # requests are {"cmd", "args": {flat values}}: 2 levels; deep JSON recurses in json
ANSWER_GRACE_S = 2.0  # the client waits this long past the request's deadline for the answer
REFUSED_LINGER_S = 1.0  # a refused connection stays open (never read) this long, then is closed
DEFAULT_SOCKET_NAME = "ulyssesd.sock"
SYSTEM_SOCKET_PATH = "/run/ulyssesd/ulyssesd.sock"  # RuntimeDirectory of the packaged unit
_CMD_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
_AF_UNIX_MAX = 107  # sizeof(sun_path) - 1 on Linux


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


def resolve_socket_path(state_dir: str | os.PathLike | None = None, explicit: str | os.PathLike | None = None) -> Path:
    """Where the daemon listens: explicit (spec's daemon.socket_path) > $ULYSSESD_SOCKET (set by the unit)
    > {state_dir}/ulyssesd.sock > /run/ulyssesd/ulyssesd.sock."""
    if explicit:
        return Path(explicit)
    if os.environ.get("ULYSSESD_SOCKET"):
        return Path(os.environ["ULYSSESD_SOCKET"])
    if state_dir is not None:
        return Path(state_dir) / DEFAULT_SOCKET_NAME
    return Path(SYSTEM_SOCKET_PATH)


def find_socket_path(state_dir: str | os.PathLike | None = None, explicit: str | os.PathLike | None = None) -> Path:
    """Where a client (ulyssesctl) should connect: `resolve_socket_path`, except that when that socket does
    not exist but the packaged unit's /run/ulyssesd/ulyssesd.sock does, that one (the unit sets
    ULYSSESD_SOCKET for the daemon only, so `ulyssesctl --state-dir /var/lib/ulyssesd` still finds it)."""
    path = resolve_socket_path(state_dir, explicit)
    if not explicit and not os.environ.get("ULYSSESD_SOCKET") and not path.exists():
        system = Path(SYSTEM_SOCKET_PATH)
        if system.exists():
            return system
    return path


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_credentials(conn: socket.socket) -> Peer:
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Peer(pid, uid, gid)


class PeerAuthorizer:
    """root, our own uid, `allowed_uids`, or members of `group` (None/missing group: nobody by group)."""

    def __init__(self, group: str | None = "ulyssesd", allowed_uids: set[int] | None = None) -> None:
        self.group = group
        self.allowed_uids = set(allowed_uids or ())
        self.gid: int | None = None
        if group:
            try:
                self.gid = grp.getgrnam(group).gr_gid
            except KeyError:
                get_logger("ulyssesd.control").warning(
                    "control socket group does not exist; only root and the daemon's uid may connect",
                    group=group)

    def __call__(self, peer: Peer) -> str | None:
        """None if allowed, else the reason to refuse."""
        if peer.uid == 0 or peer.uid == os.geteuid() or peer.uid in self.allowed_uids:
            return None
        if self.gid is not None and (peer.gid == self.gid or self.gid in _groups_of(peer.uid)):
            return None
        who = f"group {self.group}" if self.group else "the allowed uids"
        return f"permission denied: uid {peer.uid} is not root or in {who}"


def _groups_of(uid: int) -> set[int]:
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:  # uid without a passwd entry: only its peer gid counts
        return set()
    return set(os.getgrouplist(pw.pw_name, pw.pw_gid))


@dataclass
class _Conn:
    sock: socket.socket
    peer: Peer
    deadline: float
    refusal: str | None
    buf: bytearray = field(default_factory=bytearray)


class ControlServer:
    """Unix-socket request server for the single-threaded main loop (see module doc)."""

    def __init__(self, path: str | os.PathLike, handler: Callable[[dict], dict], group: str | None = "ulyssesd",
                 allowed_uids: set[int] | None = None, mode: int = 0o660,
                 authorize: Callable[[Peer], str | None] | None = None,
                 max_request_bytes: int = MAX_REQUEST_BYTES, read_timeout_s: float = 2.0,
                 max_connections: int = 16) -> None:
        self.path = Path(path)
        self.handler = handler
        self.authorize = authorize or PeerAuthorizer(group, allowed_uids)
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._log = get_logger("ulyssesd.control", socket=str(self.path))
        self._conns: dict[int, _Conn] = {}
        self.refused = 0  # connections refused by the authorizer since start
        self._lingering: list[tuple[float, socket.socket]] = []  # refused, answered, closed at this deadline
        self._sel = selectors.DefaultSelector()
        self._listener = self._listen(mode, group)
        self._ino = os.stat(self.path).st_ino
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        # Self-pipe: `wakeup()` or signal.set_wakeup_fd(server.wakeup_fileno) ends a poll() early.
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    # -- setup -----------------------------------------------------------------------------------------
    def _listen(self, mode: int, group: str | None) -> socket.socket:
        raw = os.fsencode(self.path)
        if len(raw) > _AF_UNIX_MAX:
            raise ControlSocketError(f"control socket path {self.path} is {len(raw)} bytes; AF_UNIX allows at "
                                     f"most {_AF_UNIX_MAX} (choose a shorter daemon.socket_path)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(self.path))
            # chmod/chown before listen(): until listen() nobody can connect, so there is no window
            # in which the socket is reachable with the umask's mode.
            os.chmod(self.path, mode)
            self._chgrp(group)
            sock.listen(64)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise ControlSocketError(f"cannot listen on control socket {self.path}: {exc}") from exc
        return sock

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSocketError(f"{self.path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            self._log.info("removing stale control socket (no listener)")
            self.path.unlink(missing_ok=True)
            return
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.ETIMEDOUT):  # backlog full: someone is listening
                raise ControlSocketError(f"another ulyssesd is listening on {self.path}") from exc
            raise ControlSocketError(f"cannot probe existing control socket {self.path}: {exc}") from exc
        finally:
            probe.close()
        raise ControlSocketError(f"another ulyssesd is listening on {self.path}")

    def _chgrp(self, group: str | None) -> None:
        if not group:
            return
        try:
            gid = grp.getgrnam(group).gr_gid
            if os.stat(self.path).st_gid != gid:  # under the unit (Group=ulyssesd) it already is
                os.chown(self.path, -1, gid)
        except KeyError:
            pass  # PeerAuthorizer already warned
        except PermissionError:  # not root and not a member: the socket keeps our primary group
            self._log.warning("cannot give the control socket to its group", group=group)

    @property
    def wakeup_fileno(self) -> int:
        """Write end of the self-pipe, for signal.set_wakeup_fd(): signals then end poll() at once.
        Call signal.set_wakeup_fd(-1) before close(), or signals would write to a closed (reused) fd."""
        return self._wake_w

    def wakeup(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # pipe full: a wakeup is already pending

    # -- the loop's part -------------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> int:
        """Wait up to timeout_s; handle what is ready; return the number of requests answered.

        Returns early once a request was answered or a wakeup arrived, so the loop acts on it promptly.
        The handler runs here, in the main loop: it must only record/enqueue, never block.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        answered = 0
        while True:
            now = time.monotonic()
            wait = max(0.0, deadline - now)
            if self._conns:
                wait = min(wait, max(0.0, min(c.deadline for c in self._conns.values()) - now))
            woken = False
            for key, _ in self._sel.select(wait):
                if key.data == "accept":
                    answered += self._accept()
                elif key.data == "wake":
                    woken = True
                    try:
                        while os.read(self._wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    answered += self._read(key.data)
            self._expire(time.monotonic())
            if answered or woken or time.monotonic() >= deadline:
                return answered

    def _accept(self) -> int:
        """Accept what is pending; return how many connections were answered at once (refused, busy)."""
        answered = 0
        for _ in range(self.max_connections):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return answered
            sock.setblocking(False)
            try:
                peer = peer_credentials(sock)
            except OSError as exc:
                self._log.warning("cannot read peer credentials; dropping connection", error=str(exc))
                sock.close()
                continue
            refusal = self._authorize(peer)
            if refusal is not None:  # before reading: an unauthorized peer's bytes are never parsed
                self.refused += 1
                if self.refused <= 5 or self.refused % 100 == 0:  # a connection flood must not flood the log
                    self._log.warning("control connection refused", uid=peer.uid, pid=peer.pid, reason=refusal,
                                      refused_so_far=self.refused)
                self._reply(sock, _error("permission_denied", refusal), linger=True)
                answered += 1
                continue
            if len(self._conns) >= self.max_connections:
                self._reply(sock, _error("busy", f"too many concurrent control connections "
                                                 f"(max {self.max_connections}); retry"))
                answered += 1
                continue
            conn = _Conn(sock, peer, time.monotonic() + self.read_timeout_s, None)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
        return answered

    def _authorize(self, peer: Peer) -> str | None:
        try:
            return self.authorize(peer)
        except Exception as exc:  # noqa: BLE001 - a failing lookup (NSS, LDAP) refuses, it does not crash
            self._log.exception("peer authorization failed", uid=peer.uid)
            return f"permission denied: cannot check uid {peer.uid} ({type(exc).__name__})"

    def _read(self, conn: _Conn) -> int:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            chunk = b""
            conn.buf.clear()
        if chunk:
            conn.buf += chunk
            if b"\n" not in conn.buf:
                if len(conn.buf) > self.max_request_bytes:
                    return self._finish(conn, _error("bad_request", f"request exceeds {self.max_request_bytes} bytes"))
                return 0
            line = bytes(conn.buf.split(b"\n", 1)[0])
        else:  # EOF: accept a final request without newline
            if not conn.buf:
                self._drop(conn)
                return 0
            line = bytes(conn.buf)
        if len(line) > self.max_request_bytes:
            return self._finish(conn, _error("bad_request", f"request exceeds {self.max_request_bytes} bytes"))
        return self._finish(conn, self._answer(conn, line))

    def _answer(self, conn: _Conn, line: bytes) -> dict:
        if conn.refusal is not None:  # authorized at accept; kept as a second check for hand-made conns
            return _error("permission_denied", conn.refusal)
        request, problem = parse_request(line, self.max_request_bytes)
        if problem is not None:
            return _error("bad_request", problem)
        assert request is not None
        deadline = request.pop("deadline", None)
        if deadline is not None and time.time() > deadline:
            late = time.time() - deadline
            self._log.warning("control request expired; not applied", cmd=request["cmd"], late_s=round(late, 3),
                              uid=conn.peer.uid)
            return _error("expired", f"{request['cmd']!r} reached the daemon {late:.1f} s after its deadline "
                                     f"(the client had stopped waiting); not applied")
        request["peer"] = {"pid": conn.peer.pid, "uid": conn.peer.uid, "gid": conn.peer.gid}
        try:
            response = self.handler(request)
        except Exception as exc:  # the handler's bug must not take the main loop down
            self._log.exception("control handler failed", cmd=request["cmd"])
            # No exception text to the client (paths, internals); the daemon log has the traceback.
            return _error("internal", f"internal error handling {request['cmd']!r} ({type(exc).__name__}); "
                                      f"see the daemon log")
        if not isinstance(response, dict):
            return _error("internal", f"handler returned {type(response).__name__}, not a JSON object")
        response.setdefault("ok", True)
        return response

    def _expire(self, now: float) -> None:
        while self._lingering and self._lingering[0][0] <= now:
            self._lingering.pop(0)[1].close()
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self._finish(conn, _error("timeout", f"no complete request within {self.read_timeout_s:g} s "
                                                 f"(send one JSON object followed by a newline)"))

    def _finish(self, conn: _Conn, response: dict) -> int:
        self._sel.unregister(conn.sock)
        self._conns.pop(conn.sock.fileno(), None)
        self._reply(conn.sock, response)
        return 1

    def _reply(self, sock: socket.socket, response: dict, linger: bool = False) -> None:
        """Send `response` and close. linger: half-close and keep the socket open (unread) for REFUSED_LINGER_S,
        so a client still sending its request gets the answer instead of EPIPE; its bytes are never read."""
        try:
            data = (json.dumps(response, default=str) + "\n").encode()
        except (TypeError, ValueError) as exc:
            data = (json.dumps(_error("internal", f"response not serialisable: {exc}")) + "\n").encode()
        try:
            sock.settimeout(1.0)  # responses are small; a client that does not read is its problem
            sock.sendall(data)
            if linger:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            linger = False
        if not linger:
            sock.close()
            return
        self._lingering.append((time.monotonic() + REFUSED_LINGER_S, sock))
        while len(self._lingering) > self.max_connections:  # bounded: the oldest goes first
            self._lingering.pop(0)[1].close()

    def _drop(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        self._conns.pop(conn.sock.fileno(), None)
        conn.sock.close()

    def close(self) -> None:
        """Close everything; unlink the socket only if it is still ours (not a newer daemon's)."""
        for conn in list(self._conns.values()):
            self._drop(conn)
        for _, sock in self._lingering:
            sock.close()
        self._lingering.clear()
        try:
            if os.stat(self.path).st_ino == self._ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        self._sel.close()
        self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    if not isinstance(cmd, str) or not _CMD_RE.match(cmd):
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


def _error(code: str, message: str) -> dict:
    return {"ok": False, "code": code, "error": message}


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
        deadline = time.time() + timeout_s
        payload = {**payload, "deadline": deadline}
        give_up = time.monotonic() + timeout_s + ANSWER_GRACE_S
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
                    left = give_up - time.monotonic()
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
