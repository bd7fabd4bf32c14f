"""File modes of what the daemon creates, whatever the umask: state and run dirs 0750, database and
backups 0640 (the service user writes, the `ulyssesd` group reads, nobody else sees training data).

`umask 000` would otherwise give 0777/0666: any local user could read specs, incidents and logs, or
replace the database.
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o750
FILE_MODE = 0o640


def private_dir(path: str | os.PathLike[str]) -> Path:
    """mkdir -p `path`; every directory this call creates gets DIR_MODE exactly.

    Directories that already existed are left as they are: a shared parent (/tmp, a home dir, a
    systemd StateDirectory that systemd already made 0750) is not ours to change."""
    p = Path(path)
    missing = []
    q = p
    while not q.exists() and q.parent != q:
        missing.append(q)
        q = q.parent
    p.mkdir(parents=True, exist_ok=True)
    for d in missing:
        os.chmod(d, DIR_MODE)
    return p


def private_file(path: str | os.PathLike[str]) -> Path:
    """Create `path` (empty) if missing; set FILE_MODE when this uid owns it."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return p


def tighten(path: str | os.PathLike[str], mode: int = FILE_MODE) -> None:
    """chmod `path` to `mode` if it exists and this uid owns it (SQLite's -wal/-shm, a copied backup)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if st.st_uid == os.geteuid() and (st.st_mode & 0o7777) != mode:
        os.chmod(path, mode)
