"""A training step's work besides its matmuls: element-wise bytes and dispatched operations.

Why: ``flops_per_token`` counts a step's matmul flops, and a step priced at the matmul rate
alone leaves out everything else it runs: layer norms, GELU, residual adds, the softmax and
cross-entropy over the vocabulary, the embedding's gradient, autograd's gradient sums, and a
fixed cost per operation (the dispatcher, an allocation, a kernel launch). That work is not a
constant fraction of the flops: it grows with the activations (and the vocabulary) while the
flops grow with the parameters, so a small model is mostly that work and a large one mostly
matmuls. Formulas for it would go stale with every model change, so it is counted instead:
one micro-batch's forward and backward of the job's own model runs on the meta device under
``WorkCounter`` (sizes without data, well under a second for the presets), and the planner
prices the counts with rates the job's ranks measure (``workers.zero.calibration``:
``elementwise_bytes_per_s``, ``op_overhead_s``).

What is counted, per dispatched aten operation:

* a matmul-class operation (mm, addmm, bmm, attention's kernels, convolutions): one operation,
  no bytes (its time is its flops at the matmul rate);
* a view (``OpOverload.is_view``: transpose, view, detach, ...) or an allocation (``empty``):
  one operation, no bytes (it moves no data);
* anything else: one operation, and the bytes of every tensor it reads and writes (its tensor
  arguments and results, each ``numel × element size``; an in-place operation's result is the
  argument it wrote, counted as read and as written).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from contract.presets import BYTE_VOCAB

from ..config import PRECISIONS
from .activations import _FlashAttentionOnMeta, default_loss, hf_loss, token_batch
from .model_key import ModelKey

#: operation families priced by their flops (``flops_per_token``), not by bytes
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "convolution",
                     "convolution_backward", "_convolution"})
ATTENTION_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


@dataclass(frozen=True)
class StepWork:
    """One rank's non-matmul work: bytes element-wise operations move, operations dispatched."""

    elementwise_bytes: int = 0
    ops: int = 0

    def times(self, count: int) -> "StepWork":
        """The work of ``count`` micro-batches (a step's accumulation steps)."""
        return StepWork(self.elementwise_bytes * count, self.ops * count)


def is_matmul(name: str) -> bool:
    """Whether an aten operation (its overload packet's name) is priced by flops."""
    return name in MATMULS or name.startswith(ATTENTION_PREFIXES)


def _tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class WorkCounter(TorchDispatchMode):
    """Counts ``StepWork`` over every aten operation dispatched while active (the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.elementwise_bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        name = func.overloadpacket.__name__
        if not (func.is_view or name in ALLOCATIONS or is_matmul(name)):
            self.elementwise_bytes += _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        return out

    @property
    def work(self) -> StepWork:
        return StepWork(self.elementwise_bytes, self.ops)


def count_step_work(model_spec: dict[str, Any], micro_batch: int, seq_len: int, precision: str,
                    vocab_size: int | None = None) -> StepWork:
    """One micro-batch's forward and backward of the job's model (its ``model`` block), in its
    training dtype on the meta device; cached per (model, shape, precision)."""
    return _count_on_meta(ModelKey.of(model_spec), micro_batch, seq_len, precision, vocab_size)


@functools.lru_cache(maxsize=64)
def _count_on_meta(model_key: ModelKey, micro_batch: int, seq_len: int, precision: str,
                   vocab: int | None) -> StepWork:
    from workers.models import build_model

    block = model_key.block()
    with torch.device("meta"):
        model = build_model(block).to(PRECISIONS[precision])
    vocab = vocab or getattr(getattr(model, "config", None), "vocab_size", None) or BYTE_VOCAB
    batch = token_batch(micro_batch, seq_len, vocab, "meta")
    loss_fn = hf_loss if block.get("hf") else default_loss
    counter = WorkCounter()
    with _FlashAttentionOnMeta(), counter:
        loss_fn(model, batch).backward()
    return counter.work
