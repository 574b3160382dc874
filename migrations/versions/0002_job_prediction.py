"""Jobs keep the planner's memory prediction and the predicted-vs-measured check.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('prediction', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('memory_check', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('memory_check')
        batch_op.drop_column('prediction')
