"""Alembic scripts of the ulyssesd store (env.py, versions/). Run them via ulyssesd.daemon.store.migrate."""

from pathlib import Path

#: Alembic `script_location` (this directory, wherever the package is installed).
SCRIPT_LOCATION = Path(__file__).resolve().parent
