"""Evaluation loss on the metric rows; user-reported scalars and their names.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.add_column(sa.Column('eval_loss', sa.Float(), nullable=True))
    op.create_table('user_metric_names',
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'name')
    )
    op.create_table('user_metrics',
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'attempt', 'rank', 'step', 'name')
    )


def downgrade() -> None:
    op.drop_table('user_metrics')
    op.drop_table('user_metric_names')
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.drop_column('eval_loss')
