"""Each rank's latest memory report per attempt (``metric_memory``), what the job page's
memory bars read instead of walking the metric rows; filled from the rows already stored.

It is kept by a trigger on ``metrics`` in the database itself, so every insert keeps it right
whichever code writes the rows: a replica not yet upgraded, ingest, a bulk load. On PostgreSQL
a statement trigger reads the statement's inserted rows (a transition table) and upserts one
row per (job, attempt, rank), the one of its latest step; on SQLite (single replica, small
batches) a row trigger does the same per inserted row. The upsert keeps the stored row unless
the new one's step is later. Creating the trigger locks ``metrics`` against writes until this
migration commits (PostgreSQL), so the fill below and the trigger miss no row and count none
twice.

A later migration that rebuilds ``metrics`` on SQLite (``batch_alter_table``) drops its
triggers, and must create ``SQLITE_TRIGGER`` again.

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

# the memory fields of the metric table when this revision was written (the bars' numbers)
FIELDS = ('mem_params_bytes', 'mem_grads_bytes', 'mem_optimizer_bytes', 'mem_buffers_bytes', 'mem_peak_bytes',
          'mem_disk_bytes')
REPORTED = 'mem_params_bytes'  # a record reports memory when it holds this one
COLUMNS = '"rank", step, ' + ', '.join(FIELDS)
UPDATE = 'step = excluded.step, ' + ', '.join(f'{name} = excluded.{name}' for name in FIELDS)

PG_FUNCTION = f"""
CREATE FUNCTION metric_memory_keep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO metric_memory (job_id, attempt, {COLUMNS})
    SELECT DISTINCT ON (job_id, attempt, "rank") job_id, attempt, {COLUMNS}
    FROM inserted WHERE {REPORTED} IS NOT NULL
    ORDER BY job_id, attempt, "rank", step DESC
    ON CONFLICT (job_id, attempt, "rank") DO UPDATE SET {UPDATE}
    WHERE metric_memory.step < excluded.step;
    RETURN NULL;
END
$$"""
PG_TRIGGER = ('CREATE TRIGGER metric_memory_keep AFTER INSERT ON metrics REFERENCING NEW TABLE AS inserted '
              'FOR EACH STATEMENT EXECUTE FUNCTION metric_memory_keep()')
SQLITE_TRIGGER = f"""
CREATE TRIGGER metric_memory_keep AFTER INSERT ON metrics WHEN NEW.{REPORTED} IS NOT NULL BEGIN
    INSERT INTO metric_memory (job_id, attempt, {COLUMNS})
    VALUES (NEW.job_id, NEW.attempt, NEW."rank", NEW.step, {', '.join(f'NEW.{name}' for name in FIELDS)})
    ON CONFLICT (job_id, attempt, "rank") DO UPDATE SET {UPDATE}
    WHERE metric_memory.step < excluded.step;
END"""


def upgrade() -> None:
    op.create_table(
        'metric_memory',
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=True) for name in FIELDS),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id', 'attempt', 'rank'),
    )
    if op.get_bind().dialect.name == 'postgresql':
        op.execute(PG_FUNCTION)
        op.execute(PG_TRIGGER)
    else:
        op.execute(SQLITE_TRIGGER)
    op.execute(
        f'INSERT INTO metric_memory (job_id, attempt, {COLUMNS}) SELECT job_id, attempt, {COLUMNS} FROM ('
        f'SELECT *, ROW_NUMBER() OVER (PARTITION BY job_id, attempt, "rank" ORDER BY step DESC) AS latest '
        f'FROM metrics WHERE {REPORTED} IS NOT NULL) AS reports WHERE latest = 1')


def downgrade() -> None:
    op.execute('DROP TRIGGER metric_memory_keep' + (' ON metrics' if op.get_bind().dialect.name == 'postgresql' else ''))
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('DROP FUNCTION metric_memory_keep()')
    op.drop_table('metric_memory')
