"""The ZeRO++ quantizers (``workers/zero/quantize.py``): every element comes back within half a
step of its block, |x - dq(q(x))| <= scale / 2 with scale = absmax(block) / qmax, on random and
adversarial blocks; NaN and inf are refused (or poison their block when asked)."""

from __future__ import annotations

import pytest
import torch

from workers.zero.quantize import BLOCK_ELEMENTS, QMAX, blocks, code_bytes, dequantize, quantize, quantized_nbytes

BITS = (8, 4)


def _block_scales(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The stated scale of each element's block, computed here from the definition."""
    flat = x.reshape(-1).float()
    nb = blocks(flat.numel())
    padded = torch.cat([flat, flat.new_zeros(nb * BLOCK_ELEMENTS - flat.numel())])
    absmax = padded.view(nb, BLOCK_ELEMENTS).abs().amax(dim=1)
    scale = (absmax / QMAX[bits]).clamp(min=torch.finfo(torch.float32).tiny)
    return scale.repeat_interleave(BLOCK_ELEMENTS)[:flat.numel()]


def _check_round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    codes, scales = quantize(x, bits)
    assert codes.numel() == code_bytes(x.numel(), bits) and scales.numel() == blocks(x.numel())
    assert codes.element_size() == 1 and scales.dtype == torch.float32
    back = dequantize(codes, scales, x.numel(), bits)
    bound = _block_scales(x, bits) / 2
    err = (x.reshape(-1).float() - back).abs()
    # fp32 rounding of x / s and of q * s: a few ulps of the scale on top of the bound
    assert bool((err <= bound * (1 + 1e-5)).all()), (bits, float((err - bound).max()))
    return back


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel", [1, 7, 2047, 2048, 2049, 3 * 2048 + 5, 20_000])
def test_random_round_trip_is_within_half_a_step(bits, numel):
    g = torch.Generator().manual_seed(numel + bits)
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 3, numel)[torch.randperm(numel, generator=g)]
    back = _check_round_trip(x, bits)
    if bits == 8 and numel >= 2048:  # the bound is not vacuous: most elements are not exact
        assert (back != x).float().mean() > 0.5


@pytest.mark.parametrize("bits", BITS)
def test_adversarial_blocks(bits):
    zeros = torch.zeros(2 * BLOCK_ELEMENTS + 3)
    assert torch.equal(_check_round_trip(zeros, bits), zeros)  # all zeros come back exactly
    outlier = torch.full((BLOCK_ELEMENTS,), 1e-3)
    outlier[17] = 1e4  # one outlier: the rest of its block rounds to 0, within the bound
    back = _check_round_trip(outlier, bits)
    assert back[17] == pytest.approx(1e4, rel=1e-6)
    tiny = torch.full((1000,), 1e-42)  # subnormal: the scale must not underflow to zero
    tiny[::2] = -3e-43
    _check_round_trip(tiny, bits)
    huge = torch.tensor([3e38, -3e38, 1.0, 0.0])
    _check_round_trip(huge, bits)
    exact = torch.arange(-QMAX[bits], QMAX[bits] + 1, dtype=torch.float32) * 0.5  # on the grid: exact
    assert torch.equal(_check_round_trip(exact, bits), exact)


@pytest.mark.parametrize("bits", BITS)
def test_bf16_input_and_preallocated_buffers(bits):
    x = torch.randn(5000, dtype=torch.bfloat16)
    codes = torch.empty(code_bytes(5000, bits), dtype=torch.uint8)
    scales = torch.empty(blocks(5000))
    got, got_scales = quantize(x, bits, codes=codes, scales=scales)
    assert got is codes and got_scales is scales
    out = torch.empty(5000, dtype=torch.bfloat16)
    dequantize(codes, scales, 5000, bits, out=out)
    assert torch.equal(out, dequantize(*quantize(x, bits), 5000, bits).bfloat16())
    _check_round_trip(x, bits)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_is_refused(bad):
    x = torch.randn(3000)
    x[2500] = bad
    for bits in BITS:
        with pytest.raises(ValueError, match="NaN or inf"):
            quantize(x, bits)


def test_poison_turns_a_non_finite_block_into_nan_and_keeps_the_others():
    x = torch.randn(3 * BLOCK_ELEMENTS)
    x[BLOCK_ELEMENTS + 5] = float("inf")
    back = dequantize(*quantize(x, 4, poison=True), x.numel(), 4)
    assert bool(back[BLOCK_ELEMENTS:2 * BLOCK_ELEMENTS].isnan().all())
    clean = torch.cat([x[:BLOCK_ELEMENTS], x[2 * BLOCK_ELEMENTS:]])
    assert torch.equal(torch.cat([back[:BLOCK_ELEMENTS], back[2 * BLOCK_ELEMENTS:]]),
                       dequantize(*quantize(clean, 4), clean.numel(), 4))


def test_wire_bytes_and_bad_widths():
    assert quantized_nbytes(4096, 8) == 4096 + 2 * 4
    assert quantized_nbytes(4097, 4) == 2049 + 3 * 4
    with pytest.raises(ValueError, match="bits must be 8"):
        quantize(torch.ones(4), 2)
    with pytest.raises(ValueError, match="block must be"):
        quantize(torch.ones(4), 8, block=4096)
