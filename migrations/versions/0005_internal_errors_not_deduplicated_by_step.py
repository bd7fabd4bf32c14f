"""incidents: (run_id, attempt, symptom, step) stays unique except for 'internal_error'

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

The unique key makes replayed telemetry after a re-adoption find the incident it already recorded instead of
doubling it. The supervisor's step guard does not replay anything: it deduplicates (and rate-limits) its own
errors by their signature. Under the key, two different daemon errors at one training step (a stalled or
paused job does not move the step; a broken store fails several tick steps at once) shared one row, the
second one's text and traceback lost, and the guard resolved the first error's incident when the second's
step recovered. The constraint becomes a partial unique index that leaves 'internal_error' rows out (batch:
the table is rebuilt, rows kept). The downgrade keeps the oldest internal error per key.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

KEY = ("run_id", "attempt", "symptom", "step")
NAME = "uq_incidents_run_id_attempt_symptom_step"
NOT_INTERNAL = "symptom != 'internal_error'"


def upgrade() -> None:
    with op.batch_alter_table("incidents", recreate="always") as batch:
        batch.drop_constraint(NAME, type_="unique")
    op.create_index(NAME, "incidents", list(KEY), unique=True, sqlite_where=sa.text(NOT_INTERNAL))


def downgrade() -> None:
    extra = ("SELECT id FROM incidents WHERE symptom = 'internal_error' AND id NOT IN (SELECT MIN(id) FROM "
             "incidents WHERE symptom = 'internal_error' GROUP BY run_id, attempt, step)")
    op.execute(f"DELETE FROM actions WHERE incident_id IN ({extra})")  # migrations run with foreign keys off
    op.execute(f"DELETE FROM incidents WHERE id IN ({extra})")
    op.drop_index(NAME, table_name="incidents")
    with op.batch_alter_table("incidents", recreate="always") as batch:
        batch.create_unique_constraint(NAME, list(KEY))
