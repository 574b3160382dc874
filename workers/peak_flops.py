"""Dense peak FLOP/s per accelerator model and matmul precision: the denominator of MFU.

[Note: which peak]
MFU is achieved FLOP/s over what the device's tensor cores (or, for plain fp32, its FP32 units)
can do *in the precision the run's matmuls actually use*: a bf16 run over the bf16 peak, an
fp32 run over the fp32 peak -- or the TF32 peak when torch lets fp32 matmuls use TF32
(``torch.backends.cuda.matmul.allow_tf32``). Dividing an fp32 run by the bf16 peak would
understate it by the ratio of the two peaks, an order of magnitude. Figures are the vendors' dense (not 2:4 sparse) datasheet peaks,
per device torch sees (an MI250X is two devices). A model without a precision (bf16 on V100
or T4, TF32 before Ampere) has no entry for it: no MFU rather than a wrong one.

[Note: exact model names]
``torch.cuda.get_device_name()`` says e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
"Tesla V100-SXM2-16GB", "NVIDIA L40S". The name is split into words (at spaces, ``-`` and
``_``), and a table key -- one or more words -- matches only whole consecutive words; the
longest matching key wins ("H100 PCIe" over "H100"). So "L4" never matches "L40" or "L40S",
and "H20" never "H200", as a substring match would.
"""

from __future__ import annotations

import re
from typing import Any, Optional

T = 1e12

#: model key (words, upper case) -> {matmul precision: dense peak FLOP/s}
PEAK_FLOPS: dict[tuple[str, ...], dict[str, float]] = {
    ("B200",): {"fp32": 75 * T, "tf32": 1125 * T, "bf16": 2250 * T, "fp16": 2250 * T},
    ("H200",): {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T},
    ("H200", "NVL"): {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T},
    ("GH200",): {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T},
    ("H100",): {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T},  # SXM
    ("H100", "PCIE"): {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T},
    ("H100", "NVL"): {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T},
    ("H20",): {"fp32": 44 * T, "tf32": 74 * T, "bf16": 148 * T, "fp16": 148 * T},
    ("A100",): {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},  # SXM and PCIe
    ("A10",): {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T},
    ("A10G",): {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T},  # as the A10
    ("L40S",): {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362 * T, "fp16": 362 * T},
    ("L40",): {"fp32": 90.5 * T, "tf32": 90.5 * T, "bf16": 181 * T, "fp16": 181 * T},
    ("L4",): {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T},
    ("RTX", "4090"): {"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165.2 * T, "fp16": 165.2 * T},  # fp32 accumulate
    ("RTX", "3090"): {"fp32": 35.6 * T, "tf32": 35.6 * T, "bf16": 71 * T, "fp16": 71 * T},  # fp32 accumulate
    ("V100",): {"fp32": 15.7 * T, "fp16": 125 * T},  # SXM2; no bf16, no tf32
    ("V100", "PCIE"): {"fp32": 14 * T, "fp16": 112 * T},
    ("V100S",): {"fp32": 16.4 * T, "fp16": 130 * T},
    ("T4",): {"fp32": 8.1 * T, "fp16": 65 * T},  # no bf16, no tf32
    ("MI300X",): {"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T},
    ("MI250X",): {"fp32": 47.9 / 2 * T, "bf16": 383 / 2 * T, "fp16": 383 / 2 * T},  # per GCD (a torch device)
}

MATMUL_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def model_key(name: str) -> Optional[tuple[str, ...]]:
    """The table key a device name matches (the note on exact model names), or None."""
    words = [w for w in re.split(r"[\s\-_]+", name.upper()) if w]
    best: Optional[tuple[str, ...]] = None
    for key in PEAK_FLOPS:
        n = len(key)
        if any(tuple(words[i:i + n]) == key for i in range(len(words) - n + 1)):
            if best is None or n > len(best):
                best = key
    return best


def matmul_precision(precision: str, allow_tf32: Optional[bool] = None) -> str:
    """The precision a run's matmuls use: its compute dtype, or TF32 for fp32 when torch allows it."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    if precision == "fp32":
        if allow_tf32 is None:
            import torch

            allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        return "tf32" if allow_tf32 else "fp32"
    return precision


def peak_for(name: str, matmul: str) -> Optional[float]:
    """The dense peak of device model ``name`` in ``matmul`` precision; None when unknown or unsupported."""
    if matmul not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision must be one of {MATMUL_PRECISIONS}, got {matmul!r}")
    key = model_key(name)
    return None if key is None else PEAK_FLOPS[key].get(matmul)


def peak_flops(device: Any, precision: str) -> Optional[float]:
    """The accelerator's dense peak FLOP/s for a run in ``precision``; None on CPU or an unknown device."""
    import torch

    if getattr(device, "type", str(device).split(":")[0]) != "cuda" or not torch.cuda.is_available():
        return None
    return peak_for(torch.cuda.get_device_name(device), matmul_precision(precision))
