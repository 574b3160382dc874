"""The roll-up's sums also as floats (``metric_steps.fsum_<field>``), what the charts read
first: aggregating the numeric sums took most of the chart query's time.

On PostgreSQL each is a stored generated column, the float8 of the exact numeric sum: the
database keeps it with every write of the sum, whichever code writes it (a replica not yet
upgraded included). Where a plain cast would fail, it holds an infinity (a sum past the float
limit) or NaN (below the smallest denormal); NaN also for a NaN sum. Any of these makes the
chart read the exact sums instead (``service.chart_series``). On SQLite the sums are floats
already: plain columns, written by ingest and filled here.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sys

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

# the charted fields of the metric table when this revision was written
FIELDS = ('loss', 'eval_loss', 'step_time_s', 'tokens_per_s', 'tflops', 'mfu', 'comm_bytes', 'comm_exposed_s',
          'io_wait_s')


def float8_of(column: str) -> str:
    """PostgreSQL: a numeric sum as float8, never failing (see the module's docstring)."""
    top = int(sys.float_info.max)  # written out in full: numeric compares it exactly
    return (f"CASE WHEN {column} = 'NaN' THEN 'NaN'::float8 WHEN {column} > {top} THEN 'Infinity'::float8 "
            f"WHEN {column} < -{top} THEN '-Infinity'::float8 "
            f"WHEN {column} <> 0 AND abs({column}) < 1e-323 THEN 'NaN'::float8 ELSE CAST({column} AS float8) END")


def upgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        for name in FIELDS:  # ADD COLUMN … STORED computes it for every stored row
            op.add_column('metric_steps', sa.Column(f'fsum_{name}', sa.Float(),
                                                    sa.Computed(float8_of(f'sum_{name}'), persisted=True)))
        return
    with op.batch_alter_table('metric_steps', schema=None) as batch_op:
        for name in FIELDS:
            batch_op.add_column(sa.Column(f'fsum_{name}', sa.Float(), nullable=True))
    op.execute('UPDATE metric_steps SET ' + ', '.join(f'fsum_{name} = sum_{name}' for name in FIELDS))


def downgrade() -> None:
    with op.batch_alter_table('metric_steps', schema=None) as batch_op:
        for name in reversed(FIELDS):
            batch_op.drop_column(f'fsum_{name}')
