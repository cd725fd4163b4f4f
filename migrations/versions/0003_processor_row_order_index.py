"""processor: index request rows by (batch, status, line) for window refill and finalization

Revision ID: 0003
Revises: 0001
Create Date: 2026-11-29 18:00:00
"""

from alembic import op

revision = '0003'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('request_rows', schema=None) as batch_op:
        batch_op.create_index('ix_request_rows_batch_status_line', ['batch_id', 'status', 'line'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('request_rows', schema=None) as batch_op:
        batch_op.drop_index('ix_request_rows_batch_status_line')
