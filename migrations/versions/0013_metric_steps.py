"""The per-step roll-up of metric records the charts read (``metric_steps``), filled from the
records already stored.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None

# the charted fields of the metric table when this revision was written
FIELDS = ('loss', 'eval_loss', 'step_time_s', 'tokens_per_s', 'tflops', 'mfu', 'comm_bytes', 'comm_exposed_s',
          'io_wait_s')
PARTS = 16


def upgrade() -> None:
    total = sa.Float().with_variant(sa.Numeric(), 'postgresql')
    columns = []
    for name in FIELDS:
        columns += [sa.Column(f'sum_{name}', total, nullable=True),
                    sa.Column(f'n_{name}', sa.Integer(), nullable=False, server_default='0')]
    op.create_table(
        'metric_steps',
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('part', sa.Integer(), nullable=False),
        sa.Column('records', sa.Integer(), nullable=False),
        sa.Column('last_id', sa.BigInteger(), nullable=False),
        sa.Column('world_size', sa.Integer(), nullable=True),
        *columns,
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id', 'attempt', 'step', 'part'),
    )
    numeric = op.get_bind().dialect.name == 'postgresql'
    sums = ', '.join(f"SUM(CAST({name} AS {'numeric' if numeric else 'real'})), COUNT({name})" for name in FIELDS)
    names = ', '.join(f'sum_{name}, n_{name}' for name in FIELDS)
    op.execute(
        f'INSERT INTO metric_steps (job_id, attempt, step, part, records, last_id, world_size, {names}) '
        f'SELECT job_id, attempt, step, "rank" % {PARTS}, COUNT(*), MAX(id), MAX(world_size), {sums} '
        f'FROM metrics GROUP BY job_id, attempt, step, "rank" % {PARTS}')


def downgrade() -> None:
    op.drop_table('metric_steps')
