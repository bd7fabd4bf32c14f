"""incidents.symptom gains 'inner_restart' (an inner launcher restarted the workers inside an attempt)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07

torchrun --max-restarts and NVRx's ft_launcher restart a failed worker group themselves, inside one attempt
of the daemon's. The daemon records each such restart as an incident of its own symptom, so that it is never
read as a daemon restart, a crash, or a crash loop (docs/COEXISTENCE.md). The CHECK on incidents.symptom is
recreated (batch: the table is rebuilt, rows kept). Two in-job restarts can share a training step (a worker
group that fails again before its first new step), so the partial unique index of 0005 leaves 'inner_restart'
out too; the daemon keys each by its ordinal in the attempt (its evidence) and reads them back on re-adoption.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

SYMPTOMS_0006 = ("memory_spike", "cuda_oom", "loss_spike", "loss_oscillation", "nan_loss", "overflow_storm",
                 "slow_step", "straggler", "throughput_drop", "hang", "crash", "crash_loop", "no_progress",
                 "checkpoint_corrupt", "disk_full", "launch_failure", "store_damaged", "internal_error", "gpu_failure")
SYMPTOMS_0007 = (*SYMPTOMS_0006, "inner_restart")
KEY = ("run_id", "attempt", "symptom", "step")
NAME = "uq_incidents_run_id_attempt_symptom_step"
WHERE_0006 = "symptom != 'internal_error'"
WHERE_0007 = "symptom NOT IN ('internal_error', 'inner_restart')"


def _set_symptom_check(values: tuple[str, ...], where: str) -> None:
    allowed = ", ".join(f"'{v}'" for v in values)
    op.drop_index(NAME, table_name="incidents")
    with op.batch_alter_table("incidents", recreate="always") as batch:
        batch.drop_constraint(op.f("ck_incidents_symptom"), type_="check")
        batch.create_check_constraint(op.f("ck_incidents_symptom"), f"symptom IN ({allowed})")
    op.create_index(NAME, "incidents", list(KEY), unique=True, sqlite_where=sa.text(where))


def upgrade() -> None:
    _set_symptom_check(SYMPTOMS_0007, WHERE_0007)


def downgrade() -> None:
    op.execute("DELETE FROM incidents WHERE symptom = 'inner_restart'")
    _set_symptom_check(SYMPTOMS_0006, WHERE_0006)
