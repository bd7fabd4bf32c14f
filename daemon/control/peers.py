"""Who may talk to the control socket: the peer's SO_PEERCRED credentials and the authorizer that judges them.

Root, the daemon's own uid, `allowed_uids`, or members of `group` (primary or supplementary, via
pwd/grp/os.getgrouplist) may talk to it; everyone else is refused before a byte they send is read.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass

from ulyssesd.daemon.host.logging import get_logger

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


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

