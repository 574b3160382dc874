"""A control-plane duty run over and over on a thread of its own: the scheduler's pass, the
webhook sender's. Each pass runs, then the loop waits ``poll_s`` or until ``wake()``; a pass
that raises (the database restarting, say) is logged and the loop goes on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class PollLoop:
    def __init__(self, name: str, run_once: Callable[[], object], poll_s: float):
        self.name = name
        self.run_once = run_once
        self.poll_s = poll_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_forever(self) -> None:
        """Pass after pass on the calling thread, until ``stop()``."""
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # one bad pass must not end the loop
                log.exception("%s: a pass failed", self.name)
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run_forever, name=self.name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Run the next pass now instead of after the wait."""
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the loop to end and wait up to ``timeout`` for the pass in progress."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
