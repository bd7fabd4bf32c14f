"""incidents.symptom gains 'internal_error' (a bug in the daemon's own tick step, not the job's crash)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02

The supervisor's step guard records an exception in one of its tick steps as an incident. It has its own
symptom because incidents are unique on (run, attempt, symptom, step): recorded as a `crash`, a daemon bug at
step N would swallow the job's real crash at the same step (and two daemon bugs at one step each other's
would still share one row, which is the intended dedup for a repeating error). The CHECK on
incidents.symptom is recreated (batch: the table is rebuilt, rows kept).
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

SYMPTOMS_0003 = ("memory_spike", "cuda_oom", "loss_spike", "loss_oscillation", "nan_loss", "overflow_storm",
                 "slow_step", "straggler", "throughput_drop", "hang", "crash", "crash_loop", "no_progress",
                 "checkpoint_corrupt", "disk_full", "launch_failure", "store_damaged")
SYMPTOMS_0004 = (*SYMPTOMS_0003, "internal_error")


def _set_symptom_check(values: tuple[str, ...]) -> None:
    allowed = ", ".join(f"'{v}'" for v in values)
    with op.batch_alter_table("incidents", recreate="always") as batch:
        batch.drop_constraint(op.f("ck_incidents_symptom"), type_="check")
        batch.create_check_constraint(op.f("ck_incidents_symptom"), f"symptom IN ({allowed})")


def upgrade() -> None:
    _set_symptom_check(SYMPTOMS_0004)


def downgrade() -> None:
    op.execute("DELETE FROM incidents WHERE symptom = 'internal_error'")
    _set_symptom_check(SYMPTOMS_0003)
