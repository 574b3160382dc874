"""Webhooks and their deliveries (``service.webhooks``): a registered URL per user, and an outbox
row per event to send, written with the transition it announces.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')  # SQLite autoincrements INTEGER only


def upgrade() -> None:
    op.create_table(
        'webhooks',
        sa.Column('id', BIG_ID, primary_key=True, autoincrement=True),
        sa.Column('owner', sa.String(100), nullable=False),
        sa.Column('url', sa.Text(), nullable=False),
        sa.Column('events', sa.JSON(), nullable=False),
        sa.Column('secret', sa.String(200), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index('ix_webhooks_owner', 'webhooks', ['owner'])
    op.create_table(
        'webhook_deliveries',
        sa.Column('id', sa.String(40), primary_key=True),
        sa.Column('webhook_id', BIG_ID, sa.ForeignKey('webhooks.id', ondelete='CASCADE'), nullable=False),
        sa.Column('job_id', sa.String(40), nullable=False),
        sa.Column('event', sa.String(40), nullable=False),
        sa.Column('body', sa.Text(), nullable=False),
        sa.Column('status', sa.String(16), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_status_code', sa.Integer(), nullable=True),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index('ix_webhook_deliveries_webhook_id', 'webhook_deliveries', ['webhook_id'])
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['status', 'next_attempt_at'])


def downgrade() -> None:
    op.drop_table('webhook_deliveries')
    op.drop_table('webhooks')
