"""The control socket's server: a unix stream socket polled by the single-threaded main loop.

The wire format (one JSON line per request, its bounds, the error codes) is `protocol.py`; who may connect
is `peers.py`; the client is `client.py`. A handler that raises answers `internal` with a short message
(the daemon log has the traceback) and the server goes on. The server never runs a thread: `poll(timeout_s)`
waits for activity (it doubles as the main loop's sleep), reads what is ready without blocking, answers
complete requests and returns. A slow or silent client is cut off after `read_timeout_s`; a flood beyond
`max_connections` gets "busy"; a request past its `deadline` is answered `expired` and never applied.

Access: the socket file is 0660 (the first gate is file permission), and every peer's SO_PEERCRED is
checked (second gate) at accept, before a byte is read: an unauthorized peer gets `permission_denied` and
the connection is never read (half-closed, closed after REFUSED_LINGER_S), so nothing it sends is ever
parsed. The handler gets the validated envelope plus `"peer": {"pid", "uid", "gid"}` so actions can be
attributed.

A socket file deleted under a live daemon (a tmp cleaner, an operator's `rm`) is found by poll() within
SOCKET_CHECK_S and bound again (same mode and group): `ulyssesctl` would otherwise say "not running" for a
live daemon, and pause/stop would be impossible. A path now held by something else is left alone (logged).
"""
from __future__ import annotations

import errno
import grp
import json
import os
import selectors
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.host.logging import get_logger

from .peers import Peer, PeerAuthorizer, peer_credentials
from .protocol import MAX_REQUEST_BYTES, ControlSocketError, error_response, parse_request

REFUSED_LINGER_S = 1.0  # a refused connection stays open (never read) this long, then is closed
SOCKET_CHECK_S = 2.0  # how often poll() checks that the socket file is still there (and rebinds it if not)
_AF_UNIX_MAX = 107  # sizeof(sun_path) - 1 on Linux


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
        self._mode, self._group = mode, group
        self.rebinds = 0  # times the socket file was found gone and bound again
        self._next_check = SYSTEM.monotonic() + SOCKET_CHECK_S
        self._foreign_logged = False
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

    def ensure_bound(self) -> bool:
        """Bind the socket again when its file is gone; True when it was rebound. A path that now holds a
        different file (another daemon's socket, anything else) is not touched: logged once."""
        try:
            ino = os.lstat(self.path).st_ino
        except FileNotFoundError:
            ino = None
        except OSError as exc:
            self._log.warning("cannot check the control socket file", error=str(exc))
            return False
        if ino == self._ino:
            return False
        if ino is not None:
            if not self._foreign_logged:
                self._log.error("the control socket path now holds another file; not replacing it "
                                "(ulyssesctl reaches whatever listens there)")
                self._foreign_logged = True
            return False
        try:
            listener = self._listen(self._mode, self._group)
        except ControlSocketError as exc:
            self._log.error("the control socket file was deleted and cannot be bound again", error=str(exc))
            return False
        self._sel.unregister(self._listener)
        self._listener.close()
        self._listener = listener
        self._ino = os.stat(self.path).st_ino
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self.rebinds += 1
        self._log.warning("the control socket file was deleted; bound it again", rebinds=self.rebinds)
        return True

    # -- the loop's part -------------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> int:
        """Wait up to timeout_s; handle what is ready; return the number of requests answered.

        Returns early once a request was answered or a wakeup arrived, so the loop acts on it promptly.
        The handler runs here, in the main loop: it must only record/enqueue, never block.
        """
        deadline = SYSTEM.monotonic() + max(0.0, timeout_s)
        answered = 0
        if deadline >= self._next_check:
            self._next_check = SYSTEM.monotonic() + SOCKET_CHECK_S
            self.ensure_bound()
        while True:
            now = SYSTEM.monotonic()
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
            self._expire(SYSTEM.monotonic())
            if answered or woken or SYSTEM.monotonic() >= deadline:
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
                self._reply(sock, error_response("permission_denied", refusal), linger=True)
                answered += 1
                continue
            if len(self._conns) >= self.max_connections:
                self._reply(sock, error_response("busy", f"too many concurrent control connections "
                                                 f"(max {self.max_connections}); retry"))
                answered += 1
                continue
            conn = _Conn(sock, peer, SYSTEM.monotonic() + self.read_timeout_s, None)
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
                    return self._finish(conn, error_response("bad_request", f"request exceeds {self.max_request_bytes} bytes"))
                return 0
            line = bytes(conn.buf.split(b"\n", 1)[0])
        else:  # EOF: accept a final request without newline
            if not conn.buf:
                self._drop(conn)
                return 0
            line = bytes(conn.buf)
        if len(line) > self.max_request_bytes:
            return self._finish(conn, error_response("bad_request", f"request exceeds {self.max_request_bytes} bytes"))
        return self._finish(conn, self._answer(conn, line))

    def _answer(self, conn: _Conn, line: bytes) -> dict:
        if conn.refusal is not None:  # authorized at accept; kept as a second check for hand-made conns
            return error_response("permission_denied", conn.refusal)
        request, problem = parse_request(line, self.max_request_bytes)
        if problem is not None:
            return error_response("bad_request", problem)
        assert request is not None
        deadline = request.pop("deadline", None)
        if deadline is not None and SYSTEM.time() > deadline:
            late = SYSTEM.time() - deadline
            self._log.warning("control request expired; not applied", cmd=request["cmd"], late_s=round(late, 3),
                              uid=conn.peer.uid)
            return error_response("expired", f"{request['cmd']!r} reached the daemon {late:.1f} s after its deadline "
                                     f"(the client had stopped waiting); not applied")
        request["peer"] = {"pid": conn.peer.pid, "uid": conn.peer.uid, "gid": conn.peer.gid}
        try:
            response = self.handler(request)
        except Exception as exc:  # the handler's bug must not take the main loop down
            self._log.exception("control handler failed", cmd=request["cmd"])
            # No exception text to the client (paths, internals); the daemon log has the traceback.
            return error_response("internal", f"internal error handling {request['cmd']!r} ({type(exc).__name__}); "
                                      f"see the daemon log")
        if not isinstance(response, dict):
            return error_response("internal", f"handler returned {type(response).__name__}, not a JSON object")
        response.setdefault("ok", True)
        return response

    def _expire(self, now: float) -> None:
        while self._lingering and self._lingering[0][0] <= now:
            self._lingering.pop(0)[1].close()
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self._finish(conn, error_response("timeout", f"no complete request within {self.read_timeout_s:g} s "
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
            data = (json.dumps(error_response("internal", f"response not serialisable: {exc}")) + "\n").encode()
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
        self._lingering.append((SYSTEM.monotonic() + REFUSED_LINGER_S, sock))
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
