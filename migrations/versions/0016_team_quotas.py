"""Per-team quotas: GPUs, CPUs, running jobs, the highest priority, a guaranteed share
(``contract.quotas``), one nullable column each on ``teams``.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

COLUMNS = (('quota_gpus', sa.Float()), ('quota_cpus', sa.Float()), ('quota_running_jobs', sa.Integer()),
           ('quota_max_priority', sa.Integer()), ('quota_share', sa.Float()))


def upgrade() -> None:
    with op.batch_alter_table('teams', schema=None) as batch_op:
        for name, kind in COLUMNS:
            batch_op.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('teams', schema=None) as batch_op:
        for name, _kind in reversed(COLUMNS):
            batch_op.drop_column(name)
