"""attempts: the partial output an evicted attempt keeps, tokens kept and recomputed, cached prompt tokens

Revision ID: 0005
Revises: 0004_files_expiry
Create Date: 2026-11-30 22:30:00
"""

from alembic import op
import sqlalchemy as sa

revision = '0005'
down_revision = '0004_files_expiry'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cached_tokens', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('partial_output', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('tokens_kept', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('tokens_recomputed', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_column('tokens_recomputed')
        batch_op.drop_column('tokens_kept')
        batch_op.drop_column('partial_output')
        batch_op.drop_column('cached_tokens')
