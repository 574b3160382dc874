"""Storing a request's metric batch: a few transactions of a job at a time in this process, each
carrying every batch of that job that arrived meanwhile.

[Note: one transaction for the batches that waited]
Ranks post at about the same time, and each transaction costs round trips and a commit
whatever its size. So a job has turns here (``IN_FLIGHT`` of them): a request that finds one
free takes it and stores at once, in the transaction its token check opened; one that finds
none queues its batch and waits. A turn's next holder stores every batch still queued (the
oldest first, up to ``COMBINED_RECORDS`` records) in one insert and one commit
(``metric_ingest.store_keys``), and each request gets its own answer: a record sent twice among
them is stored once and counted new for the first batch carrying it. Batches are combined only
with batches of the same token. Other replicas' ingests of the job run alongside (the job's
metric lock is shared between ingests: service.advisory_locks).

[Note: large batches too]
Each record costs the roll-up one row written (an insert or an update of its (attempt, step,
part) row) for every transaction that carries it; batches of several ranks stored together
share those rows, ranks of one part adding to one row once per transaction instead of once per
batch, and the roll-up's rows are much of the database's work per record. So a large batch
takes its turn like a small one: while one of the job's turns is free it is stored at once,
alone; only batches that arrive while ``IN_FLIGHT`` transactions of the job are under way in
this process wait, and are stored together.

[Note: how many together]
A queued batch waits for the transaction under way and then for its own, so the size of one
combined transaction bounds the wait: ``COMBINED_RECORDS`` keeps both short when a backlog has
built up (a pause of the database, a burst), while a transaction of several ranks' batches still
shares their roll-up rows. Larger transactions store a backlog with a little less work per
record, but let one request wait for two of them.

[Note: waiting without a connection]
A queued request first ends its token check's transaction, so it waits in this process holding
no pooled connection and no database lock; only the holders of the turns use connections. A
request whose batch was stored meanwhile just returns.

[Note: one bad batch]
Every batch was validated on its own before it queued (the request's body). Should a combined
transaction fail all the same, each of its batches is stored again alone, so only the one
that fails gets the error.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from service import metric_copy, metric_ingest
from service.schemas import MetricRecord

COMBINED_RECORDS = 8_000  # at most this many records in one combined insert (past one batch): [Note: how many together]
IN_FLIGHT = 1  # transactions of one job under way at once in this process: the more wait, the more share


@dataclass
class _Batch:
    records: list[MetricRecord]
    taken: bool = False  # in a transaction under way
    done: bool = False
    accepted: int | None = 0  # None: the token is no longer valid
    error: BaseException | None = None


@dataclass
class _Turn:
    changed: threading.Condition = field(default_factory=threading.Condition)
    held: int = 0  # transactions under way
    users: int = 0  # requests holding or waiting for this turn
    queued: list[_Batch] = field(default_factory=list)


_turns: dict[tuple[str, str], _Turn] = {}
_turns_lock = threading.Lock()


def queued(job_id: str) -> int:
    """Requests of ``job_id`` holding or waiting for their turn in this process."""
    with _turns_lock:
        return sum(turn.users for (job, _), turn in _turns.items() if job == job_id)


def store(session: Session, job_id: str, token_hash: str, records: list[MetricRecord]) -> int | None:
    """Store ``records`` (rows, roll-up, user values) and commit; return how many were new, or
    None when the job's ingest token ``token_hash`` is no longer valid (nothing is stored)."""
    batch = _Batch(records)
    with _turns_lock:
        turn = _turns.setdefault((job_id, token_hash), _Turn())
        turn.users += 1
    try:
        with turn.changed:
            turn.queued.append(batch)
            leads = turn.held < IN_FLIGHT
            turn.held += leads
        if not leads:
            session.commit()  # the token check's transaction ends: no connection held while waiting
            with turn.changed:
                turn.changed.wait_for(lambda: batch.taken or turn.held < IN_FLIGHT)
                leads = not batch.taken
                turn.held += leads
        if leads:
            try:
                while not batch.taken:  # a full combined insert may leave it for the next one
                    _store_queued(session, job_id, token_hash, turn)
            finally:
                with turn.changed:
                    turn.held -= 1
                    turn.changed.notify_all()
        with turn.changed:
            turn.changed.wait_for(lambda: batch.done)
    finally:
        with _turns_lock:
            turn.users -= 1
            if not turn.users:
                del _turns[(job_id, token_hash)]
    if batch.error is not None:
        raise batch.error
    return batch.accepted


def _store_queued(session: Session, job_id: str, token_hash: str, turn: _Turn) -> None:
    """Holding the turn: take the queued batches (the oldest first, the caller's among them) and
    store them in one transaction; each taken batch is done when this returns."""
    with turn.changed:
        taken, size = [], 0
        while turn.queued and (not taken or size + len(turn.queued[0].records) <= COMBINED_RECORDS):
            taken.append(turn.queued.pop(0))
            taken[-1].taken = True
            size += len(taken[-1].records)
    try:
        _store_together(session, job_id, token_hash, taken)
    except Exception as error:  # noqa: BLE001 -- [Note: one bad batch]
        session.rollback()
        if len(taken) == 1:
            taken[0].error = error
        else:
            for batch in taken:
                try:
                    _store_together(session, job_id, token_hash, [batch])
                except Exception as alone:  # noqa: BLE001 -- this request answers it
                    session.rollback()
                    batch.error = alone
    except BaseException as error:  # interrupted: every batch taken answers it
        for batch in taken:
            batch.error = error
        raise
    finally:
        with turn.changed:
            for batch in taken:
                batch.done = True
            turn.changed.notify_all()


def _store_together(session: Session, job_id: str, token_hash: str, batches: list[_Batch]) -> None:
    """One transaction for ``batches``; each gets its count of new records (or None)."""
    keys = _store_keys(session, job_id, token_hash, [record for batch in batches for record in batch.records])
    if keys is None:
        for batch in batches:
            batch.accepted = None
        return
    if len(keys) == sum(len(batch.records) for batch in batches):  # every record new: no count to match
        for batch in batches:
            batch.accepted = len(batch.records)
        return
    new = Counter(keys)
    for batch in batches:
        batch.accepted = 0
        for record in batch.records:
            key = (record.attempt, record.rank, record.step)
            if new[key]:
                new[key] -= 1
                batch.accepted += 1


def _store_keys(session: Session, job_id: str, token_hash: str, records: list[MetricRecord]
                ) -> list[tuple[int, int, int]] | None:
    """One transaction's records, stored and committed: through COPY on PostgreSQL from
    ``metric_copy.COPY_FROM`` records on (service.metric_copy), else in one statement with
    array parameters (service.metric_ingest); the (attempt, rank, step) of each new one, or
    None when the token is no longer valid."""
    if len(records) >= metric_copy.COPY_FROM and session.get_bind().dialect.name == "postgresql":
        return metric_copy.store_keys(session, job_id, token_hash, records)
    return metric_ingest.store_keys(session, job_id, token_hash, records)
