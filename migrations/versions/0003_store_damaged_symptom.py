"""incidents.symptom gains 'store_damaged' (the daemon restored or re-created its database)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

A damaged, emptied or deleted database is recovered at start (newest good backup + what the run
directories hold) or mid-run (copied from the still-open connection); the recovery is an incident of its
own so an operator sees what the store lost and regained. The CHECK on incidents.symptom is recreated
(batch: the table is rebuilt, rows kept).
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

SYMPTOMS_0002 = ("memory_spike", "cuda_oom", "loss_spike", "loss_oscillation", "nan_loss", "overflow_storm",
                 "slow_step", "straggler", "throughput_drop", "hang", "crash", "crash_loop", "no_progress",
                 "checkpoint_corrupt", "disk_full", "launch_failure")
SYMPTOMS_0003 = (*SYMPTOMS_0002, "store_damaged")


def _set_symptom_check(values: tuple[str, ...]) -> None:
    allowed = ", ".join(f"'{v}'" for v in values)
    with op.batch_alter_table("incidents", recreate="always") as batch:
        batch.drop_constraint(op.f("ck_incidents_symptom"), type_="check")
        batch.create_check_constraint(op.f("ck_incidents_symptom"), f"symptom IN ({allowed})")


def upgrade() -> None:
    _set_symptom_check(SYMPTOMS_0003)


def downgrade() -> None:
    op.execute("DELETE FROM incidents WHERE symptom = 'store_damaged'")
    _set_symptom_check(SYMPTOMS_0002)
