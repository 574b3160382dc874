"""Which replica leads: a lease row on PostgreSQL with a fencing epoch.

Any number of ``zerotrain serve`` processes may share one PostgreSQL database; all serve the
API and the streams, but only the holder of the lease runs the scheduler, the admitter, the
monitor and the webhook sender. The lease is the one row of ``leader_lease`` (migration
0011): ``holder``, ``epoch`` and ``expires_at``.

``Lease.renew`` takes or keeps it with one conditional UPDATE: it matches when the lease has
run out or is still this replica's own, and sets ``expires_at`` to the database clock plus
``leader_lease_s``. Whenever the holder changes (or an own lease had run out), ``epoch`` goes
up by one: writes made under an older epoch can be told from the current leader's. The renew
thread asks every ``leader_renew_s`` (a third of the lease by default), so a dead leader's
duties move to another replica within one lease plus one renew interval.

[Note: fencing]
A leader that is paused (SIGSTOP, a long GC, a frozen VM) past its lease and then resumes
still believes it leads until its next renew. So every write the leader's duties make goes
through ``begin`` and ``commit`` of its session:

- ``begin`` sets ``idle_in_transaction_session_timeout`` to the fence margin (a third of the
  lease) for this transaction only, and checks the lease;
- ``commit`` checks the lease again, in the same transaction, just before committing.

The check (``epoch`` is ours and ``expires_at`` is more than the margin ahead of the database
clock) runs on the database, never on this process's clock. A replica paused after the check
is idle in its transaction, so PostgreSQL ends that transaction after the margin, before its
lease can have run out: a stale write either commits while the lease is still its own or
not at all. The same timeout frees the row and advisory locks a paused leader held, so the
next leader is not blocked by them. The check takes no lock on the lease row: a paused
replica cannot hold up a take-over.

[Note: SQLite] SQLite is single-replica: ``zerotrain serve`` with its scheduler (and
``zerotrain scheduler``) hold an exclusive ``flock`` on ``<database>.replica-lock`` for their lifetime
(``hold_sole_replica``), so a second one on the same file says so at start and exits with
status 2; the kernel frees the lock when a process dies, so a restart after a crash is not
held up. There ``make_lease`` returns ``SOLE_LEADER``, which always leads and fences nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service.db import is_sqlite
from service.poll_loop import PollLoop
from service.settings import Settings, env_var

log = logging.getLogger(__name__)

_RENEW = text("""
UPDATE leader_lease
   SET epoch = CASE WHEN holder = :holder AND epoch = :epoch AND expires_at > clock_timestamp()
                    THEN epoch ELSE epoch + 1 END,
       holder = :holder,
       expires_at = clock_timestamp() + make_interval(secs => :lease_s)
 WHERE id = 1 AND (expires_at <= clock_timestamp() OR (holder = :holder AND epoch = :epoch))
RETURNING epoch""")
_CHECK = text("""
SELECT 1 FROM leader_lease
 WHERE id = 1 AND holder = :holder AND epoch = :epoch
   AND expires_at > clock_timestamp() + make_interval(secs => :margin_s)""")
_RELEASE = text("""
UPDATE leader_lease SET expires_at = clock_timestamp()
 WHERE id = 1 AND holder = :holder AND epoch = :epoch""")


class LeadershipLost(RuntimeError):
    """This replica no longer holds the lease: the write it was about to make is abandoned."""


class SoleLeader:
    """The lease of a single-replica service (SQLite, or a scheduler driven by hand): always
    the leader; ``begin`` and ``commit`` fence nothing."""

    holder = "sole"
    epoch = 1

    def is_leader(self) -> bool:
        return True

    def begin(self, session: Session) -> None:
        """Nothing to check."""

    def commit(self, session: Session) -> None:
        session.commit()

    def start(self) -> None:
        """Nothing to renew."""

    def stop(self, timeout: float = 30.0) -> None:
        """Nothing to hand over."""


SOLE_LEADER = SoleLeader()


class Lease:
    """This replica's claim on the leader lease (module docstring)."""

    def __init__(self, make_session: sessionmaker[Session], holder: str, *, lease_s: float,
                 renew_s: float | None = None, on_gain: Callable[[], None] | None = None):
        self.make_session = make_session
        self.holder = holder
        self.lease_s = lease_s
        self.renew_s = renew_s or lease_s / 3
        self.margin_s = lease_s / 3  # the fence's margin and the fenced transactions' idle timeout
        self.on_gain = on_gain
        self.epoch: int | None = None  # the epoch this replica leads under; None: it does not lead
        self._valid_until = 0.0  # time.monotonic() by which the lease has run out at the latest
        self._lock = threading.Lock()
        self._loop = PollLoop("zerotrain-leader-lease", self.renew, self.renew_s)

    # ------------------------------------------------------------------ holding the lease

    def renew(self) -> bool:
        """Take the lease if it is free or ours, and extend it; True while this replica leads."""
        asked_at = time.monotonic()
        try:
            with self.make_session() as session:
                epoch = session.execute(_RENEW, {"holder": self.holder, "epoch": self.epoch,
                                                 "lease_s": self.lease_s}).scalar_one_or_none()
                session.commit()
        except Exception:
            log.warning("renewing the leader lease failed", exc_info=True)
            return self.is_leader()  # the lease may still hold until it runs out
        with self._lock:
            gained = epoch is not None and epoch != self.epoch
            lost = epoch is None and self.epoch is not None
            self.epoch = epoch
            self._valid_until = asked_at + self.lease_s if epoch is not None else 0.0
        if gained:
            log.warning("%s leads (epoch %d)", self.holder, epoch)
            if self.on_gain is not None:
                self.on_gain()
        elif lost:
            log.warning("%s no longer leads", self.holder)
        return epoch is not None

    def is_leader(self) -> bool:
        """Whether this replica may act as the leader, by its own clock (the fence is the
        database's word; this only spares a replica that does not lead the attempt)."""
        with self._lock:
            return self.epoch is not None and time.monotonic() < self._valid_until

    def release(self) -> None:
        """Let the lease run out now (a clean shutdown): another replica takes over at its next
        renew instead of after a whole lease."""
        epoch, self.epoch = self.epoch, None
        if epoch is None:
            return
        try:
            with self.make_session() as session:
                session.execute(_RELEASE, {"holder": self.holder, "epoch": epoch})
                session.commit()
        except Exception:  # the lease then runs out by itself
            log.warning("releasing the leader lease failed", exc_info=True)

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._loop.stop(timeout)
        self.release()

    # ------------------------------------------------------------------ fencing

    def begin(self, session: Session) -> None:
        """Open a fenced transaction on ``session``: idle timeout, then the lease check."""
        session.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {int(self.margin_s * 1000)}"))
        self._check(session)

    def commit(self, session: Session) -> None:
        """Check the lease in the transaction, then commit; ``LeadershipLost`` (rolled back) if it is gone."""
        self._check(session)
        session.commit()

    def _check(self, session: Session) -> None:
        epoch = self.epoch
        held = epoch is not None and session.execute(
            _CHECK, {"holder": self.holder, "epoch": epoch, "margin_s": self.margin_s}).first() is not None
        if not held:
            session.rollback()
            raise LeadershipLost(f"{self.holder} does not hold the leader lease (epoch {epoch})")


def make_lease(make_session: sessionmaker[Session], holder: str, settings: Settings, *,
               on_gain: Callable[[], None] | None = None) -> Lease | SoleLeader:
    """The lease a replica on ``settings.database_url`` competes for: ``SOLE_LEADER`` on SQLite."""
    if is_sqlite(settings.database_url):
        return SOLE_LEADER
    return Lease(make_session, holder, lease_s=settings.leader_lease_s, renew_s=settings.leader_renew_s,
                 on_gain=on_gain)


class AnotherReplica(RuntimeError):
    """A second control plane on a SQLite database, which one process at a time may serve."""


def hold_sole_replica(database_url: str) -> int | None:
    """On SQLite: lock the database for this process (see [Note: SQLite]) and return the lock's
    file descriptor, to keep open while serving; ``AnotherReplica`` if another process holds it.
    None on PostgreSQL, where replicas share the lease instead."""
    if not is_sqlite(database_url):
        return None
    database = make_url(database_url).database
    if not database or database == ":memory:":
        return None
    path = f"{database}.replica-lock"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AnotherReplica(
            f"another zerotrain control plane already serves the SQLite database {database}: SQLite "
            f"runs a single replica (several replicas need PostgreSQL: {env_var('database_url')}; a second "
            f"process that serves only the API may run with {env_var('scheduler_enabled')}=false)") from None
    return fd
