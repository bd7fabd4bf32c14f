"""incidents.symptom gains 'gpu_failure' (NVML found a GPU failing: daemon/host/gpu_health.py)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07

The GPU health checks record a failing GPU (an Xid that needs a reset, uncorrectable ECC errors, a pending
or failed row remap, its shutdown temperature, a GPU lost) as an incident of its own symptom: not a crash of
the job (which may still be running) and not a launch failure (it is found during the run too). The CHECK on
incidents.symptom is recreated (batch: the table is rebuilt, rows kept).
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

SYMPTOMS_0005 = ("memory_spike", "cuda_oom", "loss_spike", "loss_oscillation", "nan_loss", "overflow_storm",
                 "slow_step", "straggler", "throughput_drop", "hang", "crash", "crash_loop", "no_progress",
                 "checkpoint_corrupt", "disk_full", "launch_failure", "store_damaged", "internal_error")
SYMPTOMS_0006 = (*SYMPTOMS_0005, "gpu_failure")


def _set_symptom_check(values: tuple[str, ...]) -> None:
    allowed = ", ".join(f"'{v}'" for v in values)
    with op.batch_alter_table("incidents", recreate="always") as batch:
        batch.drop_constraint(op.f("ck_incidents_symptom"), type_="check")
        batch.create_check_constraint(op.f("ck_incidents_symptom"), f"symptom IN ({allowed})")


def upgrade() -> None:
    _set_symptom_check(SYMPTOMS_0006)


def downgrade() -> None:
    op.execute("DELETE FROM incidents WHERE symptom = 'gpu_failure'")
    _set_symptom_check(SYMPTOMS_0005)
