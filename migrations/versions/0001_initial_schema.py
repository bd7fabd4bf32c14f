"""initial schema: runs, attempts, incidents, actions, config_versions, state_transitions

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Enum columns are VARCHAR(32) + a named CHECK listing the allowed values, frozen here on purpose: a
migration must not change meaning when the Python enums change later.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

RUN_STATES = ("STARTING", "RUNNING", "REMEDIATING", "RESTARTING", "BACKOFF", "PAUSED", "STOPPING",
              "COMPLETED", "FAILED", "STOPPED")
SYMPTOMS = ("memory_spike", "cuda_oom", "loss_spike", "loss_oscillation", "nan_loss", "overflow_storm",
            "slow_step", "straggler", "throughput_drop", "hang", "crash", "crash_loop", "no_progress",
            "checkpoint_corrupt", "disk_full", "launch_failure")
SEVERITIES = ("info", "warning", "critical")
INCIDENT_STATUSES = ("open", "remediating", "resolved", "escalated", "failed")
ACTION_KINDS = ("set_config", "hot_control", "restart", "rollback_skip", "revert", "stop", "alert", "prune",
                "observe_only_noop")
APPLY_MODES = ("hot", "restart", "none")
ACTION_OUTCOMES = ("pending", "effective", "ineffective", "failed")


def _check(table: str, column: str, values: tuple[str, ...]) -> sa.CheckConstraint:
    allowed = ", ".join(f"'{v}'" for v in values)
    # op.f(): the name is final (the naming convention must not prefix it again).
    return sa.CheckConstraint(f"{column} IN ({allowed})", name=op.f(f"ck_{table}_{column}"))


def _fk_run(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=f"fk_{table}_run_id_runs", ondelete="CASCADE")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("run_dir", sa.Text(), nullable=True),
        sa.Column("spec_path", sa.Text(), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("state_reason", sa.Text(), nullable=True),
        sa.Column("config_version", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        _check("runs", "state", RUN_STATES),
    )
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("command", sa.JSON(), nullable=False),
        sa.Column("config_version", sa.Integer(), nullable=True),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("resumed_from", sa.String(length=64), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("returncode", sa.Integer(), nullable=True),
        sa.Column("signal", sa.Integer(), nullable=True),
        sa.Column("diagnosis", sa.String(length=64), nullable=True),
        sa.Column("diagnosis_evidence", sa.JSON(), nullable=True),
        _fk_run("attempts"),
        sa.PrimaryKeyConstraint("id", name="pk_attempts"),
        sa.UniqueConstraint("run_id", "number", name="uq_attempts_run_id_number"),
    )
    op.create_index("ix_attempts_run_id", "attempts", ["run_id"])
    op.create_table(
        "config_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("parent_version", sa.Integer(), nullable=True),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        _fk_run("config_versions"),
        sa.PrimaryKeyConstraint("id", name="pk_config_versions"),
        sa.UniqueConstraint("run_id", "version", name="uq_config_versions_run_id_version"),
    )
    op.create_index("ix_config_versions_run_id", "config_versions", ["run_id"])
    op.create_table(
        "incidents",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("symptom", sa.String(length=32), nullable=False),
        sa.Column("severity", sa.String(length=32), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("detected_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("closed_at", sa.DateTime(), nullable=True),
        sa.Column("acknowledged_by", sa.String(length=128), nullable=True),
        sa.Column("acknowledged_at", sa.DateTime(), nullable=True),
        _fk_run("incidents"),
        sa.PrimaryKeyConstraint("id", name="pk_incidents"),
        sa.UniqueConstraint("run_id", "attempt", "symptom", "step", name="uq_incidents_run_id_attempt_symptom_step"),
        _check("incidents", "symptom", SYMPTOMS),
        _check("incidents", "severity", SEVERITIES),
        _check("incidents", "status", INCIDENT_STATUSES),
    )
    op.create_index("ix_incidents_detected_at", "incidents", ["detected_at"])
    op.create_index("ix_incidents_run_id", "incidents", ["run_id"])
    op.create_index("ix_incidents_status", "incidents", ["status"])
    op.create_index("ix_incidents_symptom", "incidents", ["symptom"])
    op.create_table(
        "state_transitions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("from_state", sa.String(length=32), nullable=True),
        sa.Column("to_state", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("at", sa.DateTime(), nullable=False),
        _fk_run("state_transitions"),
        sa.PrimaryKeyConstraint("id", name="pk_state_transitions"),
        _check("state_transitions", "from_state", RUN_STATES),
        _check("state_transitions", "to_state", RUN_STATES),
    )
    op.create_index("ix_state_transitions_run_id", "state_transitions", ["run_id"])
    op.create_table(
        "actions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("config_diff", sa.JSON(), nullable=False),
        sa.Column("mode", sa.String(length=32), nullable=False),
        sa.Column("from_config_version", sa.Integer(), nullable=True),
        sa.Column("to_config_version", sa.Integer(), nullable=True),
        sa.Column("observe_only", sa.Boolean(), nullable=False),
        sa.Column("applied_at", sa.DateTime(), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.Column("outcome_detail", sa.JSON(), nullable=True),
        sa.Column("verified_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["incident_id"], ["incidents.id"], name="fk_actions_incident_id_incidents",
                                ondelete="CASCADE"),
        _fk_run("actions"),
        sa.PrimaryKeyConstraint("id", name="pk_actions"),
        _check("actions", "kind", ACTION_KINDS),
        _check("actions", "mode", APPLY_MODES),
        _check("actions", "outcome", ACTION_OUTCOMES),
    )
    op.create_index("ix_actions_incident_id", "actions", ["incident_id"])
    op.create_index("ix_actions_run_id", "actions", ["run_id"])


def downgrade() -> None:
    for table in ("actions", "state_transitions", "incidents", "config_versions", "attempts", "runs"):
        op.drop_table(table)
