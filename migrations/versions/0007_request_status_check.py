"""request_rows: the database refuses a status outside the lifecycle's (a CHECK constraint on both backends)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 01:30:00

Existing rows keep their status; the upgrade stops with the offending values if any row has one the
lifecycle does not know (nothing in holdback ever wrote one). SQLite cannot add a constraint to a table,
so request_rows is rebuilt; dropping the old table would cascade to attempts, so their rows are kept aside
in a temporary table and put back in the same transaction.
"""

from alembic import op
import sqlalchemy as sa

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

# Frozen here: a migration must not change when the models do later.
STATUSES = ('pending', 'queued', 'running', 'retry_wait', 'succeeded', 'failed', 'cancelled', 'expired')
NAME = 'ck_request_rows_status'
CONDITION = "status IN ({})".format(", ".join(f"'{s}'" for s in STATUSES))


def upgrade() -> None:
    bind = op.get_bind()
    unknown = bind.execute(sa.text(
        f"SELECT status, count(*) FROM request_rows WHERE NOT ({CONDITION}) GROUP BY status")).all()
    if unknown:
        found = ", ".join(f"{status!r} ({n} rows)" for status, n in unknown)
        raise RuntimeError(f"request_rows has statuses the lifecycle does not know: {found}; set each of those "
                           f"rows to one of {', '.join(STATUSES)} and run the upgrade again")
    if bind.dialect.name == 'sqlite':
        _rebuild_keeping_attempts(lambda batch_op: batch_op.create_check_constraint(NAME, sa.text(CONDITION)))
    else:
        op.create_check_constraint(NAME, 'request_rows', sa.text(CONDITION))


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        _rebuild_keeping_attempts(lambda batch_op: batch_op.drop_constraint(NAME, type_='check'))
    else:
        op.drop_constraint(NAME, 'request_rows', type_='check')


def _rebuild_keeping_attempts(change) -> None:
    op.execute("CREATE TEMPORARY TABLE holdback_0007_attempts AS SELECT * FROM attempts")
    with op.batch_alter_table('request_rows', recreate='always') as batch_op:
        change(batch_op)
    op.execute("DELETE FROM attempts")  # whatever the cascade left (nothing, with foreign keys on)
    op.execute("INSERT INTO attempts SELECT * FROM holdback_0007_attempts")
    op.execute("DROP TABLE holdback_0007_attempts")
