"""What must hold after every event of a simulated run (issue 32), checked against the files, the simulated
processes and the store: never against the supervisor's own opinion of itself.

- checkpoints: the newest valid tag and the newest known-good tag are never deleted (renamed aside by a rollback
  or quarantine is not a deletion: it is kept as evidence);
- disk: the checkpoint directory stays within its budget (`BudgetPolicy.budget_bytes`: the keep_last window, the
  bounded known-good anchors, the save in flight, the set-aside cap, the margin), allowing the retention timer
  `GRACE_TICKS` ticks to catch up after a rollback set tags aside;
- processes: at most one live attempt, and it is the one the supervisor holds (no orphan);
- states: every recorded transition is an edge of core/states.py; no tick step raised (an `internal_error`
  incident is a daemon bug);
- incidents: none duplicated (one per run, attempt, symptom, step); at the end no incident of an earlier attempt
  is still open, and none has waited for its fix's verification longer than a simulated day (none lost across
  daemon restarts);
- budget: the daemon's own relaunches in any hour of monotonic time stay within `max_restarts_per_hour`;
  every ladder's position is within its ladder and does not go back when a new daemon re-adopts the run;
- resumes: no attempt resumes from a tag whose weights were poisoned (saved after a NaN onset);
- hangs: a hang incident names an attempt that did hang (the simulation knows): a healthy job is never killed
  as hung.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ulyssesd.daemon.core.states import TRANSITIONS
from ulyssesd.daemon.store.enums import TERMINAL_INCIDENT_STATUSES, RunState, Symptom
from ulyssesd.training.checkpoint.retention import tree_bytes

#: Ticks the checkpoint directory may stay over its budget (a rollback's set-aside tags wait for retention).
GRACE_TICKS = 3
#: The longest an incident of an earlier attempt may wait for its fix's verification (simulated seconds).
UNVERIFIED_MAX_S = 86_400.0


@dataclass(frozen=True)
class Violation:
    at: float  # monotonic simulated seconds
    invariant: str
    detail: str


def valid_tags(ckpt_dir: Path) -> list[str]:
    """Complete tags (a manifest written last), oldest first."""
    from ulyssesd.training import checkpoint as ck

    return [t for t in ck.list_tags(ckpt_dir) if (ckpt_dir / t / "manifest.json").is_file()]


def kept(ckpt_dir: Path, tag: str) -> bool:
    """`tag` is still there, or renamed aside (`tag.rolledback-*`, `tag.corrupt-*`)."""
    if (ckpt_dir / tag).is_dir():
        return True
    return ckpt_dir.is_dir() and any(p.name.startswith(tag + ".") for p in ckpt_dir.iterdir())


class StoreReader:
    """The store read directly with SQL (read-only, its own connection): the checker reads it after every event, and
    the repository's ORM objects cost more than the simulated daemon's tick."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db: sqlite3.Connection | None = None

    def rows(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        if self.db is None:
            self.db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        return self.db.execute(sql, args).fetchall()

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    def set_aside(self, run_id: str) -> set[str]:
        """Tags the daemon marked invalid: rolled back past (poisoned lineage) or quarantined."""
        return {r[0] for r in self.rows("SELECT tag FROM checkpoints WHERE run_id=? AND NOT valid", run_id)}

    def known_good(self, run_id: str) -> set[str]:
        return {r[0] for r in self.rows("SELECT tag FROM checkpoints WHERE run_id=? AND known_good", run_id)}


@dataclass
class Checker:
    """Invariants across one run (several daemons, one store)."""

    ckpt_dir: Path
    tag_bytes: int
    db: StoreReader
    violations: list[Violation] = field(default_factory=list)
    _guard: tuple[str | None, str | None] = (None, None)
    _seen_transitions: int = 0
    _incident_keys: dict[tuple[int, str, int], int] = field(default_factory=dict)
    _over_budget: int = 0
    _resumes_seen: int = 0
    _seen_incident: int = 0

    def fail(self, at: float, invariant: str, detail: str) -> None:
        self.violations.append(Violation(round(at, 1), invariant, detail))

    # ---------------------------------------------------------------- around each event
    def before(self, sup: Any) -> None:
        """What must survive the next event: the newest valid and the newest known-good tag."""
        tags = valid_tags(self.ckpt_dir)
        newest = tags[-1] if tags else None
        good = None
        if sup is not None and sup.run_id:
            kg = [t for t in tags if t in self.db.known_good(sup.run_id)]
            good = kg[-1] if kg else None
        self._guard = (newest, good)

    def after(self, now: float, sup: Any, simos: Any) -> None:
        self.kept_checkpoints(now, sup)
        self._processes(now, sup, simos)
        if sup is not None and sup.run_id:
            self._store(now, sup, simos)
            self._disk(now, sup)
            self._ladders(now, sup)
        self._resumes(now, simos)

    def kept_checkpoints(self, now: float, sup: Any) -> None:
        """The newest valid and newest known-good tags seen by `before` are still there (or renamed aside)."""
        newest, good = self._guard
        if newest is not None or good is not None:
            tags = valid_tags(self.ckpt_dir)
            kg = set()
            if good is not None and sup is not None and sup.run_id:
                kg = self.db.known_good(sup.run_id) & set(tags)
            aside = self.db.set_aside(sup.run_id) if sup is not None and sup.run_id else set()
            for what, tag, newer in (("newest valid", newest, tags), ("newest known-good", good, kg)):
                # Gone while still the newest of its kind (a newer one written in the same event may take its place),
                # and not set aside by the daemon (a rollback's set-aside copy may go when room is made: seed 100).
                if tag is not None and not kept(self.ckpt_dir, tag) and not any(t > tag for t in newer) \
                        and tag not in aside:
                    self.fail(now, "checkpoint_deleted", f"the {what} tag {tag} was deleted")

    # ---------------------------------------------------------------- the parts
    def _processes(self, now: float, sup: Any, simos: Any) -> None:
        live = simos.live_jobs()
        if len(live) > 1:
            self.fail(now, "one_live_attempt", f"{len(live)} live attempts: pids {[j.pid for j in live]}")
        held = sup.job.pid if sup is not None and sup.job is not None else None
        for j in live:
            if j.pid != held:
                self.fail(now, "orphan_attempt", f"attempt pid {j.pid} runs but the supervisor holds {held}")

    def _store(self, now: float, sup: Any, simos: Any) -> None:
        rows = self.db.rows("SELECT id, from_state, to_state, reason FROM state_transitions WHERE run_id=? AND id>? "
                            "ORDER BY id", sup.run_id, self._seen_transitions)
        for tid, frm, to, reason in rows:
            if frm is not None and (RunState(frm), RunState(to)) not in TRANSITIONS:
                self.fail(now, "illegal_transition", f"{frm} -> {to} ({reason})")
            self._seen_transitions = tid
        rows = self.db.rows("SELECT id, attempt, symptom, step, summary FROM incidents WHERE run_id=? AND id>? "
                            "ORDER BY id", sup.run_id, self._seen_incident)
        for iid, attempt, symptom, step, summary in rows:
            self._seen_incident = iid
            key = (attempt, symptom, step)
            first = self._incident_keys.setdefault(key, iid)
            if first != iid:
                self.fail(now, "duplicate_incident", f"incidents {first} and {iid} are both {key}")
            if symptom == Symptom.internal_error.value:
                self.fail(now, "internal_error", summary[:300])
            if symptom == Symptom.hang.value:
                pid = self.db.rows("SELECT pid FROM attempts WHERE run_id=? AND number=?", sup.run_id, attempt)
                job = simos.jobs.get(pid[0][0]) if pid and pid[0][0] is not None else None
                if job is not None and not job.was_hung:
                    self.fail(now, "false_hang", f"incident {iid}: attempt {attempt} called hung, but its job was "
                              f"{job.phase}: {summary[:200]}")

    def _disk(self, now: float, sup: Any) -> None:
        from ulyssesd.daemon.host import disk_budget

        policy = disk_budget.policy_of(sup.dcfg, sup.config)
        limit = policy.budget_bytes(self.tag_bytes)
        used = tree_bytes(self.ckpt_dir)
        if used > limit:
            self._over_budget += 1
            if self._over_budget > GRACE_TICKS:
                self.fail(now, "disk_budget", f"{used} bytes in {self.ckpt_dir.name}, over the budget {limit} "
                          f"for {self._over_budget} ticks: {sorted(p.name for p in self.ckpt_dir.iterdir())}")
        else:
            self._over_budget = 0

    def _ladders(self, now: float, sup: Any) -> None:
        from ulyssesd.remediation.playbook import LADDERS

        for name, st in (getattr(sup.engine, "ladders", None) or {}).items():
            if name in LADDERS and not 0 <= st.position <= len(LADDERS[name]):
                self.fail(now, "ladder_bound", f"ladder {name} at position {st.position} of {len(LADDERS[name])}")

    def ladder_positions(self, sup: Any) -> dict[str, int]:
        return {k: v.position for k, v in (getattr(sup.engine, "ladders", None) or {}).items()}

    def readopted(self, now: float, before: dict[str, int], sup: Any) -> None:
        """A new daemon re-adopted the run: no ladder is further back than the killed daemon left it."""
        after = self.ladder_positions(sup)
        for name, pos in before.items():
            if after.get(name, 0) < pos:
                self.fail(now, "ladder_lost_on_readoption", f"ladder {name} was at rung {pos}, re-adopted at "
                          f"{after.get(name, 0)}")

    def _resumes(self, now: float, simos: Any) -> None:
        resumes = [(j.pid, tag, bad) for j in simos.jobs.values() for tag, bad in j.resumes]
        for pid, tag, bad in resumes[self._resumes_seen:]:
            if bad:
                self.fail(now, "poisoned_resume", f"attempt pid {pid} resumed from {tag}, saved with NaN weights")
        self._resumes_seen = len(resumes)

    # ---------------------------------------------------------------- at the end
    def restart_budget(self, sup: Any, simos: Any) -> None:
        """The daemon's own relaunches (not the operator's) in any hour of monotonic time."""
        cap = sup.spec.remediation.max_restarts_per_hour
        by_attempt = {a.number: a.pid for a in sup.store.list_attempts(sup.run_id)}
        spawn_m = {pid: m for m, pid in simos.spawned}
        times = sorted(spawn_m[by_attempt[r.attempt]] for r in sup.store.list_relaunches(sup.run_id)
                       if not r.by_operator and by_attempt.get(r.attempt) in spawn_m)
        j = 0
        for i, t in enumerate(times):
            while times[j] <= t - 3600.0:
                j += 1
            if i - j + 1 > cap:
                self.fail(t, "restart_budget", f"{i - j + 1} relaunches within an hour (cap {cap})")
                return

    def settled(self, now: float, sup: Any) -> None:
        """At the end: no incident of an earlier attempt is still open (never acted on, never settled), and none
        still waits for its fix's verification a simulated day after it was detected."""
        end = sup.os.time()
        for iid, attempt, symptom, status, detected in self.db.rows(
                "SELECT id, attempt, symptom, status, detected_at FROM incidents WHERE run_id=?", sup.run_id):
            if attempt >= sup.attempt or status in {s.value for s in TERMINAL_INCIDENT_STATUSES}:
                continue
            age = end - _epoch(detected)
            if status == "open" or age > UNVERIFIED_MAX_S:
                self.fail(now, "incident_unsettled", f"incident {iid} ({symptom}, attempt {attempt}) is still "
                          f"{status} at attempt {sup.attempt}, {age / 3600:.1f} h after it was detected")


def _epoch(text: str) -> float:
    from datetime import datetime, timezone

    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()
