"""What every table group's queries share: the sessions, timestamp and enum parsing, the run-row lookup."""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from ulyssesd.daemon.clock import SYSTEM, Clock, utc_now

from ..errors import InvalidValueError, NotFoundError, ReadOnlyStoreError
from ..models import Run

Timestamp = datetime | float | int | None
_E = TypeVar("_E", bound=enum.Enum)


def parse_enum(enum_cls: type[_E], value: _E | str) -> _E:
    """The enum member `value` names; unknown text raises InvalidValueError listing the allowed values."""
    try:
        return enum_cls.parse(value)  # type: ignore[attr-defined,no-any-return]
    except ValueError as e:
        raise InvalidValueError(str(e)) from None


def to_utc(value: Timestamp, clock: Clock = SYSTEM) -> datetime:
    """None → the clock's now; epoch seconds (telemetry's `time`) or aware datetime → aware UTC datetime."""
    if value is None:
        return utc_now(clock)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidValueError(f"naive datetime {value!r}: pass a timezone-aware datetime (UTC)")
        return value.astimezone(timezone.utc)
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(float(value), tz=timezone.utc)
    raise InvalidValueError(f"timestamp must be a datetime or epoch seconds, got {type(value).__name__}")


def file_id_of(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of `path`, or None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


class StoreBase:
    """Sessions over one SQLite engine; the table groups' query mixins build on it."""

    def __init__(self, engine: Engine, path: Path, *, readonly: bool, clock: Clock = SYSTEM) -> None:
        self._engine = engine
        self.path = path
        self.readonly = readonly
        self.clock = clock  # what stamps rows (the daemon's clock seam; a simulated clock in `ulyssesd simulate`)
        self._bind(engine)

    def _now(self) -> datetime:
        return utc_now(self.clock)

    def _to_utc(self, value: Timestamp) -> datetime:
        return to_utc(value, self.clock)

    def _bind(self, engine: Engine) -> None:
        self._engine = engine
        # The clock rides on the connection: the models' column defaults (`row_now`) stamp rows with it too.
        stamped = engine.execution_options(ulyssesd_clock=self.clock)
        self._write_session = sessionmaker(stamped, expire_on_commit=False)
        # Reads use a plain (deferred) BEGIN even on the writer engine: no write lock for a SELECT.
        self._read_session = sessionmaker(stamped.execution_options(ulyssesd_read=True), expire_on_commit=False)
        # (st_dev, st_ino) of the file this store writes: a file deleted or replaced under the daemon is
        # noticed by `file_problem()` before history goes to an inode nobody can read any more.
        self.file_id = file_id_of(self.path)
        self._runs_seen: set[str] = set()  # run ids this engine's file is known to hold (rows are never deleted)

    # -- plumbing ---------------------------------------------------------------------------------------
    def close(self) -> None:
        self._engine.dispose()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} is open read-only; writes go through the daemon")
        with self._write_session.begin() as s:
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._read_session() as s, s.begin():
            yield s

    @staticmethod
    def _run_row(s: Session, run_id: str) -> Run:
        run = s.get(Run, run_id)
        if run is None:
            raise NotFoundError(f"no run {run_id!r}")
        return run

    def _require_run(self, s: Session, run_id: str) -> None:
        """NotFoundError unless the run exists; asked of the file once per run (a daemon's every cursor, checkpoint
        and incident write names its run: loading the run's row, its spec included, each time was a tick's largest
        store cost in the simulator's profile)."""
        if run_id not in self._runs_seen:
            self._run_row(s, run_id)
            self._runs_seen.add(run_id)
