"""How far each job's TensorBoard event files go: the highest step written, and whether the
export of a finished job is complete (``service.tensorboard``).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tensorboard_step', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('tensorboard_done', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('tensorboard_done')
        batch_op.drop_column('tensorboard_step')
