"""batches.trace_context: the W3C traceparent that later work on a batch continues its trace from

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 01:40:00
"""

from alembic import op
import sqlalchemy as sa

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('trace_context', sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('trace_context')
