"""The daemon beside an inner launcher that restarts workers itself (torchrun --max-restarts, NVRx ft_launcher).

Each tick reads the attempt log's new lines, and each telemetry record passes through `on_record`; every
in-job restart they show is recorded once as an `inner_restart` incident (never a daemon restart: the
restart budget and `restarts` count only the daemon's relaunches), the engine's hang clock restarts (the
restarted group is in its start-up phase), and the incident is resolved once the workers train again.
While the inner launcher has restarts left the daemon's rank watch stands back: a lost rank is the inner
launcher's to restart, not a reason to end the attempt. When it has none left it exits, and the daemon's
crash path takes over (docs/COEXISTENCE.md). Narrow collaborators only: a store, an incident recorder, an
engine feed and a clock, never the supervisor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ulyssesd.daemon.coexist.evidence import InnerRestart, RestartLedger
from ulyssesd.daemon.coexist.modes import InnerRestarts, LauncherLike, resolve
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.store.enums import IncidentStatus, Severity, Symptom
from ulyssesd.remediation.records import EventRecord, Record, StepRecord

log = get_logger("ulyssesd.coexist")

#: At most this much of the attempt log is read per tick (the rest next tick): a chatty job cannot stall the loop.
READ_CHUNK = 1 << 20
INNER_RESTART_EVENT = "inner_restart"  # fed to the engine: its hang detector restarts the start-up phase


class InnerRestartWatch:
    def __init__(self, mode: InnerRestarts, store: Any, run_id: Callable[[], str]) -> None:
        self.mode = mode
        self.store = store
        self.run_id = run_id
        self.ledger: RestartLedger | None = None
        self.offset = 0
        self.partial = b""
        self.open_incidents: list[int] = []

    @classmethod
    def of(cls, launcher: LauncherLike, store: Any, run_id: Callable[[], str]) -> InnerRestartWatch:
        """The watch of a run's `[launcher]` (its inner_restarts mode resolved)."""
        return cls(resolve(launcher), store, run_id)

    # ------------------------------------------------------------------------- per attempt
    def _for(self, attempt: int) -> RestartLedger:
        if self.ledger is None or self.ledger.attempt != attempt:
            self.ledger = RestartLedger(attempt, self.mode.max_restarts, recorded=self._known(attempt))
            self.offset, self.partial, self.open_incidents = 0, b"", []
        return self.ledger

    def _known(self, attempt: int) -> int:
        """Restarts a previous daemon already recorded for this attempt (re-adoption reads its log again)."""
        try:
            rows = self.store.list_incidents(self.run_id(), symptom=Symptom.inner_restart)
        except Exception as exc:  # noqa: BLE001 - counted again is better than a dead tick; logged
            log.warning("could not read the recorded inner restarts", error=repr(exc))
            return 0
        return max((int((r.evidence or {}).get("ordinal") or 0) for r in rows if r.attempt == attempt), default=0)

    def defers_rank_watch(self, attempt: int) -> bool:
        """True while the inner launcher still has a restart left in `attempt`: a lost rank is its to restart."""
        return self.mode.on and self._for(attempt).left > 0

    # ----------------------------------------------------------------------------- evidence
    def poll_log(self, attempt: int, log_path: Path) -> list[InnerRestart]:
        """The attempt log's new complete lines (bounded per call), read for the launcher's restart lines."""
        if not self.mode.on:
            return []
        ledger = self._for(attempt)
        try:
            with open(log_path, "rb") as f:
                size = f.seek(0, 2)
                if size < self.offset:  # rotated (attempt_log_max_mib): start over in the new file
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                chunk = f.read(READ_CHUNK)
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        data = self.partial + chunk
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if len(self.partial) > READ_CHUNK:  # a line without end: its start is enough to read
            self.partial = b""
        out: list[InnerRestart] = []
        for raw in lines:
            if b"attempts left" in raw:
                out.extend(ledger.line(raw.decode("utf-8", "replace")))
        return out

    def on_record(self, attempt: int, rec: Record) -> list[InnerRestart]:
        if not self.mode.on or (rec.attempt is not None and rec.attempt != attempt):
            return []
        return self._for(attempt).record(rec)

    # ------------------------------------------------------------------- the loop's two calls
    def tick(self, attempt: int, log_path: Path, step: int, incident: Callable[..., int],
             feed_engine: Callable[[EventRecord], None], say: Callable[[str], None]) -> None:
        """Once per tick, before the engine's hang check: the launcher's new lines."""
        self.record(self.poll_log(attempt, log_path), step=step, incident=incident, feed_engine=feed_engine, say=say)

    def observe(self, attempt: int, rec: Record, *, step: int, incident: Callable[..., int],
                feed_engine: Callable[[EventRecord], None], say: Callable[[str], None]) -> None:
        """Each telemetry record of the running attempt (from `on_record`)."""
        if not self.mode.on:
            return
        self.record(self.on_record(attempt, rec), step=step, incident=incident, feed_engine=feed_engine, say=say)
        self.trains_again(rec)

    # ----------------------------------------------------------------------------- records
    def record(self, found: list[InnerRestart], *, step: int, incident: Callable[..., int],
               feed_engine: Callable[[EventRecord], None], say: Callable[[str], None]) -> None:
        """Each restart as one incident; the engine's hang clock restarts with it."""
        for r in found:
            left = max(0, self.mode.max_restarts - r.ordinal)
            summary = (f"{self.mode.tool} restarted the workers inside attempt {r.attempt} (in-job restart "
                       f"{r.ordinal} of {self.mode.max_restarts}, {left} left; seen in the {r.source}); not a "
                       "daemon restart")
            iid = incident(Symptom.inner_restart, step, Severity.warning, summary,
                           {"by": self.mode.tool, "attempt": r.attempt, "ordinal": r.ordinal,
                            "max_restarts": self.mode.max_restarts, "restarts_left": left, "source": r.source,
                            "evidence": r.evidence}, attempt=r.attempt)
            self.open_incidents.append(iid)
            log.warning("inner restart", by=self.mode.tool, attempt=r.attempt, ordinal=r.ordinal, source=r.source)
            feed_engine(EventRecord(INNER_RESTART_EVENT, step=None, attempt=r.attempt,
                                    fields={"ordinal": r.ordinal, "by": self.mode.tool}))
            if left == 0:
                say(f"  {self.mode.tool} has no restart left in attempt {r.attempt}: its next failure ends the "
                    "attempt and the daemon takes over")

    def trains_again(self, rec: Record) -> None:
        """A step after a restart: the restarted workers train, so its incidents are resolved."""
        if not self.open_incidents or not isinstance(rec, StepRecord):
            return
        for iid in self.open_incidents:
            try:
                self.store.update_incident_status(iid, IncidentStatus.resolved,
                                                  f"the restarted workers train again (step {rec.step})")
            except Exception as exc:  # noqa: BLE001 - bookkeeping only; logged
                log.warning("could not resolve inner restart incident", id=iid, error=repr(exc))
        self.open_incidents = []
