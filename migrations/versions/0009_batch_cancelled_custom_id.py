"""batches.cancelled: of a batch's failed requests, how many were cancelled; an index on request_rows.custom_id

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 09:00:00

OpenAI's request_counts.failed counts every request that did not succeed, cancelled ones included, and
`batches.failed` keeps that meaning; `cancelled` lets the dashboard and the metrics show a cancel apart from
failures. The upgrade counts the rows of batches already cancelled (only a cancel closes a row as cancelled).
The index lets an operator find the batch of a custom_id without reading every row.
"""

from alembic import op
import sqlalchemy as sa

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

# Frozen here: a migration must not change when the lifecycle does later.
CANCELLED = 'cancelled'
CLOSED_BY_CANCEL = ('cancelling', 'cancelled')


def upgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cancelled', sa.Integer(), nullable=False, server_default='0'))
    op.create_index('ix_request_rows_custom_id', 'request_rows', ['custom_id'])
    batches = sa.table('batches', sa.column('id', sa.String()), sa.column('status', sa.String()),
                       sa.column('cancelled', sa.Integer()))
    rows = sa.table('request_rows', sa.column('batch_id', sa.String()), sa.column('status', sa.String()))
    counted = (sa.select(sa.func.count()).select_from(rows)
               .where(rows.c.batch_id == batches.c.id, rows.c.status == CANCELLED).scalar_subquery())
    op.get_bind().execute(sa.update(batches).where(batches.c.status.in_(CLOSED_BY_CANCEL)).values(cancelled=counted))


def downgrade() -> None:
    op.drop_index('ix_request_rows_custom_id', table_name='request_rows')
    # ALTER TABLE ... DROP COLUMN in place (SQLite has it since 3.35): a batch-mode rebuild of `batches` would drop
    # the old table, and with foreign keys on that cascades to every request row and attempt.
    op.drop_column('batches', 'cancelled')
