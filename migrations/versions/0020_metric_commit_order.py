"""Each metric row's writing transaction (``metrics.xid``), so that streams read a job's rows
in commit order without serializing its ingests (``service.stream_cursor``).

On PostgreSQL the column's default is the writing transaction's id (``pg_current_xact_id()``
as a bigint), so every writer fills it, a replica not yet upgraded included. Rows stored
before this revision read 0: older than any transaction still running. Adding the column with
the constant default first and setting the volatile one afterwards changes only the
catalogue (no table rewrite); the new index is built with writes to ``metrics`` blocked, as
any index built in a migration. On SQLite (one writer, ids already in commit order) the
column stays 0.

The index ``(job_id, xid, id)`` is the streams' order; it replaces ``(job_id, id)``, whose
readers (a not-yet-upgraded replica's stream, ``after_id`` listing) fall back to the primary
key, fast for a recent cursor.

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None

PG_DEFAULT = 'CAST(CAST(pg_current_xact_id() AS text) AS bigint)'


def upgrade() -> None:
    op.add_column('metrics', sa.Column('xid', sa.BigInteger(), server_default='0', nullable=False))
    if op.get_bind().dialect.name == 'postgresql':
        op.execute(f'ALTER TABLE metrics ALTER COLUMN xid SET DEFAULT {PG_DEFAULT}')
    op.create_index('ix_metrics_job_xid_id', 'metrics', ['job_id', 'xid', 'id'])
    op.drop_index('ix_metrics_job_id_id', table_name='metrics')


def downgrade() -> None:
    op.create_index('ix_metrics_job_id_id', 'metrics', ['job_id', 'id'])
    op.drop_index('ix_metrics_job_xid_id', table_name='metrics')
    op.execute('ALTER TABLE metrics DROP COLUMN xid')  # SQLite too (3.35+): no table rebuild, triggers kept
