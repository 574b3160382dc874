"""Time one micro-batch's forward and backward of a job's own model, one piece at a time.

Why: pricing a step's compute from counts (matmul flops at a matmul rate, element-wise bytes at
an add's rate, operations at an add's overhead) leaves out whatever the counts' rates do not
stand for: attention's kernel, GELU's tanh and layer norm cost more per byte than an add, the
projections' shapes run slower than the MLP's, autograd's bookkeeping per node. Timing the
model's own work includes all of it by construction. The whole model is not needed (at stage 3
no rank may hold it): a transformer is its units (``units.unit_modules``: the blocks) and a
root (embeddings, final norm, head and loss), and equal units take equal time, so one unit of
each kind is timed, and the root with every unit replaced by a pass-through.

How, for one micro-batch of ``micro_batch`` × ``seq_len`` tokens in the compute dtype:

1. the model is built on the meta device and run forward once there, recording each unit's
   inputs and outputs (shapes, dtypes, which input requires grad);
2. units are grouped by kind (class, parameter shapes, input shapes); one unit of each kind is
   copied, given real random parameters on the device, fed random inputs of the recorded
   shapes (integer inputs zero, boolean ones true) and timed through forward and backward
   (its outputs' gradients all ones);
3. the root: a copy of the meta model whose units are ``PassThrough`` modules (each returns its
   first input in the place of the recorded output of that shape) is given real parameters
   and timed through the job's loss and backward;

and the micro-batch's time is the root's plus each kind's time × its count. A model that cannot
be run so (one that does not run on meta, a unit whose inputs are not tensors of fixed shape)
is not timed (None): the planner then prices its compute from counts.

What is left out: the engine's own work around the model (``engine_timing.py`` times the parts
that the step-time model prices: stage 3's gathers, the gradient reduces, the optimizer's pieces),
the recomputation of activation checkpointing, and a boundary effect between the pieces (the
caches a block's output warms for the next).

[Note: the cost] Each piece runs once to warm up and then up to ``repeats`` times, stopping
after ``budget_s`` of timed runs (one at least): about twice the forward and backward of one
unit and the root, per kind, well under a second for the presets at a few thousand tokens.
The root of a large vocabulary (gpt-small: 50304 × 768) is most of it.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .units import unit_modules

DEFAULT_REPEATS = 3
DEFAULT_BUDGET_S = 0.2  # timed runs of one piece stop after this long (after the first)
INIT_STD = 0.02  # the random parameters' scale (values do not change a dense kernel's time)


@dataclass(frozen=True)
class TimedModel:
    """What to time: a job's ``model`` block (``workers.models.build_model``'s) and one micro-batch's
    shape (``vocab_size`` None: the model's own, as the planner's profiles take it)."""

    block: dict[str, Any]
    micro_batch: int
    seq_len: int
    vocab_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ForwardBackward:
    """One micro-batch's timed forward and backward: the whole (``seconds``), its root's part, the
    units' (each kind's time × count, summed), its flops (``workers.models.flops_per_token`` × its
    tokens) and tokens."""

    seconds: float
    root_s: float
    units_s: float
    flops: float
    tokens: int
    kinds: int  # distinct kinds of unit timed


class PassThrough(nn.Module):
    """A unit taken out of the model: returns its first input where the unit returned a tensor of
    that shape (and zeros for any other tensor it returned), in the structure recorded on meta."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output  # meta tensors: shapes and dtypes only

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))

        def place(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if t.shape == first.shape:
                return first
            return torch.zeros(t.shape, dtype=t.dtype, device=first.device)
        return tree_map(place, self.output)


def time_forward_backward(model: TimedModel, dtype: torch.dtype, device: torch.device | str = "cpu",
                          repeats: int = DEFAULT_REPEATS, budget_s: float = DEFAULT_BUDGET_S,
                          ) -> Optional[ForwardBackward]:
    """One micro-batch's forward and backward of the job's model, timed piece by piece (the module
    docstring); None when the model cannot be timed so."""
    if repeats < 1:
        raise ValueError(f"repeats must be positive, got {repeats!r}")
    try:
        return _time(model, dtype, torch.device(device), repeats, budget_s)
    except Exception:  # noqa: BLE001 - a model that cannot be timed so is priced from counts
        return None


def _time(job: TimedModel, dtype: torch.dtype, device: torch.device, repeats: int,
          budget_s: float) -> Optional[ForwardBackward]:
    from contract.presets import BYTE_VOCAB
    from workers.models import flops_per_token

    from .planner.activations import _FlashAttentionOnMeta, default_loss, hf_loss, token_batch
    from .planner.shape import build_on_meta

    micro_batch, seq_len = job.micro_batch, job.seq_len
    model = build_on_meta(job.block).to(dtype)
    vocab = job.vocab_size or getattr(getattr(model, "config", None), "vocab_size", None) or BYTE_VOCAB
    loss_fn = hf_loss if job.block.get("hf") else default_loss
    units = [module for _, module in unit_modules(model)]
    seen = _record(model, units, lambda: loss_fn(model, token_batch(micro_batch, seq_len, vocab, "meta")),
                   _FlashAttentionOnMeta())
    if any(id(u) not in seen for u in units):
        return None  # a unit the forward never ran: its time is not known
    kinds: dict[Any, list[nn.Module]] = {}
    for unit in units:
        kinds.setdefault(_kind(unit, seen[id(unit)]), []).append(unit)
    generator = torch.Generator().manual_seed(0)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    units_s = 0.0
    for members in kinds.values():
        run = _unit_run(members[0], seen[id(members[0])], device, generator)
        units_s += len(members) * _median_time(run, repeats, budget_s, sync)
    shell = _shell(model, units, seen)
    _materialize(shell, device, generator)
    batch = token_batch(micro_batch, seq_len, vocab, device)

    def root_run() -> None:
        _clear_grads(shell)
        loss_fn(shell, batch).backward()
    root_s = _median_time(root_run, repeats, budget_s, sync)
    tokens = micro_batch * seq_len
    return ForwardBackward(seconds=root_s + units_s, root_s=root_s, units_s=units_s,
                           flops=flops_per_token(model, seq_len) * tokens, tokens=tokens, kinds=len(kinds))


def _record(model: nn.Module, units: list[nn.Module], forward: Callable[[], Any],
            mode: Any) -> dict[int, tuple[Any, Any, Any]]:
    """Each unit's (args, kwargs, output) of one forward on meta, by the unit's id (its first call)."""
    seen: dict[int, tuple[Any, Any, Any]] = {}

    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        seen.setdefault(id(module), (args, kwargs, output))
    handles = [u.register_forward_hook(hook, with_kwargs=True) for u in units]
    try:
        with mode:
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _kind(unit: nn.Module, recorded: tuple[Any, Any, Any]) -> Any:
    """Units of one kind take one time: the same class, parameters and input shapes."""
    leaves, _ = tree_flatten(recorded[:2])
    inputs = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in leaves)
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in unit.named_parameters())
    return type(unit).__qualname__, params, inputs


def _unit_run(unit: nn.Module, recorded: tuple[Any, Any, Any], device: torch.device,
              generator: torch.Generator) -> Callable[[], None]:
    """One unit's forward and backward on real random parameters and inputs."""
    real = copy.deepcopy(unit)
    _materialize(real, device, generator)
    args, kwargs = tree_map(lambda t: _real_like(t, device, generator), recorded[:2])
    outputs = [t for t in tree_flatten(recorded[2])[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = [torch.ones(t.shape, dtype=t.dtype, device=device) for t in outputs]

    def run() -> None:
        _clear_grads(real)
        out = [t for t in tree_flatten(real(*args, **kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.backward(out, grads)
    return run


def _real_like(t: Any, device: torch.device, generator: torch.Generator) -> Any:
    """A real tensor of a recorded meta tensor's shape and dtype (random floats, zero integers,
    true booleans), requiring grad where the recorded one did; anything else as it was."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.dtype.is_floating_point:
        real = torch.randn(t.shape, generator=generator).to(device=device, dtype=t.dtype)
        return real.requires_grad_(t.requires_grad)
    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=t.dtype, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def _shell(model: nn.Module, units: list[nn.Module], seen: dict[int, tuple[Any, Any, Any]]) -> nn.Module:
    """A copy of the meta model with every unit replaced by a ``PassThrough``: the root alone."""
    names = {id(module): name for name, module in model.named_modules()}
    shell = copy.deepcopy(model)
    for unit in units:
        parent_name, _, child = names[id(unit)].rpartition(".")
        parent = shell.get_submodule(parent_name) if parent_name else shell
        setattr(parent, child, PassThrough(seen[id(unit)][2]))
    return shell


def _materialize(module: nn.Module, device: torch.device, generator: torch.Generator) -> None:
    """Real storage on ``device`` for a meta module's parameters (random, ``INIT_STD``) and buffers
    (floats one, integers zero, booleans true: finite values, no denormals to slow a kernel).
    A ``PassThrough``'s record is a plain attribute, not a buffer: it stays on meta."""
    module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            if p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=generator).mul_(INIT_STD))
            else:
                p.zero_()
        for b in module.buffers():
            if b.dtype.is_floating_point:
                b.fill_(1.0)
            else:
                b.fill_(b.dtype == torch.bool)


def _clear_grads(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _median_time(run: Callable[[], None], repeats: int, budget_s: float, sync: Callable[[], None]) -> float:
    """Median seconds of ``run`` after one warm-up: up to ``repeats`` runs, fewer once ``budget_s`` is spent."""
    run()
    sync()
    times: list[float] = []
    while len(times) < repeats and (not times or sum(times) < budget_s):
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)
