"""Measure the rates the planner's time model needs, on the machine and process group a job runs on.

The planner predicts a step's time from counts (flops, bytes, optimizer elements) divided by
rates. A rate a user types (a link's nominal Gbit/s) is rarely what the engine gets: Gloo's
loopback, a loaded host or NVLink all differ from the datasheet. ``calibrate`` measures each
rate the way the engine incurs it, in well under a second:

* ``compute_flops_per_s``: the matmuls of the job's dtype on its device that one linear layer's
  training step runs: the forward (m×k)·(k×n), the input's gradient (m×n)·(n×k) and the weight's
  gradient (k×m)·(m×n), 6·m·k·n flops together (a step spends two thirds of its matmul flops in
  backward, whose transposed operands run slower than the forward's). By default square (512); a
  worker passes its model's MLP shape (a micro-batch's tokens × d × 4d), the matmul most of a
  transformer's flops go through;
* ``elementwise_bytes_per_s``: an out-of-place add of two tensors of m×n elements (the MLP's
  hidden activation, the size most element-wise work of a step runs on), the bytes read and
  written per second; ``op_overhead_s``: the time of one add of one element, the fixed cost of an
  operation (dispatch, allocation, a kernel launch). The planner prices a step's non-matmul work
  with them (``planner/step_work.py``);
* ``allgather_bytes_per_s`` / ``reduce_scatter_bytes_per_s`` (and ``allreduce_bytes_per_s``):
  one bucket of ``bucket_numel`` elements through the engine's own ``Collectives`` (Gloo's
  broadcast all-gather and two-rank exchange included), as a ring's bus rate:
  ``bytes × (N-1)/N / seconds``, so that ``contract.zero_math.comm_time_s`` inverts it;
* ``optimizer_params_per_s`` / ``host_optimizer_params_per_s``: the gradient's norm and a
  ``torch.optim.AdamW`` step on the device and on the host (where offload steps it), over the
  pieces the engine steps: given
  the job's model, one tensor per parameter of one block and of the root, each this rank's 1/N
  (``engine_timing.py``: pieces that fit in the cache step several times faster per element than
  one flat tensor); without one, a flat tensor of one bucket's shard (``bucket_numel / N``), kept
  between ``MIN_OPTIMIZER_NUMEL`` and ``MAX_OPTIMIZER_NUMEL``;
* ``unit_allgather_bytes_per_s`` / ``grad_reduce_scatter_bytes_per_s``: stage 3's gather of a
  unit and stages 2-3's reduce of a micro-step's gradients as the engine issues them
  (``engine_timing.py``: a re-allocated buffer and the order tag; pre-divided pieces exchanged
  into a new shard), on one block of the job's model (without one, on one bucket), as bus rates
  like the others, and ``root_allgather_bytes_per_s``, the gather on the root's own size (a large
  vocabulary's root is the largest unit by far); None on a world of one (the root's: without a model);
* ``forward_backward_s`` (given the job's model, ``model=``): one micro-batch's forward and
  backward of the model itself, timed piece by piece (``model_timing``: one unit of each kind and
  the root, in the job's dtype and shape), and ``forward_backward_flops``, that micro-batch's
  flops as ``workers.models.flops_per_token`` counts them. The planner prices a step's compute
  from these when they are there (their ratio is the model's own training rate, every kind of
  work included), and from the rates above when not (``planner/step_time.py``).

Each figure is the median of a few repeats after one warm-up, each repeat running the operation
enough times to last ``MIN_REPEAT_S`` (a 1 ms matmul timed once says more about the scheduler
than the device), and every rank of the group takes the slowest rank's figure (a collective step
runs at the pace of the slowest rank).

[Note: a world of one] With no process group, or a group of one rank, nothing is sent: the
bandwidths are ``math.inf`` (a step's communication takes no time); ``to_dict`` writes them as
None, which ``from_dict`` reads back as ``math.inf``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from . import engine_timing
from .collectives import Collectives
from .flat import packed_numel
from .model_timing import TimedModel, time_forward_backward

DEFAULT_REPEATS = 3
DEFAULT_MATMUL_SIZE = 512  # m of the m×m matmul: large enough to run near the device's matmul rate
MIN_OPTIMIZER_NUMEL = 1 << 19  # elements of the AdamW step timed, at least (per-call overhead aside)
MAX_OPTIMIZER_NUMEL = 1 << 23  # and at most (128 MiB of fp32 state with its gradient: out of cache, cheap to time)
DEFAULT_BUCKET_NUMEL = 1 << 20  # when the caller gives no bucket
MIN_REPEAT_S = 0.01  # a repeat runs its operation at least this long


@dataclass(frozen=True)
class Calibration:
    """Measured rates of one job's ranks (the slowest rank's, each); see the module docstring."""

    compute_flops_per_s: float
    allgather_bytes_per_s: float
    reduce_scatter_bytes_per_s: float
    allreduce_bytes_per_s: float = math.inf
    elementwise_bytes_per_s: float = math.inf  # an add's bytes read and written (inf: not measured)
    op_overhead_s: float = 0.0  # the fixed cost of one operation (0: not measured)
    optimizer_params_per_s: float = math.inf  # AdamW on the device (the engine's step without offload)
    host_optimizer_params_per_s: float = math.inf  # AdamW on the host (optimizer offload)
    world_size: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    seconds: float = 0.0  # how long calibrating took
    forward_backward_s: Optional[float] = None  # one micro-batch of the job's model, timed (None: not timed)
    forward_backward_flops: float = 0.0  # that micro-batch's flops (flops_per_token × its tokens)
    #: the engine's own paths (``engine_timing.py``; None: not measured, a world of one or an older
    #: calibration, priced at the bucket's rates): stage 3's gather of one unit, stages 2-3's
    #: reduce of one micro-step's gradients
    unit_allgather_bytes_per_s: Optional[float] = None
    root_allgather_bytes_per_s: Optional[float] = None  # the same gather on the root unit (its own size)
    grad_reduce_scatter_bytes_per_s: Optional[float] = None

    def __post_init__(self) -> None:
        for name in RATES:
            value = getattr(self, name)
            if not value > 0:  # NaN fails too
                raise ValueError(f"{name} must be positive, got {value!r}")
        if not (self.op_overhead_s >= 0 and math.isfinite(self.op_overhead_s)):
            raise ValueError(f"op_overhead_s must be finite and non-negative, got {self.op_overhead_s!r}")
        for name in ENGINE_RATES:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        if self.forward_backward_s is not None:
            for name in ("forward_backward_s", "forward_backward_flops"):
                value = getattr(self, name)
                if not (value > 0 and math.isfinite(value)):
                    raise ValueError(f"{name} must be finite and positive with a timed model, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: an infinite rate (nothing measured: a world of one) becomes None."""
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Calibration":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for name in RATES:
            if name in values and values[name] is None:
                values[name] = math.inf
        return cls(**values)


RATES = ("compute_flops_per_s", "allgather_bytes_per_s", "reduce_scatter_bytes_per_s", "allreduce_bytes_per_s",
         "elementwise_bytes_per_s", "optimizer_params_per_s", "host_optimizer_params_per_s")
TIMES = ("op_overhead_s", "forward_backward_s")
ENGINE_RATES = ("unit_allgather_bytes_per_s", "root_allgather_bytes_per_s",  # None: not measured
                "grad_reduce_scatter_bytes_per_s")


def calibrate(group: Optional[dist.ProcessGroup] = None, dtype: torch.dtype = torch.float32,
              bucket_numel: int = DEFAULT_BUCKET_NUMEL, device: torch.device | str = "cpu",
              repeats: int = DEFAULT_REPEATS, matmul_shape: tuple[int, int, int] | None = None,
              optimizer_numel: Optional[int] = None, model: Optional[TimedModel] = None) -> Calibration:
    """Measure this rank's rates (collectively on ``group``: every rank of it must call this).

    ``group`` None means the default process group when one is initialized, else a world of one.
    ``matmul_shape`` (m, k, n): the timed matmuls' shape, (m×k)·(k×n), and the element-wise add's
    (m×n); None: 512 square. ``optimizer_numel``: the AdamW step's elements; None: one bucket's
    shard, within the module's bounds. ``model``: the job's model and micro-batch, to time its forward and
    backward (``forward_backward_s``); None, or a model that cannot be timed so: not timed.
    """
    m, k, n = matmul_shape or (DEFAULT_MATMUL_SIZE,) * 3
    if repeats < 1 or bucket_numel < 1 or min(m, k, n) < 1 or (optimizer_numel is not None and optimizer_numel < 1):
        raise ValueError("repeats, bucket_numel, matmul_shape and optimizer_numel must be positive")
    started = time.perf_counter()
    device = torch.device(device)
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    world = dist.get_world_size(group) if group is not None else 1
    pieces = engine_timing.model_pieces(None if model is None else model.block)  # (one block, the root)
    stepped = engine_timing.shard_pieces(pieces[0] + pieces[1], world) if pieces and optimizer_numel is None else []
    if sum(stepped) < engine_timing.MIN_PIECE_ELEMENTS:  # no model, or one too small: one flat shard
        optimizer_numel = optimizer_numel or flat_optimizer_numel(bucket_numel, world)
        stepped = [optimizer_numel]
    sync = _synchronizer(device)
    flops = 6.0 * m * k * n / _median_time(_linear_matmuls(m, k, n, dtype, device), repeats, sync)
    elementwise = 3 * m * n * torch.empty((), dtype=dtype).element_size() \
        / _median_time(_add(m * n, dtype, device), repeats, sync)
    overhead = _median_time(_add(1, dtype, device), repeats, sync)
    optimizer = sum(stepped) / _median_time(engine_timing.adamw_pieces(stepped, device), repeats, sync)
    host = optimizer if device.type == "cpu" else sum(stepped) / _median_time(
        engine_timing.adamw_pieces(stepped, torch.device("cpu")), repeats, lambda: None)
    rates = {"compute_flops_per_s": flops, "elementwise_bytes_per_s": elementwise, "optimizer_params_per_s": optimizer,
             "host_optimizer_params_per_s": host, "allgather_bytes_per_s": math.inf,
             "reduce_scatter_bytes_per_s": math.inf, "op_overhead_s": overhead}  # a world of one
    timed = None if model is None else time_forward_backward(model, dtype, device)
    if model is not None:  # every rank sends it (inf: not timed here), so that the collective below matches
        rates["forward_backward_s"] = math.inf if timed is None else timed.seconds
    if world > 1:
        comm = Collectives(group, device)
        numel = -(-bucket_numel // world) * world  # padded to a multiple of N, as the engine's buckets are
        element = torch.empty((), dtype=dtype).element_size()
        bus = (world - 1) / world * numel * element
        for name, run in _collective_runs(comm, numel, dtype, device).items():
            rates[name] = bus / _median_time(run, repeats, sync, local=False)
        for name, (run, padded) in _engine_runs(comm, pieces, numel, dtype, device).items():
            times = repeats if name == "root_allgather_bytes_per_s" else max(repeats, engine_timing.MIN_REPEATS)
            rates[name] = (world - 1) / world * padded * element / _median_time(run, times, sync, local=False)
        rates = _slowest(rates, group, device)
    slowest_s = rates.pop("forward_backward_s", math.inf)  # inf: not timed, here or on some rank
    timed = timed if math.isfinite(slowest_s) else None
    return Calibration(**rates, world_size=world, dtype=str(dtype).removeprefix("torch."), device=str(device),
                       bucket_numel=bucket_numel, seconds=time.perf_counter() - started,
                       forward_backward_s=None if timed is None else slowest_s,
                       forward_backward_flops=0.0 if timed is None else timed.flops)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _median_time(run: Callable[[], None], repeats: int, sync: Callable[[], None], local: bool = True) -> float:
    """Median seconds of one ``run`` over ``repeats`` after one warm-up (never zero). A ``local``
    operation runs, in each repeat, as often as ``MIN_REPEAT_S`` takes by the warm-up's time; a
    collective (``local=False``) once, since every rank of the group must run it equally often."""
    t0 = time.perf_counter()
    run()
    sync()
    count = max(1, math.ceil(MIN_REPEAT_S / max(time.perf_counter() - t0, 1e-9))) if local else 1
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(count):
            run()
        sync()
        times.append((time.perf_counter() - t0) / count)
    return max(statistics.median(times), 1e-9)


def _linear_matmuls(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """A linear layer's three training matmuls: y = x·w, dx = dy·wᵀ, dw = xᵀ·dy."""
    seeded = torch.Generator().manual_seed(0)  # the job's own random state stays untouched
    x = torch.randn(m, k, generator=seeded).to(device=device, dtype=dtype)
    w = torch.randn(k, n, generator=seeded).to(device=device, dtype=dtype)
    dy = torch.randn(m, n, generator=seeded).to(device=device, dtype=dtype)
    y, dx, dw = (torch.empty(shape, dtype=dtype, device=device) for shape in ((m, n), (m, k), (k, n)))

    def run() -> None:
        torch.mm(x, w, out=y)
        torch.mm(dy, w.t(), out=dx)
        torch.mm(x.t(), dy, out=dw)
    return run


def _add(numel: int, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """An out-of-place add, as a step's element-wise operations run (a fresh result each time)."""
    a = torch.ones(numel, dtype=dtype, device=device)
    b = torch.ones(numel, dtype=dtype, device=device)
    return lambda: torch.add(a, b)


def _collective_runs(comm: Collectives, numel: int, dtype: torch.dtype,
                     device: torch.device) -> dict[str, Callable[[], None]]:
    """One bucket through each collective as the engine issues it (the output apart from the
    input, so a two-rank Gloo reduce-scatter is the engine's exchange)."""
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // comm.world_size, dtype=dtype, device=device)
    gathered = torch.empty(numel, dtype=dtype, device=device)
    return {
        "allgather_bytes_per_s": lambda: comm.all_gather(gathered, shard, "calibrate").wait(),
        "reduce_scatter_bytes_per_s": lambda: comm.reduce_scatter(shard, full, "calibrate").wait(),
        "allreduce_bytes_per_s": lambda: comm.all_reduce(full, "calibrate").wait(),
    }


def flat_optimizer_numel(bucket_numel: int, world: int) -> int:
    """The flat tensor AdamW is timed over without the job's model: one bucket's shard, kept between
    ``MIN_OPTIMIZER_NUMEL`` and ``MAX_OPTIMIZER_NUMEL``."""
    return min(max(-(-bucket_numel // world), MIN_OPTIMIZER_NUMEL), MAX_OPTIMIZER_NUMEL)


def _engine_runs(comm: Collectives, pieces: Optional[tuple[list[int], list[int]]], bucket_numel: int,
                 dtype: torch.dtype, device: torch.device) -> dict[str, tuple[Callable[[], None], int]]:
    """The engine's own collective paths (``engine_timing.py``) on one block's parameters (without
    a model: on one bucket), and stage 3's gather of the root on the root's, each with the padded
    elements it moves, laid out as the engine's buckets are (``flat.packed_numel``; the root's
    gathered once: a large vocabulary's root is most of the cost)."""
    block = pieces[0] if pieces and sum(pieces[0]) > 0 else [bucket_numel]
    unit = packed_numel(block, comm.world_size)
    runs = {"unit_allgather_bytes_per_s": (engine_timing.unit_gather(comm, unit, dtype, device), unit),
            "grad_reduce_scatter_bytes_per_s": engine_timing.grad_reduce(comm, block, dtype, device)}
    if pieces and sum(pieces[1]) > 0:
        root = packed_numel(pieces[1], comm.world_size)
        runs["root_allgather_bytes_per_s"] = (engine_timing.unit_gather(comm, root, dtype, device), root)
    return runs


def _slowest(figures: dict[str, float], group: dist.ProcessGroup, device: torch.device) -> dict[str, float]:
    """Every rank's slowest figure of each (a step waits for the slowest rank): the lowest rate, the
    longest time (``TIMES``)."""
    names = sorted(figures)
    signs = [1.0 if n in TIMES else -1.0 for n in names]
    backend_device = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    values = torch.tensor([s * figures[n] for s, n in zip(signs, names)], dtype=torch.float64, device=backend_device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return {n: s * v for s, n, v in zip(signs, names, values.tolist())}
