"""The collectives' watchdog: one thread per process that logs collectives overdue on any rank.

``Collectives`` registers every collective it launches (``WATCHDOG.enter``) and takes it off
when a host wait on it returned (``exit``); the thread logs, once each, the ones not complete
``timeout_s`` after their launch, so a hang names its bucket and sequence number.

[Note: the watchdog]
On NCCL ``work.wait()`` returns at once (it orders streams) and the host blocks later, in a
``synchronize()`` or a ``float(norm)``, where no timer runs. So the watchdog does not time
waits: every collective is registered when launched, with a probe of its completion
(``work.is_completed()``; on CUDA the query of the event recorded after it), and the watchdog
thread polls the probes: one that is still not complete ``timeout_s`` after the launch is
logged once with its label and sequence number, whoever is blocked on it and wherever. A
collective leaves the watch when its probe says complete or, on the CPU, when a host wait on it
returned: Gloo's wait returns only once the work is done, while some of its works never report
``is_completed()`` (a ``reduce_scatter_tensor``'s, torch 2.13).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger("workers.zero.collectives")  # the messages read as the collectives' own


class _Watchdog:
    """Logs collectives that have not completed ``timeout_s`` after their launch (the note on the watchdog).

    One daemon thread per process, shared by every engine, started on first use and stopped by
    ``stop()`` (``ZeroEngine.close()``); a later launch starts it again, still watching what other
    engines of the process have in flight. It polls each
    registered collective's ``done`` probe, forgets the completed ones and logs, once each, the
    ones past their timeout. It sleeps on an event, so ``stop()`` ends it at once rather than
    after its next tick.
    """

    def __init__(self):
        self._waiting: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._next = 0

    def enter(self, label: str, seq: int, rank: int, timeout_s: float, done: Callable[[], bool]) -> int:
        with self._lock:
            token = self._next
            self._next += 1
            self._waiting[token] = _Watched(label, seq, rank, timeout_s, time.monotonic(), done)
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name="zero-comm-watchdog",
                                                daemon=True)
                self._thread.start()
        return token

    def exit(self, token: Optional[int]) -> None:
        """The collective is known complete (a Gloo wait returned, a stream synchronized): stop watching it."""
        if token is None:
            return
        with self._lock:
            self._waiting.pop(token, None)

    def watched(self) -> list[str]:
        """Labels of the collectives still watched (launched, not seen complete), oldest first."""
        with self._lock:
            return [w.label for _, w in sorted(self._waiting.items())]

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread (if running) and wait for it; safe to call any number of times."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self, stop: threading.Event) -> None:
        while True:
            with self._lock:
                tick = min([w.timeout_s / 4 for w in self._waiting.values()] + [1.0])
            if stop.wait(max(0.01, tick)):
                return
            self.poll()

    def poll(self) -> list[str]:
        """One round: forget what completed, log what is overdue; returns the messages logged."""
        with self._lock:
            entries = list(self._waiting.items())
        finished, messages = [], []
        now = time.monotonic()
        for token, w in entries:
            if _probe(w.done):
                finished.append(token)
            elif now - w.start > w.timeout_s and not w.reported:
                w.reported = True
                messages.append(
                    f"rank {w.rank}: collective #{w.seq} ({w.label}) has not completed {now - w.start:.1f}s after "
                    "its launch; another rank may be slow, dead, or issuing collectives in a different order")
        with self._lock:
            for token in finished:
                self._waiting.pop(token, None)
        for message in messages:
            log.warning("%s", message)
        return messages


@dataclass
class _Watched:
    label: str
    seq: int
    rank: int
    timeout_s: float
    start: float
    done: Callable[[], bool]
    reported: bool = False


def _probe(done: Callable[[], bool]) -> bool:
    """Whether a watched collective completed; one whose probe fails is over too (its waiter gets the error)."""
    try:
        return bool(done())
    except Exception:  # noqa: BLE001 - a failed collective is not a hang
        return True


WATCHDOG = _Watchdog()


def stop_watchdog() -> None:
    """Stop the process's collectives watchdog thread (``ZeroEngine.close``); the next launch restarts it."""
    WATCHDOG.stop()
