"""Preemption (``service.preemption``): the job a running job was asked to make room for, and
when it was asked.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('preempt_for', sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column('preempt_requested_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('preempt_requested_at')
        batch_op.drop_column('preempt_for')
