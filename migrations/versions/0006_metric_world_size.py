"""The world size of a metric record's attempt: an elastic job's attempts run at different sizes,
and a chart's job total (``Across.TOTAL``) is a rank's share times that size, not ``num_workers``.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.add_column(sa.Column('world_size', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.drop_column('world_size')
