"""Two costs of every stored metric row taken out (``metrics``), for ingest at scale:

- **The job reference is checked once per statement, not once per row.** A foreign key checks
  each inserted row on its own (a lookup and a lock of the job's row per row): the largest
  single cost of a stored row on PostgreSQL. It becomes triggers that keep the same rule: an
  insert (or an update of ``job_id``) naming a job that does not exist fails with the foreign
  key's error code, and locks each job it names once (``FOR KEY SHARE``, as the foreign key
  does), so that a job cannot be deleted under a transaction still storing its rows; deleting
  a job deletes its rows, truncating ``jobs`` truncates them, and a job's id cannot change
  while rows name it. On PostgreSQL the insert check is a statement trigger reading the
  statement's inserted rows, the transition table the memory trigger (0018) already has
  PostgreSQL keep; on SQLite (single replica, small batches) row triggers.
- **One index fewer.** The unique key becomes (job, rank, step, attempt): the same rule, in an
  order that also serves the per-rank queries ``ix_metrics_job_rank_step`` was kept for, so
  that index goes.

A replica not yet upgraded keeps working beside this schema: its insert names no conflict
target (``ON CONFLICT DO NOTHING``: any unique key serves), and the triggers check its rows as
the foreign key did. The new unique index is built with writes to ``metrics`` blocked, as any
index built in a migration. On SQLite the table is rebuilt (``batch_alter_table``), which drops
its triggers: 0018's memory trigger is created again from that revision's text.

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

from alembic import context, op

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None

FK = 'metrics_job_id_fkey'  # the foreign key's name on PostgreSQL (0001 left it unnamed)
NEW_UNIQUE, OLD_UNIQUE = 'uq_metrics_job_rank_step_attempt', 'uq_metrics_job_attempt_rank_step'
NEW_KEY, OLD_KEY = ['job_id', 'rank', 'step', 'attempt'], ['job_id', 'attempt', 'rank', 'step']
RANK_STEP, RANK_STEP_KEY = 'ix_metrics_job_rank_step', ['job_id', 'rank', 'step']
MISSING = f'insert or update on table "metrics" violates foreign key constraint "{FK}"'
SQLITE_REFUSE = "SELECT RAISE(ABORT, 'FOREIGN KEY constraint failed')"  # SQLite's own foreign key message

PG_FUNCTIONS = (f"""
CREATE FUNCTION metrics_job_check() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    named text[];
    locked integer;
BEGIN
    SELECT array_agg(job_id) INTO named FROM (SELECT job_id FROM inserted GROUP BY job_id) AS jobs_named;
    SELECT count(*) INTO locked FROM (SELECT 1 FROM jobs WHERE id = ANY(named) FOR KEY SHARE) AS jobs_locked;
    IF locked < coalesce(cardinality(named), 0) THEN
        RAISE EXCEPTION '{MISSING}' USING ERRCODE = 'foreign_key_violation',
            DETAIL = 'A job_id is not present in table "jobs".';
    END IF;
    RETURN NULL;
END
$$""", f"""
CREATE FUNCTION jobs_metrics_cascade() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE metrics;
    ELSIF TG_OP = 'DELETE' THEN
        DELETE FROM metrics WHERE job_id IN (SELECT id FROM gone);
    ELSIF EXISTS (SELECT 1 FROM metrics WHERE job_id = OLD.id) THEN
        RAISE EXCEPTION 'update on table "jobs" violates foreign key constraint "{FK}" on table "metrics"'
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NULL;
END
$$""")
PG_TRIGGERS = (
    'CREATE TRIGGER metrics_job_check AFTER INSERT ON metrics REFERENCING NEW TABLE AS inserted '
    'FOR EACH STATEMENT EXECUTE FUNCTION metrics_job_check()',
    'CREATE TRIGGER metrics_job_check_update AFTER UPDATE ON metrics REFERENCING NEW TABLE AS inserted '
    'FOR EACH STATEMENT EXECUTE FUNCTION metrics_job_check()',
    'CREATE TRIGGER jobs_metrics_delete AFTER DELETE ON jobs REFERENCING OLD TABLE AS gone '
    'FOR EACH STATEMENT EXECUTE FUNCTION jobs_metrics_cascade()',
    'CREATE TRIGGER jobs_metrics_truncate BEFORE TRUNCATE ON jobs FOR EACH STATEMENT EXECUTE FUNCTION jobs_metrics_cascade()',
    'CREATE TRIGGER jobs_metrics_id_kept AFTER UPDATE OF id ON jobs FOR EACH ROW WHEN (OLD.id IS DISTINCT FROM NEW.id) '
    'EXECUTE FUNCTION jobs_metrics_cascade()',
)
SQLITE_TRIGGERS = (
    "CREATE TRIGGER metrics_job_check BEFORE INSERT ON metrics WHEN NOT EXISTS "
    f"(SELECT 1 FROM jobs WHERE id = NEW.job_id) BEGIN {SQLITE_REFUSE}; END",
    "CREATE TRIGGER metrics_job_check_update BEFORE UPDATE OF job_id ON metrics WHEN NOT EXISTS "
    f"(SELECT 1 FROM jobs WHERE id = NEW.job_id) BEGIN {SQLITE_REFUSE}; END",
    "CREATE TRIGGER jobs_metrics_delete AFTER DELETE ON jobs BEGIN DELETE FROM metrics WHERE job_id = OLD.id; END",
    "CREATE TRIGGER jobs_metrics_id_kept BEFORE UPDATE OF id ON jobs WHEN OLD.id IS NOT NEW.id AND EXISTS "
    f"(SELECT 1 FROM metrics WHERE job_id = OLD.id) BEGIN {SQLITE_REFUSE}; END",
)
SQLITE_NAMES = {'fk': 'fk_%(table_name)s_%(column_0_name)s'}  # names for 0001's unnamed foreign key


def _memory_trigger() -> str:
    """0018's SQLite memory trigger, which a rebuild of ``metrics`` drops: its revision's module,
    as Alembic loaded it."""
    return context.script.get_revision('0018').module.SQLITE_TRIGGER


def upgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.create_unique_constraint(NEW_UNIQUE, 'metrics', NEW_KEY)
        op.drop_constraint(OLD_UNIQUE, 'metrics', type_='unique')
        op.drop_index(RANK_STEP, table_name='metrics')
        for statement in (*PG_FUNCTIONS, *PG_TRIGGERS):
            op.execute(statement)
        op.drop_constraint(FK, 'metrics', type_='foreignkey')
        return
    with op.batch_alter_table('metrics', recreate='always', naming_convention=SQLITE_NAMES) as batch_op:
        batch_op.drop_constraint('fk_metrics_job_id', type_='foreignkey')
        batch_op.drop_constraint(OLD_UNIQUE, type_='unique')
        batch_op.create_unique_constraint(NEW_UNIQUE, NEW_KEY)
        batch_op.drop_index(RANK_STEP)
    for statement in (_memory_trigger(), *SQLITE_TRIGGERS):
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.create_foreign_key(FK, 'metrics', 'jobs', ['job_id'], ['id'], ondelete='CASCADE')
        for trigger in PG_TRIGGERS:
            name, table = trigger.split()[2], trigger.split(' ON ')[1].split()[0]
            op.execute(f'DROP TRIGGER {name} ON {table}')
        op.execute('DROP FUNCTION metrics_job_check()')
        op.execute('DROP FUNCTION jobs_metrics_cascade()')
        op.create_index(RANK_STEP, 'metrics', RANK_STEP_KEY)
        op.create_unique_constraint(OLD_UNIQUE, 'metrics', OLD_KEY)
        op.drop_constraint(NEW_UNIQUE, 'metrics', type_='unique')
        return
    for trigger in SQLITE_TRIGGERS:
        op.execute(f'DROP TRIGGER {trigger.split()[2]}')
    with op.batch_alter_table('metrics', recreate='always') as batch_op:
        batch_op.create_foreign_key('fk_metrics_job_id', 'jobs', ['job_id'], ['id'], ondelete='CASCADE')
        batch_op.drop_constraint(NEW_UNIQUE, type_='unique')
        batch_op.create_unique_constraint(OLD_UNIQUE, OLD_KEY)
        batch_op.create_index(RANK_STEP, RANK_STEP_KEY)
    op.execute(_memory_trigger())
