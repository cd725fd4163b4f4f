"""initial schema: tenants, keys, files, batches, request rows, attempts

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 16:35:43.138562
"""

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('tenants',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('revoked_at', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_hash')
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('batches',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('input_file_id', sa.String(length=40), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('window_seconds', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('errors', sa.JSON(), nullable=True),
    sa.Column('output_expires_after', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('in_progress_at', sa.BigInteger(), nullable=True),
    sa.Column('expires_at', sa.BigInteger(), nullable=True),
    sa.Column('finalizing_at', sa.BigInteger(), nullable=True),
    sa.Column('completed_at', sa.BigInteger(), nullable=True),
    sa.Column('failed_at', sa.BigInteger(), nullable=True),
    sa.Column('expired_at', sa.BigInteger(), nullable=True),
    sa.Column('cancelling_at', sa.BigInteger(), nullable=True),
    sa.Column('cancelled_at', sa.BigInteger(), nullable=True),
    sa.Column('output_file_id', sa.String(length=40), nullable=True),
    sa.Column('error_file_id', sa.String(length=40), nullable=True),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('completed', sa.Integer(), nullable=False),
    sa.Column('failed', sa.Integer(), nullable=False),
    sa.Column('input_tokens', sa.BigInteger(), nullable=False),
    sa.Column('cached_tokens', sa.BigInteger(), nullable=False),
    sa.Column('output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('reasoning_tokens', sa.BigInteger(), nullable=False),
    sa.Column('claimed_by', sa.String(length=128), nullable=True),
    sa.Column('lease_until', sa.Float(), nullable=True),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index('ix_batches_status', ['status'], unique=False)
        batch_op.create_index('ix_batches_tenant_seq', ['tenant_id', 'seq'], unique=False)

    op.create_table('files',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('filename', sa.String(length=512), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('expires_at', sa.BigInteger(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('storage_key', sa.String(length=256), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('deleted_at', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.create_index('ix_files_tenant_created', ['tenant_id', 'created_at'], unique=False)

    op.create_table('request_rows',
    sa.Column('id', sa.String(length=48), nullable=False),
    sa.Column('batch_id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.String(length=512), nullable=False),
    sa.Column('url', sa.String(length=64), nullable=False),
    sa.Column('body', sa.Text(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('evictions', sa.Integer(), nullable=False),
    sa.Column('transient_failures', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', sa.Float(), nullable=True),
    sa.Column('enqueued_at', sa.Float(), nullable=True),
    sa.Column('response_status', sa.Integer(), nullable=True),
    sa.Column('response_body', sa.Text(), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('input_tokens', sa.Integer(), nullable=False),
    sa.Column('cached_tokens', sa.Integer(), nullable=False),
    sa.Column('output_tokens', sa.Integer(), nullable=False),
    sa.Column('reasoning_tokens', sa.Integer(), nullable=False),
    sa.Column('duplicates', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('batch_id', 'custom_id', name='uq_request_rows_batch_custom_id')
    )
    with op.batch_alter_table('request_rows', schema=None) as batch_op:
        batch_op.create_index('ix_request_rows_batch_status', ['batch_id', 'status'], unique=False)
        batch_op.create_index('ix_request_rows_status_next', ['status', 'next_attempt_at'], unique=False)

    op.create_table('attempts',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('request_id', sa.String(length=48), nullable=False),
    sa.Column('batch_id', sa.String(length=40), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('worker', sa.String(length=128), nullable=True),
    sa.Column('replica', sa.String(length=256), nullable=True),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('ended_at', sa.Float(), nullable=True),
    sa.Column('outcome', sa.String(length=24), nullable=True),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('drop_reason', sa.String(length=64), nullable=True),
    sa.Column('evicted', sa.Boolean(), nullable=False),
    sa.Column('input_tokens', sa.Integer(), nullable=False),
    sa.Column('output_tokens', sa.Integer(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['request_id'], ['request_rows.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('request_id', 'number', name='uq_attempts_request_number')
    )
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_attempts_batch_id'), ['batch_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_attempts_request_id'), ['request_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_attempts_request_id'))
        batch_op.drop_index(batch_op.f('ix_attempts_batch_id'))

    op.drop_table('attempts')
    with op.batch_alter_table('request_rows', schema=None) as batch_op:
        batch_op.drop_index('ix_request_rows_status_next')
        batch_op.drop_index('ix_request_rows_batch_status')

    op.drop_table('request_rows')
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_index('ix_files_tenant_created')

    op.drop_table('files')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index('ix_batches_tenant_seq')
        batch_op.drop_index('ix_batches_status')

    op.drop_table('batches')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_tenant_id'))

    op.drop_table('api_keys')
    op.drop_table('tenants')
