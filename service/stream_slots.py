"""Bounds on long-lived event streams, so that streams cannot slow anyone's other requests.

Each stream polls the database from a worker thread. Sharing the thread pool (and so the
database connections) that every ordinary request runs in, without a bound on how many a user
may open, enough streams would slow everyone's other requests (docs/design.md, "Measurements").
So:

- each user holds at most ``max_per_user`` open streams; one more is refused with 429;
- every stream's database poll runs under one small ``CapacityLimiter`` of its own
  (``poll_threads``), so all streams together use at most that many threads and database
  connections, whatever their number; ordinary requests keep the default pool;
- a stream's open (token, job, slot) runs under the same limiter, in one short turn with a
  session of its own (``service.api.sse``), so a burst of opens cannot take the default pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
from fastapi import HTTPException


class StreamSlots:
    def __init__(self, max_per_user: int, poll_threads: int):
        self.max_per_user = max_per_user
        self.poll_threads = poll_threads
        self._limiter: anyio.CapacityLimiter | None = None
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """Created on first use, inside the server's event loop (anyio binds it there)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.poll_threads)
        return self._limiter

    def open_count(self, user: str) -> int:
        with self._lock:
            return self._open.get(user, 0)

    def take(self, user: str) -> Callable[[], None]:
        """Take one of ``user``'s slots; returns the (idempotent) release. 429 when all are taken.

        A release function rather than a context manager: the slot is taken in the request
        handler (so the refusal is a plain 429) but held by the response's body generator,
        which may never start (the client left) — both the generator's ``finally`` and the
        response's background task call it, and only the first call counts.
        """
        with self._lock:
            if self._open.get(user, 0) >= self.max_per_user:
                raise HTTPException(429, f"{user} already has {self.max_per_user} open event streams "
                                         f"(ZEROTRAIN_MAX_STREAMS_PER_USER); close one first",
                                    headers={"Retry-After": "5"})
            self._open[user] = self._open.get(user, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                self._open[user] -= 1
                if not self._open[user]:
                    del self._open[user]

        return release
