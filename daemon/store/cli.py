"""Operator commands behind `ulyssesctl db upgrade` / `ulyssesctl db current` (wired by the CLI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .migrate import current_revision, head_revision, upgrade_to_head


def db_upgrade(db_path: str | Path) -> str:
    """Upgrade the database (created if missing) to head; returns the revision now current."""
    return upgrade_to_head(db_path)


def db_current(db_path: str | Path) -> str | None:
    """The database's revision, None if it has no schema. Raises NoDatabaseError if the file is missing."""
    return current_revision(db_path)


def db_status(db_path: str | Path) -> dict[str, Any]:
    """{path, current, head, up_to_date} for `ulyssesctl db current --json`."""
    cur, head = current_revision(db_path), head_revision()
    return {"path": str(Path(db_path).expanduser().resolve()), "current": cur, "head": head,
            "up_to_date": cur == head}
