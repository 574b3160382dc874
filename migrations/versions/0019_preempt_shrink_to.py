"""Preemption by shrinking (``service.preemption``): the worker count an elastic job was asked
to shrink to for the job in ``preempt_for``; it stays set, as a cap on the job's size, while
that job holds or waits for the workers it freed.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('preempt_shrink_to', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('preempt_shrink_to')
