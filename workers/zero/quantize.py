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

from typing import Optional

import torch

#: elements per block, each with one fp32 scale (ZeRO++'s paper and DeepSpeed use 2,048 at most)
BLOCK_ELEMENTS = 2048
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
    flat = x.detach().reshape(-1).float()
    n, nb = flat.numel(), blocks(flat.numel(), block)
    if n % block:
        flat = torch.cat([flat, flat.new_zeros(nb * block - n)])
    rows = flat.view(nb, block)
    finite = torch.isfinite(rows).all(dim=1)
    if not poison and not bool(finite.all()):
        raise ValueError(f"cannot quantize a tensor holding NaN or inf ({x.numel()} elements, "
                         f"{int((~torch.isfinite(x)).sum())} not finite)")
    qmax = QMAX[bits]
    if not poison or bool(finite.all()):
        scale = rows.abs().amax(dim=1).div_(qmax).clamp_(min=_TINY)
    else:
        scale = rows.nan_to_num(0.0, 0.0, 0.0).abs().amax(dim=1).div_(qmax).clamp_(min=_TINY)
        scale.masked_fill_(~finite, float("nan"))
        rows = rows.nan_to_num(0.0, 0.0, 0.0)
    q = rows.div(scale.unsqueeze(1)).nan_to_num_(0.0).round_().clamp_(-qmax, qmax).view(-1)[:n]
    if bits == 8:
        out = q.to(torch.int8)
    else:
        q = q.add_(8).to(torch.uint8)
        if n % 2:
            q = torch.cat([q, q.new_full((1,), 8)])
        pairs = q.view(-1, 2)
        out = pairs[:, 0] | (pairs[:, 1] << 4)
    if codes is not None:
        codes.copy_(out.view(codes.dtype) if bits == 8 else out)
        out = codes
    if scales is not None:
        scales.copy_(scale)
        scale = scales
    return out, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, *,
               out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32,
               block: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """The ``numel`` values ``quantize`` encoded as ``codes`` and ``scales``, into ``out`` (any
    floating dtype, flat) when given, else a new ``dtype`` tensor."""
    _check_bits(bits)
    if bits == 8:
        q = codes.reshape(-1).view(torch.int8).float()
    else:
        packed = codes.reshape(-1)
        q = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1).float().sub_(8)
    nb = blocks(numel, block)
    if nb * block != q.numel():
        q = torch.cat([q[:numel], q.new_zeros(nb * block - numel)]) if nb * block > numel else q[:nb * block]
    values = q.view(nb, block).mul_(scales.reshape(-1)[:nb].unsqueeze(1)).view(-1)[:numel]
    if out is None:
        return values.to(dtype)
    out.view(-1).copy_(values)
    return out


def _check_bits(bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 (weights) or 4 (gradients), got {bits!r}")
