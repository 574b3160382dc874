"""Blockwise symmetric quantization for ZeRO++'s communication (qwZ: int8 weights, qgZ: int4
gradients), in plain torch so that it runs on every backend (Gloo included).

A flat tensor is cut into blocks of ``BLOCK_ELEMENTS`` consecutive elements (the last one may
be shorter). Each block gets one fp32 scale ``s = absmax / qmax`` (``qmax`` = 127 for int8, 7
for int4) and each element the code ``q = round(x / s)``, an integer in ``[-qmax, qmax]``;
dequantization is ``q * s``. Since ``|x / s| <= qmax`` no code is clamped, so every element
comes back within half a step:

    |x - dq(q(x))| <= s / 2          per element, s = absmax(block) / qmax

(up to fp32 rounding of the division and the product: a few ulps of ``s``). A scale below the
smallest normal fp32 (a block of tiny or zero values) is raised to it, so a scale never
underflows to zero; the bound then holds with that scale. An all-zero block comes back as
zeros exactly. int4 codes are stored offset by 8 (1..15), two per byte: element ``2k`` in the
low nibble, ``2k + 1`` in the high one.

Non-finite input has no scale: ``quantize`` refuses it (``ValueError``) unless asked to
``poison`` it, what the gradient path does -- the block's scale becomes NaN, so the
dequantized block is NaN and the step's non-finite gradient norm is seen as it would be
without quantization (an fp16 overflow then skips the step as usual).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from contract.zero_math import QUANT_BLOCK_ELEMENTS

#: elements per block, each with one fp32 scale: 2,048 (the planner's figure, defined there)
BLOCK_ELEMENTS = QUANT_BLOCK_ELEMENTS
#: the largest code magnitude of each supported width (symmetric: -QMAX..QMAX)
QMAX = {8: 127, 4: 7}
#: what a scale takes: one fp32 per block
SCALE_BYTES = 4
_TINY = torch.finfo(torch.float32).tiny


def blocks(numel: int, block: int = BLOCK_ELEMENTS) -> int:
    """How many blocks (and so scales) ``numel`` elements take."""
    return -(-numel // block)


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of the codes of ``numel`` elements: one per element at 8 bits, one per two at 4."""
    _check_bits(bits)
    return numel if bits == 8 else -(-numel // 2)


def quantized_nbytes(numel: int, bits: int, block: int = BLOCK_ELEMENTS) -> int:
    """Bytes on the wire for ``numel`` elements: the codes and one fp32 scale per block."""
    return code_bytes(numel, bits) + SCALE_BYTES * blocks(numel, block)


def quantize(x: torch.Tensor, bits: int, *, codes: Optional[torch.Tensor] = None,
             scales: Optional[torch.Tensor] = None, block: int = BLOCK_ELEMENTS,
             poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any floating dtype, read flat) as ``(codes, scales)``: int8 codes at 8 bits, uint8
    with two codes a byte at 4 bits, and fp32 scales, one per block; written into ``codes`` and
    ``scales`` when given (sized by ``code_bytes`` and ``blocks``).

    Non-finite input raises ``ValueError``; with ``poison`` its blocks get a NaN scale instead
    (the module note)."""
    _check_bits(bits)
    if not 0 < block <= BLOCK_ELEMENTS:
        raise ValueError(f"block must be 1..{BLOCK_ELEMENTS} elements, got {block}")
    flat = x.detach().reshape(-1)
    n, nb, full = flat.numel(), blocks(flat.numel(), block), flat.numel() // block
    main, tail = flat[:full * block].view(full, block), flat[full * block:]
    scale = scales.view(-1) if scales is not None else torch.empty(nb, dtype=torch.float32, device=flat.device)
    if full:  # the largest magnitude per block, in one pass (NaN and inf propagate into it)
        torch.linalg.vector_norm(main, ord=math.inf, dim=1, dtype=torch.float32, out=scale[:full])
    if nb > full:
        scale[full:] = tail.abs().max().float()
    finite = torch.isfinite(scale)
    clean = bool(finite.all())
    if not clean and not poison:
        raise ValueError(f"cannot quantize a tensor holding NaN or inf ({x.numel()} elements, "
                         f"{int((~torch.isfinite(x)).sum())} not finite)")
    qmax = QMAX[bits]
    scale.div_(qmax).clamp_(min=_TINY)
    if not clean:
        scale.masked_fill_(~finite, float("nan"))
    q = torch.empty(n, dtype=torch.float32, device=flat.device)
    if full:
        torch.div(main, scale[:full].unsqueeze(1), out=q[:full * block].view(full, block))
    if nb > full:
        torch.div(tail, scale[full:], out=q[full * block:])
    if not clean:  # a poisoned block's codes are 0; its NaN scale carries the poison
        q.nan_to_num_(0.0, 0.0, 0.0)
    q.round_().clamp_(-qmax, qmax)
    if bits == 8:
        out = codes.view(-1).view(torch.int8) if codes is not None else torch.empty(n, dtype=torch.int8,
                                                                                    device=flat.device)
        out.copy_(q)
    else:  # offset by 8, element 2k in the low nibble, 2k + 1 in the high one
        q.add_(8)
        packed = q[0::2].clone()
        high = q[1::2]
        packed[:high.numel()].add_(high, alpha=16)
        packed[high.numel():].add_(8 * 16)  # an odd count: the last byte's high nibble codes a 0
        out = codes.view(-1) if codes is not None else torch.empty(packed.numel(), dtype=torch.uint8,
                                                                   device=flat.device)
        out.copy_(packed)
    return (codes if codes is not None else out), (scales if scales is not None else scale)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, *,
               out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32,
               block: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """The ``numel`` values ``quantize`` encoded as ``codes`` and ``scales``, into ``out`` (any
    floating dtype, flat) when given, else a new ``dtype`` tensor."""
    _check_bits(bits)
    if bits == 8:
        q = codes.reshape(-1).view(torch.int8)[:numel]
    else:
        packed = codes.reshape(-1)
        q = torch.empty(2 * packed.numel(), dtype=torch.uint8, device=packed.device)
        torch.bitwise_and(packed, 0xF, out=q[0::2])
        torch.bitwise_right_shift(packed, 4, out=q[1::2])
        q = q[:numel].view(torch.int8).sub_(8)
    scale = scales.reshape(-1)
    full, nb = numel // block, blocks(numel, block)
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
    values = out.view(-1) if direct else torch.empty(numel, dtype=torch.float32, device=q.device)
    if full:
        torch.mul(q[:full * block].view(full, block), scale[:full].unsqueeze(1),
                  out=values[:full * block].view(full, block))
    if nb > full:
        torch.mul(q[full * block:], scale[full:nb], out=values[full * block:])
    if direct:
        return out
    if out is None:
        return values if dtype == torch.float32 else values.to(dtype)
    out.view(-1).copy_(values)
    return out


def _check_bits(bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 (weights) or 4 (gradients), got {bits!r}")
