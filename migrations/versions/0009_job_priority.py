"""A job's priority as a column (the spec's ``priority``), so that the admitter reads the queue
in its order (priority, then submission) from an index.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('priority', sa.Integer(), nullable=False, server_default='0'))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.alter_column('priority', server_default=None)
    op.create_index('ix_jobs_queue', 'jobs', ['state', 'priority', 'pk'])


def downgrade() -> None:
    op.drop_index('ix_jobs_queue', table_name='jobs')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('priority')
