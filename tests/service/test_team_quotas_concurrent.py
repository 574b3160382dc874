"""Two ``PUT /api/v1/teams/{team}/quota`` at once, on PostgreSQL through a real server: each
leaves a state one of them asked for, never a mix, and two shares that together exceed the
cluster are not both accepted.

The requests are made to overlap where a read-modify-write would lose one: the first to reach
its ``UPDATE teams`` waits there until the other has reached its own (the old code, which read
without a lock) or is seen waiting on a row lock in ``pg_stat_activity`` (a locking one).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import create_engine, event, text

from service.client import ValidationFailed
from tests.helpers.waiting import wait_for


class UpdateGate:
    """Holds the first ``UPDATE teams`` of the service until the second request catches up."""

    def __init__(self, service):
        self.engine = service.app.state.engine
        self.watcher = create_engine(service.database_url)
        self.database = service.database_url.rsplit("/", 1)[1]
        self.lock = threading.Lock()
        self.updates = 0
        self.held: list[bool] = []  # one entry per held UPDATE: whether the other request caught up
        event.listen(self.engine, "before_cursor_execute", self._before)

    def _lock_waiters(self) -> int:
        with self.watcher.connect() as connection:
            return connection.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = :db AND wait_event_type = 'Lock'"),
                {"db": self.database}).scalar_one()

    def _before(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if not statement.lstrip().upper().startswith("UPDATE TEAMS"):
            return
        with self.lock:
            self.updates += 1
            first = self.updates == 1
        if first:
            try:
                wait_for(lambda: self.updates > 1 or self._lock_waiters() > 0, 30, "the other request to catch up")
                self.held.append(True)
            except AssertionError:
                self.held.append(False)

    def close(self) -> None:
        event.remove(self.engine, "before_cursor_execute", self._before)
        self.watcher.dispose()


@pytest.fixture
def service(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    admin = service.client()
    for team in ("red", "blue"):
        admin.create_team(team)
    return service


def _at_once(service, *calls):
    gate = UpdateGate(service)
    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [pool.submit(call, service.client()) for call in calls]
            outcomes = []
            for future in futures:
                try:
                    outcomes.append(future.result())
                except ValidationFailed as refused:
                    outcomes.append(refused)
    finally:
        gate.close()
    assert gate.held == [True], "the two requests should have overlapped at the first UPDATE"
    return outcomes


def test_two_quota_puts_at_once_leave_one_of_them_not_a_mix(service):
    _at_once(service, lambda client: client.set_team_quota("red", gpus=4),
             lambda client: client.set_team_quota("red", cpus=8))
    quota = service.client().team_quota("red")
    assert (quota.gpus, quota.cpus) in {(4, None), (None, 8)}, f"a state neither PUT asked for: {quota}"


def test_two_shares_that_exceed_the_cluster_together_are_not_both_accepted(service):
    outcomes = _at_once(service, lambda client: client.set_team_quota("red", share=0.6),
                        lambda client: client.set_team_quota("blue", share=0.6))
    refused = [outcome for outcome in outcomes if isinstance(outcome, ValidationFailed)]
    assert len(refused) == 1 and "share" in str(refused[0]), outcomes
    admin = service.client()
    assert (admin.team_quota("red").share or 0) + (admin.team_quota("blue").share or 0) <= 1
