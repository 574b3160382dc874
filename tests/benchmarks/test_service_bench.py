"""``benchmarks/service.py``'s open-loop driver and ramp, against fake requests (no server): a step
that keeps up runs to the end; one request outstanding for the give-up bound abandons the step at
once, cancels what is outstanding and ends the ramp, saying at which rate and why."""

from __future__ import annotations

import argparse
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.service import Step, judge, open_loop, ramp, stop


def run_alone(coroutine):
    """``asyncio.run`` in a thread of its own. Playwright's sync API keeps an event loop running
    in the main thread while the dashboard tests' session-wide browser lives, and
    ``asyncio.run`` refuses to start under a running loop: these tests failed whenever they ran
    after a dashboard test in one session."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def fake_send(hang_from: int):
    """Answers at once up to request ``hang_from``, then never answers (until cancelled)."""
    sent: list[int] = []
    cancelled: list[int] = []

    async def send(index: int) -> bool:
        sent.append(index)
        if index < hang_from:
            return True
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(index)
            raise
        return True
    return send, sent, cancelled


def args(**overrides) -> argparse.Namespace:
    return argparse.Namespace(**{"step_seconds": 2.0, "p99_ms": 20.0, "factor": 2.0, "max_steps": 3, **overrides})


def test_a_step_that_keeps_up_runs_to_the_end() -> None:
    send, sent, _ = fake_send(hang_from=10**9)
    load = run_alone(open_loop(50, 0.4, send, give_up_s=1.0))
    assert sent == list(range(20)) and len(load.latencies) == 20
    assert not load.abandoned and load.failed == 0 and load.unfinished == 0
    assert 0.35 < load.seconds < 1.0


def test_an_outstanding_request_abandons_the_step_at_once() -> None:
    send, sent, cancelled = fake_send(hang_from=5)

    async def run():
        load = await open_loop(100, 5.0, send, give_up_s=0.2)  # 500 requests over 5 s if it went on
        return load, [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    started = time.monotonic()
    load, leftover = run_alone(run())
    assert time.monotonic() - started < 2.5  # request 5 was due at 0.05 s, given up at 0.25 s
    assert load.abandoned and leftover == []
    assert 5 < len(sent) < 100  # nothing was sent after the give-up
    assert load.unfinished == len(sent) - 5 and sorted(cancelled) == list(range(5, len(sent)))  # 5 by its timeout
    assert len(load.latencies) == len(sent) and max(load.latencies) >= 0.2  # open loop: age from the due time
    step = judge(Step("submit", 100, len(load.latencies), load.failed + load.unfinished, 0.0, 0.0,
                      1000 * max(load.latencies), 0.0, unfinished=load.unfinished, abandoned=True,
                      seconds=load.seconds), args(p99_ms=20.0))
    assert not step.kept_up and step.verdict.startswith("abandoned after")


def test_the_ramp_ends_at_the_abandoned_step_and_says_why() -> None:
    options = args(step_seconds=0.3, p99_ms=20.0, max_steps=5)
    levels: list[float] = []

    async def measure_at(rate: float) -> Step:
        levels.append(rate)
        send, _, _ = fake_send(hang_from=10**9 if rate < 40 else 3)
        load = await open_loop(rate, options.step_seconds, send, give_up_s=10 * options.p99_ms / 1000)
        return judge(Step("submit", rate, len(load.latencies), load.failed + load.unfinished,
                          len(load.latencies) / load.seconds, 0.0, 0.0, 0.0, unfinished=load.unfinished,
                          abandoned=load.abandoned, seconds=load.seconds), options)

    steps = run_alone(ramp(10, options, measure_at))
    assert levels == [10, 20, 40]
    assert [step.kept_up for step in steps] == [True, True, False] and steps[-1].abandoned
    stopped = stop(steps, options)
    assert stopped["stopped_at"] == 40 and stopped["stopped_because"].startswith("abandoned after")
