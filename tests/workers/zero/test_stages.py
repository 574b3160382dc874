"""Collectives are issued in bucket order whatever order (or subset) gradients arrive in."""

from __future__ import annotations

import random
from abc import ABC

import pytest
import torch
import torch.nn as nn

from workers.zero.buckets import FlatBucket
from workers.zero.collectives import Pending
from workers.zero.flat import FlatLayout
from workers.zero.grad_reducer import MAX_INFLIGHT_BUCKETS
from workers.zero.stages import (
    AllReduceStrategy,
    ReduceScatterAtStepStrategy,
    ReduceScatterInBackwardStrategy,
)
from workers.zero.strategies import make_strategy


class RecordingComm:
    """Stands in for Collectives with world size 2: records what would be launched, in order."""

    world_size = 2
    dp_size = 2  # the world gradients are averaged over (no hybrid sharding: the same)
    in_place = False  # a backend with native reduce-scatter and all-gather (NCCL's kind)
    exchanges = False  # not a two-rank Gloo group (its exchanges: test_gloo_in_place.py, the equivalence suites)

    def __init__(self):
        self.launched: list[str] = []

    def _record(self, label: str) -> Pending:
        self.launched.append(label)
        return Pending(None, label, len(self.launched), self, done=True)

    def all_reduce(self, tensor, label, async_op=True):
        return self._record(label)

    def reduce_scatter(self, output, input, label, async_op=True):
        return self._record(label)

    def all_gather(self, output, input, label, async_op=True):
        return self._record(label)


class SlowComm(RecordingComm):
    """Collectives that never finish by themselves: only wait() completes them."""

    class Work:
        def __init__(self):
            self.finished = False

        def is_completed(self):
            return self.finished

        def wait(self):
            self.finished = True

    def _timed_wait(self, work, watch=None):
        work.wait()

    def _record(self, label: str) -> Pending:
        self.launched.append(label)
        return Pending(self.Work(), label, len(self.launched), self)


def build(stage: int, n_params: int = 12, bucket_numel: int = 40, overlap: bool = True, comm=None):
    shapes = [(f"p{i}", (3 + i % 5, 2)) for i in range(n_params)]
    layout = FlatLayout.build(shapes, 2, bucket_numel)
    params = [nn.Parameter(torch.zeros(s)) for _, s in shapes]
    buckets = []
    for spec in layout.buckets:
        flat = torch.zeros(spec.numel)
        master = flat[: spec.shard_numel]
        buckets.append(FlatBucket(spec, [params[s.index] for s in spec.slots], flat, master, [], 0))
    comm = comm or RecordingComm()
    return make_strategy(stage, buckets, comm, overlap), comm, layout


@pytest.mark.parametrize("stage,sync", [(2, False), (0, True), (1, True)])
@pytest.mark.parametrize("seed", range(5))
def test_launch_order_is_bucket_order(stage, sync, seed):
    strategy, comm, layout = build(stage)
    rng = random.Random(seed)
    arrivals = [(b, pos) for b in strategy.buckets for pos in range(len(b.spec.slots))]
    rng.shuffle(arrivals)
    arrivals = arrivals[: len(arrivals) - rng.randrange(0, 4)]  # some parameters unused on this rank
    strategy.begin_micro_step(sync)
    for b, pos in arrivals:
        strategy.on_grad(b, pos, torch.ones(b.spec.slots[pos].shape))
    strategy.end_micro_step()
    kind = "all_reduce" if stage == 0 else "reduce_scatter"
    assert comm.launched == [f"{kind} bucket {i}" for i in range(len(layout.buckets))]
    strategy.reduced_grads()
    assert len(comm.launched) == len(layout.buckets)  # nothing launched twice


def test_stage_2_launches_during_backward_as_buckets_fill():
    strategy, comm, layout = build(2)
    strategy.begin_micro_step(False)
    first = strategy.buckets[0]
    for pos in range(len(first.spec.slots)):
        assert comm.launched == []
        strategy.on_grad(first, pos, torch.ones(first.spec.slots[pos].shape))
    assert comm.launched == ["reduce_scatter bucket 0"]  # overlap: launched before backward ends


def test_no_overlap_waits_for_the_end_of_backward():
    strategy, comm, layout = build(2, overlap=False)
    strategy.begin_micro_step(False)
    for b in strategy.buckets:
        for pos in range(len(b.spec.slots)):
            strategy.on_grad(b, pos, torch.ones(b.spec.slots[pos].shape))
    assert comm.launched == []
    strategy.end_micro_step()
    assert len(comm.launched) == len(layout.buckets)


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_and_1_do_not_communicate_on_non_final_micro_steps(stage):
    strategy, comm, _ = build(stage)
    for _ in range(3):
        strategy.begin_micro_step(False)
        for b in strategy.buckets:
            for pos in range(len(b.spec.slots)):
                strategy.on_grad(b, pos, torch.ones(b.spec.slots[pos].shape))
        strategy.end_micro_step()
    assert comm.launched == []
    strategy.reduced_grads()
    assert len(comm.launched) == len(strategy.buckets)


def test_stage_2_scratch_stays_bounded_when_the_network_is_slow():
    """Full-size gradient storage is never kept: a launch beyond 2 in flight waits for the oldest."""
    strategy, comm, layout = build(2, n_params=30, bucket_numel=20, comm=SlowComm())
    assert len(layout.buckets) > 6
    strategy.begin_micro_step(False)
    most = 0
    for b in strategy.buckets:
        for pos in range(len(b.spec.slots)):
            strategy.on_grad(b, pos, torch.ones(b.spec.slots[pos].shape))
            most = max(most, sum(x.grad_full is not None for x in strategy.buckets))
    strategy.end_micro_step()
    assert comm.launched == [f"reduce_scatter bucket {i}" for i in range(len(layout.buckets))]
    assert most <= MAX_INFLIGHT_BUCKETS + 1  # in flight + the one being filled
    assert sum(x.grad_full is not None for x in strategy.buckets) <= MAX_INFLIGHT_BUCKETS  # tail overlaps
    strategy.reduced_grads()
    assert all(x.grad_full is None for x in strategy.buckets)


def test_params_absent_from_the_graph_do_not_hold_back_later_buckets():
    strategy, comm, layout = build(2)
    strategy.begin_micro_step(False)
    first = strategy.buckets[0]
    strategy.mark_absent(first, 0)  # e.g. unused on this rank, known before backward runs
    for b in strategy.buckets[:2]:
        for pos in range(len(b.spec.slots)):
            if (b, pos) != (first, 0):
                strategy.on_grad(b, pos, torch.ones(b.spec.slots[pos].shape))
    assert comm.launched == ["reduce_scatter bucket 0", "reduce_scatter bucket 1"]


def test_engine_marks_unreachable_parameters():
    from workers.zero import ZeroConfig, ZeroEngine

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x, use_b):
            return (self.b(x) if use_b else self.a(x)).sum()

    engine = ZeroEngine(TwoHeads(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                        ZeroConfig(stage=2, precision="fp32", bucket_mb=12 / 2**20))
    marked = []
    original = engine.strategy.mark_absent
    engine.strategy.mark_absent = lambda b, pos: (marked.append(b.spec.slots[pos].name), original(b, pos))
    engine.backward(engine(torch.randn(2, 3), use_b=True))
    assert sorted(marked) == ["a.bias", "a.weight"]
    before = engine.full_state_dict()
    engine.step()
    after = engine.full_state_dict()
    assert torch.equal(before["a.weight"], after["a.weight"]) and not torch.equal(before["b.weight"], after["b.weight"])


def test_make_strategy_picks_by_what_the_stage_shards():
    expected = {0: AllReduceStrategy, 1: ReduceScatterAtStepStrategy, 2: ReduceScatterInBackwardStrategy}
    for stage, cls in expected.items():
        strategy, _, _ = build(stage)
        assert type(strategy) is cls and strategy.stage == stage
        assert strategy.sharded_grads == (stage > 0) and strategy.communicates_every_micro_step == (stage == 2)
    with pytest.raises(ValueError, match="unit plan"):
        build(3)  # stage 3 shards parameters: without the units its buckets came from it cannot run


def test_stage_3_shares_the_gradient_path_by_holding_it_not_by_inheriting_stage_2():
    """Every stage holds one ``GradReducer``; stage 3 derives only from the abstract ``Strategy``
    and replaces none of its concrete methods, so a change to stage 2 cannot reach stage 3."""
    from workers.zero.grad_reducer import GradReducer
    from workers.zero.stage3 import ParamShardStrategy
    from workers.zero.strategy_base import Strategy

    assert ParamShardStrategy.__mro__[1:] == (Strategy, ABC, object)
    inherited = {name for cls in (Strategy, ABC) for name, value in vars(cls).items()
                 if not getattr(getattr(value, "fget", value), "__isabstractmethod__", False)}
    own = {name for name in vars(ParamShardStrategy) if not name.startswith("__") and name != "_abc_impl"}
    assert own & inherited == set()
    for stage in (0, 1, 2):
        strategy, _, _ = build(stage)
        assert type(strategy.grads) is GradReducer and strategy.grads.buckets is strategy.buckets


def _backward(strategy, sync: bool, record=None) -> None:
    strategy.begin_micro_step(sync)
    for b in strategy.buckets:
        for pos in range(len(b.spec.slots)):
            strategy.on_grad(b, pos, torch.ones(b.spec.slots[pos].shape))
            if record is not None:
                record()
    strategy.end_micro_step()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_no_gradient_is_held_before_the_first_gradient_or_after_the_step(stage):
    """The note on gradients' lifetime: nothing at construction, nothing after zero_grads."""
    strategy, _, _ = build(stage)
    assert strategy.grad_tensors() == [] and strategy.scratch_tensors() == []
    first = strategy.buckets[0]
    strategy.begin_micro_step(True)
    strategy.on_grad(first, 0, torch.ones(first.spec.slots[0].shape))
    assert [b.grad_full is not None for b in strategy.buckets] == [True] + [False] * (len(strategy.buckets) - 1)
    for b in strategy.buckets:
        for pos in range(len(b.spec.slots)):
            if (b, pos) != (first, 0):
                strategy.on_grad(b, pos, torch.ones(b.spec.slots[pos].shape))
    strategy.end_micro_step()
    strategy.reduced_grads()
    assert strategy.grad_tensors() != []
    strategy.zero_grads()
    assert strategy.grad_tensors() == [] and strategy.scratch_tensors() == []


def test_stage_1_frees_each_full_gradient_once_reduced_and_keeps_few_in_flight():
    """The sync=True micro-step of stage 1 reduces as stage 2 does: what a slow network leaves in
    flight is bounded, and the step ends with shards only."""
    strategy, comm, layout = build(1, n_params=30, bucket_numel=20, comm=SlowComm())
    assert len(layout.buckets) > 6
    _backward(strategy, sync=False)  # accumulation: every full gradient is held, nothing communicated
    assert comm.launched == [] and all(b.grad_full is not None for b in strategy.buckets)
    in_flight = []
    strategy.begin_micro_step(True)
    for b in strategy.buckets:
        for pos in range(len(b.spec.slots)):
            strategy.on_grad(b, pos, torch.ones(b.spec.slots[pos].shape))
            in_flight.append(sum(x.launched and x.grad_full is not None for x in strategy.buckets))
    strategy.end_micro_step()
    assert max(in_flight) <= MAX_INFLIGHT_BUCKETS
    grads = strategy.reduced_grads()
    assert all(b.grad_full is None for b in strategy.buckets)
    assert [g.numel() for g in grads] == [b.spec.shard_numel for b in strategy.buckets]
    held = strategy.grad_tensors()
    assert sum(t.numel() for t in held) == sum(b.spec.shard_numel for b in strategy.buckets)


def test_padding_and_unwritten_slots_are_zero_when_reduced():
    """The full gradient is allocated uninitialised: only what no gradient wrote is zeroed, before the reduce."""
    strategy, _, _ = build(0)
    b = strategy.buckets[0]
    strategy.begin_micro_step(False)
    strategy.on_grad(b, 0, torch.full(b.spec.slots[0].shape, 3.0))
    b.grad_full.fill_(float("nan"))  # what an uninitialised block may hold
    lo, hi = b.slot_range(0)
    b.grad_full[lo:hi] = 3.0
    strategy.end_micro_step()
    grad = strategy.reduced_grads()[0]
    assert grad[lo:hi].eq(1.5).all()
    assert torch.cat([grad[:lo], grad[hi:]]).eq(0).all()
