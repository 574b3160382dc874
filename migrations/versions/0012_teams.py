"""Teams and their members, and the team a job belongs to (``contract.teams``).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'teams',
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('created_by', sa.String(length=100), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )
    op.create_table(
        'team_members',
        sa.Column('team', sa.String(length=64), nullable=False),
        sa.Column('user', sa.String(length=100), nullable=False),
        sa.Column('role', sa.String(length=16), nullable=False),
        sa.Column('added_by', sa.String(length=100), nullable=False),
        sa.Column('added_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['team'], ['teams.name'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('team', 'user'),
    )
    op.create_index('ix_team_members_user', 'team_members', ['user'])
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('team', sa.String(length=64), nullable=True))
        batch_op.create_index('ix_jobs_team', ['team'])


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_team')
        batch_op.drop_column('team')
    op.drop_index('ix_team_members_user', table_name='team_members')
    op.drop_table('team_members')
    op.drop_table('teams')
