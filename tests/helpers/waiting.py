"""Waiting for a condition in a test: the one polling helper every test shares."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.2,
             describe: Callable[[], str] | None = None) -> T:
    """Poll ``condition`` until it returns something truthy, and return that value.

    The condition is evaluated only before the deadline (``timeout_s`` from now), so a pass
    never depends on how late a poll ran. On timeout the assertion names ``what`` and, given
    ``describe``, what it says about the state then."""
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        value = condition()
        if value:
            return value
        time.sleep(min(poll_s, remaining))
    detail = f": {describe()}" if describe else ""
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{detail}")
