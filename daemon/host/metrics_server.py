"""A bounded HTTP server for the Prometheus endpoint: one accept thread and a small fixed worker pool.

prometheus_client's own server starts one thread per connection with no timeout: 3,000 slow connections to
the port made 2,920 threads inside the daemon. Here the thread count is fixed (`workers` + 1), at most
`max_connections` connections are open at once (the next one is closed unanswered at accept), and each
connection has `request_timeout_s` in total to send its request line and headers (a client sending one byte
every few seconds is cut off like a silent one). Only `GET /metrics` (and `/`) is served; a request's head is
read up to `max_request_bytes`.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.host.logging import get_logger

log = get_logger("ulyssesd.metrics")


@dataclass(frozen=True)
class MetricsServerConfig:
    """Bounds of the metrics endpoint."""

    workers: int = 4
    """Threads answering requests (a scrape takes milliseconds)."""
    max_connections: int = 64
    """Connections open at once (being read, answered or queued for a worker); more are closed at accept."""
    request_timeout_s: float = 5.0
    """Time a connection has, in total, to send its request head; then it is closed."""
    max_request_bytes: int = 8192
    """Longest request head read; a longer one gets 431."""


class MetricsServer:
    """Serve `render()` (the exposition bytes) on host:port. `shutdown()` + `server_close()` stop it."""

    def __init__(self, host: str, port: int, render: Callable[[], bytes],
                 config: MetricsServerConfig | None = None) -> None:
        self.config = config or MetricsServerConfig()
        self.render = render
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(0.5)  # the accept loop checks for shutdown this often
        self._open = threading.BoundedSemaphore(self.config.max_connections)
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="ulyssesd-metrics")
        self._stop = threading.Event()
        self.refused = 0  # connections closed at accept because max_connections were open
        self._thread = threading.Thread(target=self._accept_loop, name="ulyssesd-metrics-accept", daemon=True)
        self._thread.start()

    @property
    def server_address(self) -> tuple[str, int]:
        return self._sock.getsockname()[:2]

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                SYSTEM.sleep(0.05)  # EMFILE and the like: back off instead of spinning
                continue
            if not self._open.acquire(blocking=False):
                self.refused += 1
                if self.refused <= 5 or self.refused % 1000 == 0:
                    log.warning("metrics connection refused: too many open", max=self.config.max_connections,
                                refused_so_far=self.refused)
                conn.close()
                continue
            try:
                self._pool.submit(self._serve, conn, SYSTEM.monotonic() + self.config.request_timeout_s)
            except RuntimeError:  # the pool is shut down
                self._open.release()
                conn.close()
                return

    def _serve(self, conn: socket.socket, deadline: float) -> None:
        try:
            head = self._read_head(conn, deadline)
            if head is None:
                return
            if head == b"":
                self._reply(conn, deadline, 431, b"request head too large\n", b"text/plain")
                return
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
                self._reply(conn, deadline, 405, b"only GET\n", b"text/plain")
                return
            path = parts[1].split(b"?", 1)[0]
            if path not in (b"/metrics", b"/"):
                self._reply(conn, deadline, 404, b"not found; the metrics are at /metrics\n", b"text/plain")
                return
            body = self.render()
            self._reply(conn, deadline, 200, b"" if parts[0] == b"HEAD" else body,
                        b"text/plain; version=0.0.4; charset=utf-8", length=len(body))
        except Exception:  # noqa: BLE001 - one bad connection must not take a worker down
            log.exception("metrics request failed")
        finally:
            conn.close()
            self._open.release()

    def _read_head(self, conn: socket.socket, deadline: float) -> bytes | None:
        """The request head; b"" when too large; None when the client was too slow or left."""
        buf = b""
        while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
            left = deadline - SYSTEM.monotonic()
            if left <= 0:
                return None
            conn.settimeout(left)
            try:
                chunk = conn.recv(4096)
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
            if len(buf) > self.config.max_request_bytes:
                return b""
        return buf

    @staticmethod
    def _reply(conn: socket.socket, deadline: float, code: int, body: bytes, ctype: bytes,
               length: int | None = None) -> None:
        reason = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed",
                  431: b"Request Header Fields Too Large"}[code]
        head = (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                % (code, reason, ctype, len(body) if length is None else length))
        conn.settimeout(max(0.1, deadline - SYSTEM.monotonic()) + 5.0)  # a client that does not read: bounded
        conn.sendall(head + body)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def server_close(self) -> None:
        self._sock.close()
