"""retention: index files by expires_at so the collector's bounded steps do not scan the table

Revision ID: 0004_files_expiry
Revises: 0003
Create Date: 2026-11-30 22:30:00
"""

from alembic import op

revision = '0004_files_expiry'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.create_index('ix_files_expires_at', ['expires_at'], unique=False)
        batch_op.create_index('ix_files_deleted_at', ['deleted_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_index('ix_files_deleted_at')
        batch_op.drop_index('ix_files_expires_at')
