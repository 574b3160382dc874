"""An elastic job changes its worker group's size at a checkpoint boundary, not wherever it is.

[Note: resizing at a checkpoint boundary]
Ray Train 2.60's ``ElasticScalingPolicy`` looks at the cluster every
``elastic_resize_monitor_interval_s`` while a group runs; when another size fits, it stops the
group wherever it is and starts one of the new size, which resumes from the latest checkpoint:
the steps since that checkpoint -- up to ``checkpoint.every_steps`` -- are trained again. So the
controller's policy here (``BoundaryScalingPolicy``) holds such a decision back and asks for it
instead (``ResizeChannel.want``, a key in Ray's internal KV store, one per job), answering "no
change" meanwhile. The ranks look at every checkpoint step of the run but the last, after the
step's metric record is handed over (``ResizeGate.at_checkpoint``): rank 0 reads the request and
broadcasts it (one integer, once per checkpoint); when a resize is wanted, every rank waits for
the checkpoint's commit, rank 0 records the step as parked, and the ranks wait. The policy's
next poll (about every second) finds the park and returns the decision it held: Ray stops the
parked group and starts the new one, which resumes from that very checkpoint -- no step is
trained twice. When the policy's next look at the cluster no longer finds the capacity, it
withdraws the request and parked ranks train on.

What this does not change: a lost node fails the group at once (RESTARTING, ``worker_failed``),
and the next group starts at the size that fits from the latest checkpoint; a
non-elastic job has no policy of ours and no gate. The price is time: a resize waits for the
next checkpoint step (at most ``checkpoint.every_steps`` steps, and the commit) instead of
happening at the policy's look.

[Note: shrinking for a preemption]
The control plane may ask an elastic job to shrink to N workers to make room for another job
(``service.preemption``, [Note: shrinking]). The ranks pick the step as for a stop
(``workers.preemption``), commit a checkpoint there, and rank 0 sets the job's cap (a second
key, ``cap:N``) and parks (``ResizeGate.shrink``). The policy, finding ranks parked and a cap
below the group's size, asks Ray for a group of N at once (``HeldResize.decide``): Ray stops the
parked group and starts one of N that resumes from that checkpoint, as for any resize. While the
cap is set, no decision of Ray's policy makes a group larger than it; rank 0 keeps the key as the
control plane's poll answers (``ResizeGate.keep_cap``, at every checkpoint), so once the job it
made room for has ended the cap is gone and the job grows back at a checkpoint as above.

The channel is Ray's internal KV store (the GCS), reachable from the controller actor and
from every worker; ``ResizeChannel`` takes other get/put/delete functions, which the tests use
to run the gate on a plain Gloo world.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

NAMESPACE = "zerotrain"
PARK_POLL_S = 0.5


@dataclass
class ResizeChannel:
    """One job's resize request: absent, ``want:N`` (the policy asks for N workers) or ``parked:S``
    (the ranks wait at the committed checkpoint of step S; they train on once the key is gone)."""

    job_id: str
    get: Callable[[str], Optional[bytes]]
    put: Callable[[str, bytes], Any]
    delete: Callable[[str], Any]

    @classmethod
    def ray(cls, job_id: str) -> "ResizeChannel":
        """The channel in Ray's internal KV store (the caller is connected to the cluster)."""
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

        return cls(job_id, get=lambda key: _internal_kv_get(key, namespace=NAMESPACE),
                   put=lambda key, value: _internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE),
                   delete=lambda key: _internal_kv_del(key, namespace=NAMESPACE))

    @property
    def key(self) -> str:
        return f"{self.job_id}/resize"

    def _read(self) -> tuple[str, int] | None:
        value = self.get(self.key)
        if not value:
            return None
        what, _, number = value.decode().partition(":")
        return what, int(number)

    def want(self, num_workers: int) -> None:
        self.put(self.key, f"want:{num_workers}".encode())

    def wanted(self) -> Optional[int]:
        state = self._read()
        return state[1] if state and state[0] == "want" else None

    def park(self, step: int) -> None:
        self.put(self.key, f"parked:{step}".encode())

    def parked(self) -> Optional[int]:
        state = self._read()
        return state[1] if state and state[0] == "parked" else None

    def pending(self) -> bool:
        """Whether anything is asked or parked: parked ranks wait while it is."""
        return self._read() is not None

    def clear(self) -> None:
        self.delete(self.key)

    def set_cap(self, num_workers: int | None) -> None:
        """The most workers a group of this job may have ([Note: shrinking for a preemption]);
        None: no cap."""
        key = f"{self.job_id}/cap"
        if num_workers is None:
            self.delete(key)
        else:
            self.put(key, str(int(num_workers)).encode())

    def cap(self) -> Optional[int]:
        value = self.get(f"{self.job_id}/cap")
        return int(value.decode()) if value else None


@dataclass
class HeldResize:
    """The controller's side, without Ray: which resize is held back, and when it is let go.

    ``decide(decision, looked)`` takes what Ray's elastic policy answered for the running group
    (a resize, with ``num_workers``, or its "no change") and whether it looked at the cluster this
    time (it looks every ``elastic_resize_monitor_interval_s``); it returns the decision to act on
    now. A decision let go leaves the ranks parked (the key stays) until Ray stops them; rank 0 of
    the next group clears it (``ResizeGate``).
    """

    channel: ResizeChannel
    noop: Any
    resize: Callable[[int], Any] = field(default=lambda num_workers: None)  # Ray's decision for a size
    held: Any = field(default=None)
    released: bool = False  # a held decision was let go: its parked ranks wait for Ray to stop them

    def decide(self, decision: Any, looked: bool, workers: int | None = None) -> Any:
        """``workers``: the running group's size, which a cap below it shrinks once the ranks park."""
        parked = self.channel.parked()
        if parked is None:
            self.released = False  # the next group's rank 0 cleared the park
        elif self.released:
            return self.noop
        cap = self.channel.cap()
        if parked is not None and cap is not None and workers is not None and cap < workers:
            self.held, self.released = None, True  # parked to shrink for a preemption: go
            return self.resize(cap)
        decision = self.capped(decision, workers)
        if parked is not None and self.held is not None:
            decision, self.held = self.held, None  # the ranks wait at a committed checkpoint: go
            self.released = True
            return decision
        if getattr(decision, "num_workers", None) is not None:
            self.channel.want(int(decision.num_workers))  # again at each look: a new group's rank 0 clears
            self.held = decision
            return self.noop
        if (looked and self.held is not None) or (parked is not None and self.held is None):
            self.held = None  # that capacity is gone (or nothing is held for these parked ranks):
            self.channel.clear()  # parked ranks train on
        return decision

    def capped(self, decision: Any, workers: int | None = None) -> Any:
        """``decision`` with no more workers than the cap: "no change" when that is ``workers``."""
        cap, wanted = self.channel.cap(), getattr(decision, "num_workers", None)
        if cap is None or wanted is None or wanted <= cap:
            return decision
        return self.noop if workers is not None and workers >= cap else self.resize(cap)

    def group_restarts(self) -> None:
        """A group is (re)started: nothing is held or parked for the one before."""
        self.held, self.released = None, False
        self.channel.clear()


def boundary_scaling_policy(scaling_config: Any, job_id: str) -> Any:
    """Ray Train's ``ElasticScalingPolicy`` with its resizes of a running group held back until the
    ranks park at a checkpoint (the note above)."""
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision

    class BoundaryScalingPolicy(ElasticScalingPolicy):
        def __init__(self) -> None:
            super().__init__(scaling_config)
            self.job_id = job_id
            self._held: Optional[HeldResize] = None

        def _hold(self) -> HeldResize:
            if self._held is None:  # made on the controller: the channel needs its Ray connection
                self._held = HeldResize(ResizeChannel.ray(self.job_id), noop=NoopDecision(),
                                        resize=self._get_resize_decision)
            return self._held

        def make_decision_for_non_running_worker_group(self):
            self._hold().group_restarts()
            return self._hold().capped(super().make_decision_for_non_running_worker_group())

        def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
            looked_before = self._latest_monitor_time
            decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
            return self._hold().decide(decision, looked=self._latest_monitor_time != looked_before,
                                       workers=worker_group_state.num_workers)

        def __reduce__(self):  # travels pickled to the controller: rebuilt there, fresh
            return boundary_scaling_policy, (scaling_config, job_id)

    return BoundaryScalingPolicy()


@contextlib.contextmanager
def resize_at_checkpoints(job_id: str):
    """``TorchTrainer.fit()`` inside gives an elastic run ``resize_at_checkpoint``'s policy, which
    holds a running group's resize back until its ranks park at a checkpoint (the note above);
    installed as ``ray_train.FailFastPolicy`` is (its note), and checked by the same kind of test."""
    import ray.train.v2.api.data_parallel_trainer as trainer_module

    original = trainer_module.create_scaling_policy

    def create_scaling_policy(config: Any) -> Any:
        return boundary_scaling_policy(config, job_id) if config.elasticity_enabled else original(config)

    trainer_module.create_scaling_policy = create_scaling_policy
    try:
        yield
    finally:
        trainer_module.create_scaling_policy = original


# Exceptions that mean a worker process or actor was lost, not that the training code raised.


class ResizeGate:
    """The ranks' side: at a checkpoint step, park for a wanted resize (the note above)."""

    def __init__(self, channel: ResizeChannel, *, rank: int, device: torch.device, poll_s: float = PARK_POLL_S):
        self.channel, self.rank, self.device, self.poll_s = channel, rank, device, poll_s
        if rank == 0:
            channel.clear()  # a new group: what was asked of the group before it is done with

    def _agreed(self, read: Callable[[], int]) -> int:
        """Rank 0's ``read()`` on every rank (one broadcast of one integer)."""
        value = torch.tensor([read() if self.rank == 0 else 0], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(value, src=0)
        return int(value.item())

    def at_checkpoint(self, step: int, wait_commit: Callable[[], Any]) -> None:
        """After checkpoint step ``step`` was started and its record handed over: if a resize is
        wanted, wait for the commit, park, and wait until Ray replaces this group (the process
        ends here) or the request is withdrawn (training goes on)."""
        wanted = self._agreed(lambda: self.channel.wanted() or 0)
        if not wanted:
            return
        wait_commit()
        if self.rank == 0:
            self.channel.park(step)
            print(f"parked at the checkpoint of step {step}: the worker group is to be resized to "
                  f"{wanted} workers", flush=True)
        while self._agreed(lambda: int(self.channel.pending())):
            time.sleep(self.poll_s)
        if self.rank == 0:
            print(f"the resize was withdrawn: training goes on from step {step}", flush=True)

    def shrink(self, step: int, workers: int, world_size: int, wait_commit: Callable[[], Any],
               report: Callable[[], Any]) -> None:
        """Every rank, after the gate of ``workers.preemption`` chose ``step`` to shrink at: wait for
        its checkpoint's commit; rank 0 caps the job at ``workers``, parks and ``report()``s;
        then wait until Ray replaces this group with one of ``workers`` (the process ends here).
        A group already that small only takes the cap and trains on ([Note: shrinking for a
        preemption])."""
        wait_commit()
        parks = world_size > workers
        if self.rank == 0:
            self.channel.set_cap(workers)
            if parks:
                self.channel.park(step)
                print(f"parked at the checkpoint of step {step}: the worker group shrinks to {workers} "
                      f"workers to make room for another job", flush=True)
            report()
        while parks and self._agreed(lambda: int(self.channel.pending())):
            time.sleep(self.poll_s)

    def keep_cap(self, workers: int | None) -> None:
        """Rank 0: keep the cap key as the control plane's latest answer says (None: no cap)."""
        if self.rank == 0 and self.channel.cap() != workers:
            self.channel.set_cap(workers)
