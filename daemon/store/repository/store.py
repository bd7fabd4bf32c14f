"""`Store`: the repository over one SQLite file, every table group's queries in one object."""

from __future__ import annotations

from typing import Any

from .incidents import IncidentsRepository
from .progress import ProgressRepository
from .runs import RunsRepository
from .upkeep import UpkeepRepository


class Store(RunsRepository, IncidentsRepository, ProgressRepository, UpkeepRepository):
    """Repository over one SQLite file. Build it with `ulyssesd.daemon.store.open_store`."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
