"""The ranks' side of preemption: stop at a checkpoint boundary when the control plane asks.

The control plane asks a running job to make room for a higher-priority one
(``service.preemption``) by a flag on the job row. Rank 0 polls it in a background thread
(``PreemptionWatch``: ``GET /jobs/{id}/worker/preemption`` every ``POLL_S``), so no step waits
on HTTP. After every step the ranks agree on what rank 0 decided (``PreemptGate.should_stop``:
one broadcast of one integer), so they all stop after the same step:

- a step that saved a checkpoint: stop there;
- otherwise, when the next boundary (the next ``checkpoint.every_steps`` multiple) is further
  away than the grace left (the control plane's ``preempt_grace_s`` since the request, at the mean step
  time so far): save a checkpoint at this step and stop;
- when the next boundary is the run's last step, the job is let finish if that fits the grace
  (finishing frees the workers as well); else, as above, it saves now.

An elastic job may be asked to shrink instead (the answer's ``shrink_to``): the same step is
chosen and agreed with the size (``PreemptGate.shrink_to``), and the ranks shrink there
through the elastic resize path (``workers.runtime.resize_at_checkpoint``, [Note: shrinking for
a preemption]) instead of stopping; the gate then takes no notice of that same request again.

Stopping waits for the checkpoint's commit (which waits for the step's metric records: every
rank's metrics stay one row per step), then rank 0 reports ``POST /worker/preempted`` and the
loop returns; the driver sees the job QUEUED again and exits without a final state. The next
attempt resumes from that checkpoint: no step is lost or trained twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

POLL_S = 2.0  # rank 0 asks the control plane this often whether the job is to make room


class PreemptionWatch:
    """Rank 0's poller: the latest answer of ``fetch()`` (``WorkerAPI.get_preemption``), and the
    monotonic time it came, kept by a daemon thread; errors are logged and polled again."""

    def __init__(self, fetch: Callable[[], dict[str, Any]], poll_s: float = POLL_S,
                 on_close: Callable[[], Any] | None = None):
        self.fetch, self.poll_s, self.on_close = fetch, poll_s, on_close
        self._latest: tuple[dict[str, Any], float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerotrain-preemption-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                answer = self.fetch()
                self._latest = (answer, time.monotonic())
            except Exception as error:  # noqa: BLE001 - the control plane may be briefly away
                log.warning("could not ask whether the job is preempted: %s", error)
            self._stop.wait(self.poll_s)

    def grace_left_s(self) -> float | None:
        """Seconds left to stop in, counted from the control plane's answer; None: not asked."""
        latest = self._latest
        if latest is None or not latest[0].get("requested"):
            return None
        answer, at = latest
        return float(answer.get("grace_left_s") or 0.0) - (time.monotonic() - at)

    def for_job(self) -> str | None:
        latest = self._latest
        return None if latest is None else latest[0].get("for_job")

    def request(self) -> tuple[str | None, int | None]:
        """What the latest answer asks: the job to make room for and the size to shrink to (None: stop)."""
        latest = self._latest
        return (None, None) if latest is None else (latest[0].get("for_job"), latest[0].get("shrink_to"))

    def cap(self) -> tuple[bool, int | None]:
        """Whether an answer came yet, and the size the job is capped at (or asked to shrink to)."""
        latest = self._latest
        return (False, None) if latest is None else (True, latest[0].get("shrink_to"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        if self.on_close is not None:
            self.on_close()


def next_boundary(step: int, every_steps: int | None, total_steps: int) -> int:
    """The next step after ``step`` that saves a checkpoint (the last step always does)."""
    if not every_steps:
        return total_steps
    return min(total_steps, (step // every_steps + 1) * every_steps)


def decide(step: int, saved: bool, grace_left_s: float | None, mean_step_s: float,
           every_steps: int | None, total_steps: int) -> bool:
    """Whether to stop after completed ``step`` (saving now when ``saved`` is False)."""
    if grace_left_s is None or step >= total_steps:
        return False
    if saved:
        return True
    return (next_boundary(step, every_steps, total_steps) - step) * mean_step_s > grace_left_s


class PreemptGate:
    """Every rank's gate, called after each step's record is handed over (the module note).
    ``watch`` is rank 0's ``PreemptionWatch`` (None on the other ranks)."""

    def __init__(self, *, rank: int, device: torch.device, watch: PreemptionWatch | None,
                 every_steps: int | None, total_steps: int):
        self.rank, self.device, self.watch = rank, device, watch
        self.every_steps, self.total_steps = every_steps, total_steps
        self._step_s_total, self._steps = 0.0, 0
        self.shrink_to: int | None = None  # with should_stop: shrink to this many workers instead
        self._acting: tuple[str | None, int | None] | None = None  # rank 0: the request acted on
        self._handled: tuple[str | None, int | None] | None = None  # rank 0: a shrink already done

    def should_stop(self, step: int, *, saved: bool, step_time_s: float) -> bool:
        """Collective: whether every rank stops (or, with ``shrink_to`` set, shrinks) after
        ``step`` (rank 0 decides)."""
        self._step_s_total += step_time_s
        self._steps += 1
        stop, target = 0, 0
        if self.rank == 0 and self.watch is not None:
            asked = self.watch.request()
            if asked != self._handled:
                stop = int(decide(step, saved, self.watch.grace_left_s(), self._step_s_total / self._steps,
                                  self.every_steps, self.total_steps))
                target = int(asked[1] or 0) if stop else 0
                self._acting = asked
        value = torch.tensor([stop, target], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(value, src=0)
        self.shrink_to = int(value[1].item()) or None
        return bool(value[0].item())

    def shrunk(self) -> None:
        """The ranks shrank for the request acted on last: take no notice of it again (rank 0's
        answers may still show it until its next poll)."""
        self._handled = self._acting

    def cap(self) -> tuple[bool, int | None]:
        """Rank 0: whether the control plane answered yet, and the size the job is capped at."""
        return (False, None) if self.watch is None else self.watch.cap()

    def for_job(self) -> str | None:
        return None if self.watch is None else self.watch.for_job()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
