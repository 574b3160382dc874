"""The leader lease of replicated control planes (``service.leadership``): one row naming the
replica that runs the scheduler, its fencing epoch, and when its lease runs out.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'leader_lease',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('holder', sa.String(length=200), nullable=False),
        sa.Column('epoch', sa.BigInteger(), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    # the one row, expired from the start: the first replica to ask takes it with epoch 1
    op.execute("INSERT INTO leader_lease (id, holder, epoch, expires_at) "
               "VALUES (1, '', 0, '1970-01-01 00:00:00+00:00')")


def downgrade() -> None:
    op.drop_table('leader_lease')
