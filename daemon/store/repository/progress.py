"""How far a run got: its config versions, the telemetry cursor, its checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..errors import InvalidValueError, NotFoundError
from ..models import Checkpoint, ConfigVersion, TelemetryCursor
from ..records import CheckpointRecord, ConfigVersionRecord, TelemetryCursorRecord
from .base import StoreBase, Timestamp


class ProgressRepository(StoreBase):
    """Queries of the config_versions, telemetry_cursors and checkpoints tables."""

    # -- config versions ---------------------------------------------------------------------------------
    def add_config_version(
        self,
        run_id: str,
        config: dict[str, Any],
        *,
        reason: str,
        parent_version: int | None = None,
        version: int | None = None,
        make_current: bool = True,
        at: Timestamp = None,
    ) -> ConfigVersionRecord:
        """Store an effective config; `version` defaults to last + 1 (first is 1). Optionally make it the
        run's current `config_version`."""
        with self._write() as s:
            run = self._run_row(s, run_id)
            if version is None:
                last = s.scalar(select(func.max(ConfigVersion.version)).where(ConfigVersion.run_id == run_id))
                version = (last or 0) + 1
            cv = ConfigVersion(run_id=run_id, version=version, parent_version=parent_version, config=config,
                               reason=reason, created_at=self._to_utc(at))
            s.add(cv)
            if make_current:
                run.config_version = version
                run.updated_at = self._to_utc(at)
            s.flush()
            return ConfigVersionRecord.from_row(cv)

    def get_config_version(self, run_id: str, version: int | None = None) -> ConfigVersionRecord:
        """`version` or, when None, the run's current one (else its newest)."""
        with self._read() as s:
            run = self._run_row(s, run_id)
            q = select(ConfigVersion).where(ConfigVersion.run_id == run_id)
            want = version if version is not None else run.config_version
            q = q.where(ConfigVersion.version == want) if want is not None else q.order_by(ConfigVersion.version.desc())
            cv = s.scalars(q.limit(1)).first()
            if cv is None:
                raise NotFoundError(f"no config version {want if want is not None else '(any)'} of run {run_id!r}")
            return ConfigVersionRecord.from_row(cv)

    def list_config_versions(self, run_id: str) -> list[ConfigVersionRecord]:
        with self._read() as s:
            q = select(ConfigVersion).where(ConfigVersion.run_id == run_id).order_by(ConfigVersion.version)
            return [ConfigVersionRecord.from_row(c) for c in s.scalars(q)]

    # -- telemetry cursor --------------------------------------------------------------------------------
    def set_telemetry_cursor(
        self, run_id: str, *, path: str | Path, inode: int, offset: int, last_step: int | None = None
    ) -> TelemetryCursorRecord:
        """Remember how far telemetry.jsonl was processed (byte offset just after the last full line)."""
        if offset < 0:
            raise InvalidValueError(f"telemetry offset must be >= 0, got {offset}")
        with self._write() as s:
            self._require_run(s, run_id)
            cur = s.get(TelemetryCursor, run_id)
            if cur is None:
                cur = TelemetryCursor(run_id=run_id)
                s.add(cur)
            cur.path, cur.inode, cur.offset, cur.last_step, cur.updated_at = (
                str(path), int(inode), int(offset), last_step, self._now())
            s.flush()
            return TelemetryCursorRecord.from_row(cur)

    def get_telemetry_cursor(self, run_id: str) -> TelemetryCursorRecord | None:
        with self._read() as s:
            cur = s.get(TelemetryCursor, run_id)
            return TelemetryCursorRecord.from_row(cur) if cur else None

    # -- checkpoints -------------------------------------------------------------------------------------
    def upsert_checkpoint(
        self,
        run_id: str,
        tag: str,
        step: int,
        *,
        loss: float | None = None,
        valid: bool = True,
        known_good: bool | None = None,
        invalid_reason: str | None = None,
        attempt: int | None = None,
        config_version: int | None = None,
        saved_at: Timestamp = None,
    ) -> CheckpointRecord:
        """Insert or update a seen tag. `known_good=None` keeps the stored flag; an invalid tag is never
        known-good."""
        now = self._now()
        with self._write() as s:
            self._require_run(s, run_id)
            ck = self._checkpoint_row(s, run_id, tag)
            if ck is None:
                ck = Checkpoint(run_id=run_id, tag=tag, saved_at=self._to_utc(saved_at), known_good=False)
                s.add(ck)
            ck.step, ck.valid, ck.updated_at = int(step), bool(valid), now
            if loss is not None:
                ck.loss = float(loss)
            if attempt is not None:
                ck.attempt = attempt
            if config_version is not None:
                ck.config_version = config_version
            ck.invalid_reason = None if valid else (invalid_reason or "invalid")
            if known_good is not None:
                ck.known_good = bool(known_good)
            if not valid:
                ck.known_good = False
            s.flush()
            return CheckpointRecord.from_row(ck)

    @staticmethod
    def _checkpoint_row(s: Session, run_id: str, tag: str) -> Checkpoint | None:
        return s.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.tag == tag)).first()

    def mark_checkpoint_pruned(self, run_id: str, tag: str) -> CheckpointRecord:
        """The tag's files were removed by retention; the row stays for the history."""
        with self._write() as s:
            ck = self._checkpoint_row(s, run_id, tag)
            if ck is None:
                raise NotFoundError(f"no checkpoint {tag!r} of run {run_id!r}")
            ck.pruned_at = ck.updated_at = self._now()
            s.flush()
            return CheckpointRecord.from_row(ck)

    def mark_checkpoints_pruned(self, run_id: str, tags: list[str]) -> int:
        """`mark_checkpoint_pruned` for several tags in one transaction (a retention pass's removals); tags with
        no row are skipped. Returns how many rows it marked."""
        if not tags:
            return 0
        with self._write() as s:
            now = self._now()
            rows = list(s.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.tag.in_(tags),
                                                          Checkpoint.pruned_at.is_(None))))
            for ck in rows:
                ck.pruned_at = ck.updated_at = now
            s.flush()
            return len(rows)

    def list_checkpoints(self, run_id: str, *, include_pruned: bool = False) -> list[CheckpointRecord]:
        """Tags by step, oldest first."""
        q = select(Checkpoint).where(Checkpoint.run_id == run_id)
        if not include_pruned:
            q = q.where(Checkpoint.pruned_at.is_(None))
        with self._read() as s:
            return [CheckpointRecord.from_row(c) for c in s.scalars(q.order_by(Checkpoint.step, Checkpoint.id))]

    def latest_checkpoint(self, run_id: str, *, known_good: bool = False) -> CheckpointRecord | None:
        """Newest valid, unpruned tag (with `known_good=True`: newest known-good one)."""
        q = select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.valid.is_(True),
                                     Checkpoint.pruned_at.is_(None))
        if known_good:
            q = q.where(Checkpoint.known_good.is_(True))
        with self._read() as s:
            ck = s.scalars(q.order_by(Checkpoint.step.desc(), Checkpoint.id.desc()).limit(1)).first()
            return CheckpointRecord.from_row(ck) if ck else None
