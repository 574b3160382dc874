"""The shared ``wait_for``: returns the condition's value, never polls past its deadline, and says
what it waited for."""

from __future__ import annotations

import time

import pytest

from tests.helpers.waiting import wait_for


def test_returns_the_first_truthy_value():
    values = iter([None, 0, "", "ready"])
    assert wait_for(lambda: next(values), 5, "the value", poll_s=0.001) == "ready"


def test_never_evaluates_the_condition_after_the_deadline():
    calls: list[float] = []

    def slow_false() -> bool:
        calls.append(time.monotonic())
        time.sleep(0.03)
        return False

    start = time.monotonic()
    with pytest.raises(AssertionError):
        wait_for(slow_false, 0.1, "never", poll_s=0.01)
    assert calls and all(t - start < 0.1 for t in calls)


def test_a_deadline_already_past_fails_without_evaluating():
    calls: list[int] = []
    with pytest.raises(AssertionError):
        wait_for(lambda: calls.append(1) or True, 0, "nothing")
    assert calls == []


def test_the_timeout_names_what_and_the_state():
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the lease: held by b"):
        wait_for(lambda: False, 0.05, "the lease", poll_s=0.01, describe=lambda: "held by b")
