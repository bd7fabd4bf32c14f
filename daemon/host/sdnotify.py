"""sd_notify(3) from the main loop: READY/STATUS/WATCHDOG/STOPPING/RELOADING/MAINPID, stdlib only.

Like gunicorn's systemd support: one datagram per message to $NOTIFY_SOCKET (a path, or `@name` for
the abstract namespace). Outside systemd (no NOTIFY_SOCKET) every call is a cheap no-op. A socket that
is gone or refuses is logged once and never raises: supervision matters more than telling systemd.

The watchdog is pinged by the main loop (`maybe_watchdog()` each tick), never by a thread — a hung loop
must miss its pings so systemd kills the daemon (KillMode=process: the job keeps running).
"""

from __future__ import annotations

import os
import socket
import time

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.host.logging import get_logger

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class SdNotifier:
    """Talks to systemd's notify socket; `enabled` is False outside systemd."""

    def __init__(self, env: dict[str, str] | None = None, unset_environment: bool = True) -> None:
        # Read from os.environ by default and then remove the keys, so the job's ranks (our children)
        # never inherit NOTIFY_SOCKET: with NotifyAccess=main they would be ignored anyway.
        source = os.environ if env is None else env
        self.address = source.get("NOTIFY_SOCKET") or None
        self._watchdog_usec = source.get("WATCHDOG_USEC")
        self._watchdog_pid = source.get("WATCHDOG_PID")
        if env is None and unset_environment:
            for key in _ENV_KEYS:
                os.environ.pop(key, None)
        self._sock: socket.socket | None = None
        self._warned = False
        self._last_ping: float | None = None
        self._log = get_logger("ulyssesd.sdnotify")

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def _sockaddr(self) -> str | bytes:
        assert self.address is not None
        if self.address.startswith("@"):  # abstract namespace: leading NUL byte
            return b"\0" + self.address[1:].encode()
        return self.address

    def notify(self, msg: str) -> bool:
        """Send one message (e.g. "READY=1\\nSTATUS=…"); True if systemd got it, False otherwise."""
        if not self.enabled:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg.encode(), self._sockaddr())
            return True
        except OSError as exc:
            if not self._warned:  # once: a gone socket would otherwise log every tick
                self._warned = True
                self._log.warning("sd_notify failed; continuing without systemd notifications",
                                  notify_socket=self.address, error=f"{type(exc).__name__}: {exc}")
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={_one_line(text)}")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))

    def reloading(self) -> bool:
        # MONOTONIC_USEC is required by Type=notify-reload (systemd ≥ 253) and harmless before.
        return self.notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for more time in the current start/stop phase (e.g. a long store migration before READY)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def mainpid(self, pid: int) -> bool:
        return self.notify(f"MAINPID={int(pid)}")

    def watchdog(self) -> bool:
        ok = self.notify("WATCHDOG=1")
        self._last_ping = SYSTEM.monotonic()
        return ok

    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half of WATCHDOG_USEC (None when the watchdog is off or meant for another pid)."""
        if not self.enabled or not self._watchdog_usec:
            return None
        if self._watchdog_pid and self._watchdog_pid.isdigit() and int(self._watchdog_pid) != os.getpid():
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            return None
        return usec / 2e6 if usec > 0 else None

    def maybe_watchdog(self, now: float | None = None) -> bool:
        """Call every tick: pings when half the watchdog interval has passed since the last ping."""
        interval = self.watchdog_interval_s()
        if interval is None:
            return False
        now = SYSTEM.monotonic() if now is None else now
        if self._last_ping is not None and now - self._last_ping < interval:
            return False
        self.watchdog()
        self._last_ping = now
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
