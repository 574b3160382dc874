"""``SharedStreamSlots`` under concurrent opens: the takes of one replica share one connection and
one set of held slots, so many threads taking and releasing at once must neither hand one slot
to two streams nor count past the bound ([Note: slots are advisory locks])."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi import HTTPException
from sqlalchemy import create_engine

from service.stream_slots import SharedStreamSlots

BOUND = 12
THREADS = 16
OPENS = 48  # four times the bound: most are refused


@pytest.fixture
def slots(postgres_url: str):
    engine = create_engine(postgres_url)
    shared = SharedStreamSlots(engine, max_per_user=BOUND, poll_threads=4)
    try:
        yield shared
    finally:
        shared.close()
        engine.dispose()


def take_at_once(slots: SharedStreamSlots, user: str) -> list:
    """``OPENS`` takes of ``user`` from ``THREADS`` threads released together: the releases of
    those that got a slot, and how many were refused (429)."""
    go = threading.Barrier(THREADS)

    def take(index: int):
        if index < THREADS:
            go.wait()
        try:
            return slots.take(user)
        except HTTPException as refused:
            assert refused.status_code == 429
            return None

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(take, range(OPENS)))


def test_concurrent_opens_take_each_slot_once_and_concurrent_closes_free_every_one(slots) -> None:
    for _ in range(3):
        results = take_at_once(slots, "alice")
        releases = [release for release in results if release is not None]
        assert len(releases) == BOUND, f"{len(releases)} streams got a slot, the bound is {BOUND}"
        assert sorted(slots._held["alice"]) == list(range(1, BOUND + 1))
        assert slots.open_count("alice") == BOUND  # PostgreSQL's count: one lock per stream
        with ThreadPoolExecutor(THREADS) as pool:  # every stream closes at once, each release twice
            list(pool.map(lambda release: release(), releases + releases))
        assert slots.open_count("alice") == 0
        assert not slots._held["alice"]
