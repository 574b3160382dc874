"""ZeRO++'s quantized collectives (qwZ, qgZ) over any backend, Gloo included.

``Collectives`` calls these when ``ZeroConfig(quantized_weights=True)`` (stage 3's parameter
all-gathers) or ``quantized_gradients=True`` (every gradient reduce-scatter); each returns a work
whose ``wait()`` leaves the collective's result where the exact one would have put it.

* **qwZ** (``all_gather``): each rank quantizes its shard to blockwise int8 (``quantize.py``:
  one fp32 scale per block of at most ``BLOCK_ELEMENTS``), the codes and the scales are
  all-gathered (two gathers, the same path as an exact one: ``Collectives.gather_work``), and
  every rank's slice -- its own included, so that every rank computes with the same weights --
  is dequantized into the gathered compute-dtype buffer (``QuantizedGather``; hpZ keeps a
  slice of the received codes and scales for the backward's gather, ``hpz.py``). Only the
  gathered copy is lossy: the shards, the fp32 masters and so every checkpoint and state dict are exact.
* **qgZ** (``reduce_scatter``, the one-level variant): each rank cuts its full (pre-divided)
  gradient bucket into the N destination shards, quantizes each to blockwise int4 (two codes a
  byte, one fp32 scale per block within a shard), and one all-to-all of the codes and one of
  the scales deliver to each rank every rank's quantized copy of its shard; it dequantizes them
  and sums in fp32, in rank order (the same order on every rank), then writes its shard in the
  compute dtype. ZeRO++'s paper does this in two levels (an all-to-all within a node, a
  reduction, then one across nodes) so that cross-node traffic shrinks further; this is one
  all-to-all over the shard group. With hybrid sharding the reduced shard is then all-reduced
  across the replicate group exactly (``Collectives.reduce_scatter``).

[Note: what is counted]
``comm`` is the calling ``Collectives`` (typed ``Any``: this module is below it in the import graph).
Elements count what the collective stands for (as the exact one: an all-gather its output, a
reduce-scatter its input); bytes what was handed to the wire under the same convention: the
gathered int8 codes and scales, and for qgZ the int4 codes and scales of the whole bucket (the
part a rank keeps for itself included, as an exact reduce-scatter counts its whole input). So
against bf16, qwZ's all-gather bytes are (1 + 4/B)/2 and qgZ's reduce-scatter bytes
(1/2 + 4/B)/2 of the exact ones, B the block (a shard shorter than a block pays one scale).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .quantize import blocks, code_bytes, dequantize, quantize
from .work import _Then, nbytes

#: code widths: weights in int8 (qwZ), gradients in int4 (qgZ)
WEIGHT_BITS = 8
GRADIENT_BITS = 4


class QuantizedGather(_Then):
    """qwZ's all-gather in flight: waited, it dequantizes the received codes into the output, then
    hands them to ``keep`` when one was set (hpZ keeps its slice of them, ``hpz.py``)."""

    def __init__(self, works, n: int, codes: torch.Tensor, scales: torch.Tensor, output: torch.Tensor):
        super().__init__(works, self._unpack)
        self.n = n
        self.keep: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None
        self._parts: Optional[tuple] = (codes, scales, output)

    def _unpack(self) -> None:
        (codes, scales, output), self._parts = self._parts, None
        unpack(codes, scales, self.n, output)
        keep, self.keep = self.keep, None
        if keep is not None:
            keep(codes, scales)


def unpack(codes: torch.Tensor, scales: torch.Tensor, n: int, output: torch.Tensor) -> None:
    """Dequantize the int8 ``codes`` and fp32 ``scales`` that ``n`` ranks' shards were gathered as
    into ``output``, each rank's into its slice: its own too, so every rank computes with the same weights."""
    flat = output.view(-1)
    shard = flat.numel() // n
    nb = blocks(shard)
    for r in range(n):
        dequantize(codes[r * shard:(r + 1) * shard], scales[r * nb:(r + 1) * nb], shard, WEIGHT_BITS,
                   out=flat[r * shard:(r + 1) * shard])


def all_gather(comm: Any, output: torch.Tensor, input: torch.Tensor) -> QuantizedGather:
    """qwZ: gather every rank's ``input`` into ``output`` as int8 codes and fp32 scales."""
    n, shard = comm.world_size, input.numel()
    if output.numel() != shard * n:
        raise ValueError(f"quantized all-gather of {shard} elements per rank into {output.numel()}")
    nb = blocks(shard)
    codes = torch.empty(n * shard, dtype=torch.int8, device=input.device)
    scales = torch.empty(n * nb, dtype=torch.float32, device=input.device)
    codes_slot, scales_slot = codes.narrow(0, comm.rank * shard, shard), scales.narrow(0, comm.rank * nb, nb)
    quantize(input, WEIGHT_BITS, codes=codes_slot, scales=scales_slot)
    comm.counter.add("all_gather", output.numel(), nbytes(codes) + nbytes(scales), comm.group_name)
    works = [comm.gather_work(codes, codes_slot, "quantized all-gather codes"),
             comm.gather_work(scales, scales_slot, "quantized all-gather scales")]
    return QuantizedGather(works, n, codes, scales, output)


def reduce_scatter(comm: Any, output: torch.Tensor, input: torch.Tensor):
    """qgZ: ``output`` = this rank's shard of the sum over ranks of ``input``, sent as int4 codes
    and fp32 scales through an all-to-all and summed in fp32. ``output`` may be ``input``'s own
    slot: it is written only once every message has arrived."""
    n = comm.world_size
    flat = input.view(-1)
    shard = flat.numel() // n
    if shard * n != flat.numel() or output.numel() != shard:
        raise ValueError(f"quantized reduce-scatter of {flat.numel()} elements into {output.numel()} on {n} ranks")
    width, nb = code_bytes(shard, GRADIENT_BITS), blocks(shard)
    send_codes = torch.empty(n, width, dtype=torch.uint8, device=input.device)
    send_scales = torch.empty(n, nb, dtype=torch.float32, device=input.device)
    for r in range(n):  # a non-finite gradient poisons its block: the step's norm sees it (quantize.py)
        quantize(flat[r * shard:(r + 1) * shard], GRADIENT_BITS, codes=send_codes[r], scales=send_scales[r],
                 poison=True)
    comm.counter.add("reduce_scatter", 0, nbytes(send_codes) + nbytes(send_scales),  # elements: the caller's
                     comm.group_name)
    recv_codes, recv_scales = torch.empty_like(send_codes), torch.empty_like(send_scales)

    def both(async_op: bool):
        return [dist.all_to_all_single(recv_codes, send_codes, group=comm.group, async_op=async_op),
                dist.all_to_all_single(recv_scales, send_scales, group=comm.group, async_op=async_op)]

    work = comm._issue(comm.reduce_stream, both)  # CPU: the two works; CUDA: the side stream's event

    def reduce() -> None:
        total = torch.zeros(shard, dtype=torch.float32, device=input.device)
        for r in range(n):
            total.add_(dequantize(recv_codes[r], recv_scales[r], shard, GRADIENT_BITS))
        output.view(-1).copy_(total)
        del sent[:]  # the send buffers were kept alive until here

    sent = [send_codes, send_scales]
    return _Then(work if isinstance(work, list) else [work], reduce)
