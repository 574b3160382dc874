"""Storing a request's metric batch: one transaction per job at a time, carrying every batch of
that job that arrived meanwhile.

``metric_ingest.insert_new_keys`` holds the job's metric lock in the database until commit
(service.advisory_locks), so one job's ingests go one at a time whatever this module does.

[Note: waiting without a connection]
Waiting for that lock in the database would hold a pooled connection: a job's ranks posting at
once would take every connection, and the service's other requests would time out (503). So
``store`` ends the request's transaction (the token check) first and waits for the job's turn
in this process, connection-free; only the holder of the turn uses a connection, and across
replicas at most one per replica waits in the database. A waiting request still holds its
server thread, as it did while its insert ran concurrently.

[Note: one transaction for the batches that waited]
Batches of one job would otherwise be stored one transaction each, in line. A request queues
its batch, then waits for the turn; the holder stores its own batch and every batch still
queued (up to ``COMBINED_RECORDS`` records) in one insert and one commit, and tells each
request its answer; a request whose batch was stored meanwhile just returns. A record sent
twice in one combined insert is stored once and counted new for the first batch that carries
it. An error fails every batch of that transaction (their requests answer it; workers resend).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from service import metric_ingest, user_metrics
from service.schemas import MetricRecord

COMBINED_RECORDS = 20_000  # at most this many records in one combined insert (past one batch)


@dataclass
class _Batch:
    records: list[MetricRecord]
    done: bool = False
    accepted: int = 0
    error: BaseException | None = None


@dataclass
class _Turn:
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0  # requests holding or waiting for this turn
    queued: list[_Batch] = field(default_factory=list)


_turns: dict[str, _Turn] = {}
_turns_lock = threading.Lock()


def queued(job_id: str) -> int:
    """Requests of ``job_id`` holding or waiting for their turn in this process."""
    with _turns_lock:
        turn = _turns.get(job_id)
        return turn.users if turn is not None else 0


def store(session: Session, job_id: str, records: list[MetricRecord]) -> int:
    """Store ``records`` (rows, roll-up, user values) and commit; return how many were new."""
    session.commit()  # the token check's transaction ends: no connection held while waiting
    batch = _Batch(records)
    with _turns_lock:
        turn = _turns.setdefault(job_id, _Turn())
        turn.users += 1
        turn.queued.append(batch)
    try:
        with turn.lock:
            while not batch.done:  # a full combined insert may leave it for the next one
                _store_queued(session, job_id, turn)
    finally:
        with _turns_lock:
            turn.users -= 1
            if not turn.users:
                del _turns[job_id]
    if batch.error is not None:
        raise batch.error
    return batch.accepted


def _store_queued(session: Session, job_id: str, turn: _Turn) -> None:
    """Under the turn: take the queued batches (the oldest first, the caller's among them) and
    store them in one transaction."""
    with _turns_lock:
        taken, size = [], 0
        while turn.queued and (not taken or size + len(turn.queued[0].records) <= COMBINED_RECORDS):
            taken.append(turn.queued.pop(0))
            size += len(taken[-1].records)
    records = [record for batch in taken for record in batch.records]
    try:
        new = Counter(metric_ingest.insert_new_keys(session, job_id, records))  # first: the job's metric lock
        user_metrics.store(session, job_id, records)
        session.commit()
    except BaseException as error:  # noqa: BLE001 -- every batch taken gets its answer, this one too
        session.rollback()
        for batch in taken:
            batch.error, batch.done = error, True
        return
    for batch in taken:
        for record in batch.records:
            key = (record.attempt, record.rank, record.step)
            if new[key]:
                new[key] -= 1
                batch.accepted += 1
        batch.done = True
