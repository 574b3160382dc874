"""Issue 19: an elastic job is resized at a checkpoint boundary (``workers.runtime.resize_at_checkpoint``).

The controller's side (``HeldResize``) against the decisions Ray's elastic policy makes; the
policy swap reaching what ``fit()`` calls; the ranks' side (``ResizeGate``) on a real 2-rank Gloo
world, with the channel in files instead of Ray's KV store, the test playing the controller.
The whole path runs on the loopback cluster (``tests/cluster/test_elastic.py``: the grow-back
trains no step twice).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.runtime.resize_at_checkpoint import HeldResize, ResizeChannel, ResizeGate
from workers.zero.testing import spawn_world


def file_channel(root: Path, job_id: str = "job-1") -> ResizeChannel:
    def get(key: str) -> bytes | None:
        path = root / key.replace("/", "_")
        return path.read_bytes() if path.exists() else None

    def put(key: str, value: bytes) -> None:
        partial = root / (key.replace("/", "_") + ".partial")
        partial.write_bytes(value)
        partial.replace(root / key.replace("/", "_"))

    def delete(key: str) -> None:
        (root / key.replace("/", "_")).unlink(missing_ok=True)

    return ResizeChannel(job_id, get=get, put=put, delete=delete)


@dataclass
class Resize:  # the shape of Ray's ResizeDecision
    num_workers: int


NOOP = object()


def test_a_resize_is_held_until_the_ranks_park_then_let_go(tmp_path):
    channel = file_channel(tmp_path)
    held = HeldResize(channel, noop=NOOP)
    assert held.decide(Resize(2), looked=True) is NOOP  # Ray would stop the group here
    assert channel.wanted() == 2
    assert held.decide(NOOP, looked=False) is NOOP  # between looks, the request stands
    channel.park(15)  # rank 0, once the checkpoint of step 15 is committed
    assert held.decide(NOOP, looked=False) == Resize(2)  # now
    assert channel.parked() == 15 and channel.pending()  # the ranks stay parked until Ray stops them
    assert held.decide(NOOP, looked=False) is NOOP and channel.pending()


def test_a_request_is_withdrawn_when_the_next_look_finds_no_capacity(tmp_path):
    channel = file_channel(tmp_path)
    held = HeldResize(channel, noop=NOOP)
    held.decide(Resize(2), looked=True)
    assert held.decide(NOOP, looked=True) is NOOP  # looked: the group's size fits the cluster again
    assert not channel.pending()
    channel.park(20)  # ranks that parked with nothing held train on
    assert held.decide(NOOP, looked=False) is NOOP and not channel.pending()
    held.decide(Resize(3), looked=True)
    held.group_restarts()  # a failed group: nothing is held for it
    assert held.held is None and not channel.pending()


def test_the_trainer_builds_our_scaling_policy_for_an_elastic_run_only():
    """The swap of Ray's (private) scaling-policy factory still reaches what fit() calls, and the
    policy survives the trip to the controller."""
    import inspect

    import ray.train.v2.api.data_parallel_trainer as trainer_module
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, FixedScalingPolicy

    from workers.runtime.resize_at_checkpoint import resize_at_checkpoints

    original = trainer_module.create_scaling_policy
    with resize_at_checkpoints("job-7"):
        elastic = trainer_module.create_scaling_policy(ScalingConfig(num_workers=(1, 2)))
        fixed = trainer_module.create_scaling_policy(ScalingConfig(num_workers=2))
    assert trainer_module.create_scaling_policy is original
    assert type(elastic).__name__ == "BoundaryScalingPolicy" and isinstance(elastic, ElasticScalingPolicy)
    assert isinstance(fixed, FixedScalingPolicy)
    travelled = pickle.loads(pickle.dumps(elastic))
    assert type(travelled).__name__ == "BoundaryScalingPolicy" and travelled.job_id == "job-7"
    assert "scaling_policy=create_scaling_policy(self.scaling_config)" in inspect.getsource(trainer_module)


def gate_world(rank: int, world_size: int, root: str, steps: int, every: int) -> list[tuple[int, str]]:
    """Ranks that train ``steps`` steps, a checkpoint every ``every``, the gate at each but the last;
    what each did, in order: ("step", n), ("commit", n)."""
    torch.set_num_threads(1)
    channel = file_channel(Path(root))
    gate = ResizeGate(channel, rank=rank, device=torch.device("cpu"), poll_s=0.05)
    done: list[tuple[int, str]] = []
    for step in range(1, steps + 1):
        done.append((step, "step"))
        if step % every == 0 and step < steps:
            gate.at_checkpoint(step, wait_commit=lambda step=step: done.append((step, "commit")))
        if rank == 0 and step == 2:
            (Path(root) / "reached-2").touch()
        time.sleep(0.05)
    return done


def test_ranks_park_at_the_next_checkpoint_after_a_request_and_go_on_when_it_is_withdrawn(tmp_path):
    import threading

    channel = file_channel(tmp_path)
    channel.want(4)  # stale: a request for the group before; rank 0 clears it when the gate is made
    parked_seen: list[int] = []

    def controller() -> None:
        deadline = time.monotonic() + 60
        while not (tmp_path / "reached-2").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        channel.want(3)  # after step 2: the ranks take no notice until the checkpoint of step 4
        while channel.parked() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        parked_seen.append(channel.parked())
        time.sleep(0.5)  # parked: nothing trains while the request stands
        channel.clear()  # withdrawn

    thread = threading.Thread(target=controller)
    thread.start()
    per_rank = spawn_world(gate_world, world_size=2, args=(str(tmp_path), 10, 4), timeout_s=120)
    thread.join(10)
    assert parked_seen == [4]
    for done in per_rank:
        # the commit of step 4 was waited for, before the park; step 8's checkpoint found nothing asked
        assert done == [(s, "step") for s in range(1, 5)] + [(4, "commit")] + [(s, "step") for s in range(5, 11)]
    assert not channel.pending()


def test_ranks_parked_to_shrink_are_replaced_at_once_and_no_decision_goes_past_the_cap(tmp_path):
    """[Note: shrinking for a preemption]: the policy's side, against Ray's decisions."""
    channel = file_channel(tmp_path)
    held = HeldResize(channel, noop=NOOP, resize=Resize)
    channel.set_cap(1)  # rank 0, once asked to shrink to 1: before parking, nothing changes yet
    assert held.decide(NOOP, looked=False, workers=2) is NOOP and channel.cap() == 1
    assert held.decide(Resize(3), looked=True, workers=2) is NOOP  # room for 3: not past the cap
    channel.park(6)  # the checkpoint of step 6 committed
    assert held.decide(NOOP, looked=False, workers=2) == Resize(1)  # now, not at the next look
    assert held.decide(NOOP, looked=False, workers=2) is NOOP  # parked until Ray stops them
    held.group_restarts()
    assert held.capped(Resize(2)) == Resize(1)  # the group Ray starts next is of the cap's size
    assert held.decide(Resize(2), looked=True, workers=1) is NOOP and channel.wanted() is None
    channel.set_cap(None)  # lifted: the next look's room for 2 is asked for at a checkpoint as before
    assert held.decide(Resize(2), looked=True, workers=1) is NOOP and channel.wanted() == 2


def shrink_world(rank: int, world_size: int, root: str, workers: int) -> list[str]:
    """Ranks asked to shrink to ``workers`` at step 3; what each did, in order."""
    torch.set_num_threads(1)
    channel = file_channel(Path(root))
    gate = ResizeGate(channel, rank=rank, device=torch.device("cpu"), poll_s=0.05)
    done: list[str] = []
    gate.shrink(3, workers, world_size, wait_commit=lambda: done.append("commit"),
                report=lambda: done.append(f"report parked={channel.parked()} cap={channel.cap()}"))
    done.append("trains on")
    return done


def test_ranks_shrinking_commit_then_rank_0_caps_parks_and_reports_and_all_wait_for_the_new_group(tmp_path):
    import threading

    channel = file_channel(tmp_path)
    seen: list[tuple[int | None, int | None]] = []

    def ray() -> None:  # plays Ray replacing the parked group; here it lets the ranks out instead
        deadline = time.monotonic() + 60
        while channel.parked() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append((channel.parked(), channel.cap()))
        channel.clear()

    thread = threading.Thread(target=ray)
    thread.start()
    per_rank = spawn_world(shrink_world, world_size=2, args=(str(tmp_path), 1), timeout_s=120)
    thread.join(10)
    assert seen == [(3, 1)]
    assert per_rank[0] == ["commit", "report parked=3 cap=1", "trains on"]
    assert per_rank[1] == ["commit", "trains on"]
    assert channel.cap() == 1  # the cap stays for the next group


def test_a_group_already_as_small_as_asked_takes_the_cap_and_trains_on_without_parking(tmp_path):
    channel = file_channel(tmp_path)
    [done] = spawn_world(shrink_world, world_size=1, args=(str(tmp_path), 1), timeout_s=60)
    assert done == ["commit", "report parked=None cap=1", "trains on"]
    assert channel.cap() == 1 and not channel.pending()
