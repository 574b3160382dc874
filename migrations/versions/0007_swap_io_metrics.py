"""NVMe offload's per-step metrics: bytes kept in swap files, bytes read and written, and the
step's wait on that I/O (``contract.metrics``: mem_disk_bytes, io_read_bytes, io_write_bytes, io_wait_s).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

COLUMNS = ('mem_disk_bytes', 'io_read_bytes', 'io_write_bytes', 'io_wait_s')


def upgrade() -> None:
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)
