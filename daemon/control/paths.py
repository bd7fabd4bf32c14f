"""Where the control socket lives: the daemon's listening path and the path a client connects to."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_SOCKET_NAME = "ulyssesd.sock"
SYSTEM_SOCKET_PATH = "/run/ulyssesd/ulyssesd.sock"  # RuntimeDirectory of the packaged unit


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

