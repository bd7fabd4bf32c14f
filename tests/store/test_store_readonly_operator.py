"""An operator who may read but not write the state dir can still read the store after a clean shutdown."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.migrate import head_revision, known_revisions

NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_readonly_open_by_non_owner_after_clean_shutdown() -> None:
    # pytest's tmp_path lives under a 0700 directory that another uid cannot traverse.
    top = Path(tempfile.mkdtemp(prefix="ulyssesd-ro-", dir="/tmp"))
    state = top / "state"
    state.mkdir()
    db = state / "ulyssesd.db"
    writer = open_store(db)
    writer.create_run("r1", spec={"k": 1})
    writer.close()
    # A clean shutdown (last connection closed) removes -wal/-shm; others may read but not write.
    assert not Path(str(db) + "-wal").exists()
    os.chmod(top, 0o755)
    os.chmod(state, 0o755)
    os.chmod(db, 0o644)
    # The checkout may sit in a directory only root can traverse (a mktemp clone): read the shipped
    # migration scripts here, so the child (which inherits the cache) needs only the database itself.
    head_revision()
    known_revisions()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody and read
        os.close(read_fd)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            reader = open_store(db, readonly=True)
            got = reader.get_run("r1")
            os.write(write_fd, f"ok {got.id}".encode())
        except BaseException as exc:  # report anything to the parent
            os.write(write_fd, f"err {type(exc).__name__}: {exc}".encode()[:4000])
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    answer = os.read(read_fd, 4096).decode()
    shutil.rmtree(top)
    assert answer == "ok r1", answer
