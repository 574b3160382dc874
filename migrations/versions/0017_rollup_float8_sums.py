"""The roll-up's sums also as float8 (``metric_steps.fsum_<field>``), what the charts read first:
aggregating numeric sums cost the chart query most of its time. Filled here from the exact
sums; a sum past the float limit is stored as an infinity (or NaN), which sends the chart back
to the exact sums (``service.chart_series``).

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


def _float8(column: str) -> str:
    """A numeric sum as float8: an infinity past the float limit, NaN below the smallest
    denormal (a plain cast fails on both), either of which sends the chart to the exact sums."""
    top = int(sys.float_info.max)  # written out: numeric compares it exactly
    return (f"CASE WHEN {column} = 'NaN' THEN 'NaN'::float8 WHEN {column} > {top} THEN 'Infinity'::float8 "
            f"WHEN {column} < -{top} THEN '-Infinity'::float8 "
            f"WHEN {column} <> 0 AND abs({column}) < 1e-323 THEN 'NaN'::float8 ELSE CAST({column} AS float8) END")


def upgrade() -> None:
    with op.batch_alter_table('metric_steps', schema=None) as batch_op:
        for name in FIELDS:
            batch_op.add_column(sa.Column(f'fsum_{name}', sa.Float(), nullable=True))
    postgresql = op.get_bind().dialect.name == 'postgresql'
    op.execute('UPDATE metric_steps SET ' + ', '.join(
        f"fsum_{name} = {_float8(f'sum_{name}') if postgresql else f'sum_{name}'}" for name in FIELDS))


def downgrade() -> None:
    with op.batch_alter_table('metric_steps', schema=None) as batch_op:
        for name in reversed(FIELDS):
            batch_op.drop_column(f'fsum_{name}')
