"""checkpoints table, telemetry cursor, attempt process identity (pgid + start time)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

What a re-adopting daemon needs: the telemetry offset it had processed (so incidents are neither missed nor
doubled), the job's process group and the pid's start time (so a recycled pid is not mistaken for our job),
and the checkpoint tags it has seen (last / known-good, for `status` and rollbacks).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Batch mode: SQLite rebuilds `attempts` (copy → drop → rename), keeping its rows.
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("pgid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("proc_start_time", sa.Float(), nullable=True))

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("tag", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("valid", sa.Boolean(), nullable=False),
        sa.Column("known_good", sa.Boolean(), nullable=False),
        sa.Column("invalid_reason", sa.Text(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("config_version", sa.Integer(), nullable=True),
        sa.Column("saved_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("pruned_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_checkpoints_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        sa.UniqueConstraint("run_id", "tag", name="uq_checkpoints_run_id_tag"),
    )
    op.create_index("ix_checkpoints_run_id", "checkpoints", ["run_id"])
    op.create_table(
        "telemetry_cursors",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("inode", sa.Integer(), nullable=False),
        sa.Column("offset", sa.Integer(), nullable=False),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_telemetry_cursors_run_id_runs",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", name="pk_telemetry_cursors"),
    )


def downgrade() -> None:
    op.drop_table("telemetry_cursors")
    op.drop_index("ix_checkpoints_run_id", table_name="checkpoints")
    op.drop_table("checkpoints")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("proc_start_time")
        batch.drop_column("pgid")
