"""One ordinary weights file from a sharded checkpoint, in memory that does not grow with the model.

DeepSpeed's ``zero_to_fp32.py`` loads every shard, concatenates and then saves: about twice
the checkpoint in RAM. Here the output's header is written first (the manifest knows every
key, shape and dtype), then each tensor is streamed in chunks of ``CHUNK_ELEMENTS``
elements: the chunk's byte ranges are read from whichever shards hold them, converted, and
written. Peak memory is a few chunks (tens of MB) plus the interpreter, whatever the size of
the model or of its largest tensor -- well inside the "2x the largest tensor" bound. It needs
no torch: numpy does the one conversion that matters (fp32 -> bf16, round to nearest even).

Keys are those of ``model.state_dict()``. A tied weight (GPT's ``wte.weight`` and
``lm_head.weight``) is one parameter under two keys: both keys are written, each with the
full values, so ``model.load_state_dict(load_file(out), strict=True)`` just works; the
price is one extra copy of that tensor on disk. ``--dtype`` applies to floating-point
tensors; integer and boolean buffers keep their dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from .manifest import numel, pieces_for, read_manifest, resolve
from .stfile import FLOATS, ITEMSIZE, TensorSpec, build_header
from .storage import Storage, storage_options

CHUNK_ELEMENTS = 4 << 20  # 16 MiB of fp32
OUT_DTYPES = {"fp32": "F32", "bf16": "BF16"}


@dataclass
class ConsolidateReport:
    tensors: int
    bytes_written: int
    largest_tensor_bytes: int  # in the output dtype
    step: int


def to_float32(raw: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype={"F32": np.float32, "F16": np.float16, "F64": np.float64}[dtype]).astype(
        np.float32, copy=False)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, as ``tensor.to(torch.bfloat16)``; NaN becomes the quiet NaN 0x7FC0."""
    bits = values.view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def convert(raw: bytes, src: str, dst: str) -> bytes | np.ndarray:
    if src == dst:
        return raw
    values = to_float32(raw, src)
    return float32_to_bf16(values) if dst == "BF16" else values


def output_specs(manifest: dict[str, Any], dtype: str) -> list[tuple[TensorSpec, dict]]:
    out_float = OUT_DTYPES[dtype]
    specs = []
    for key, section, name in manifest["model_state_dict"]:
        entry = manifest["tensors"][section][name]
        out = out_float if entry["dtype"] in FLOATS else entry["dtype"]
        specs.append((TensorSpec(key, out, tuple(entry["shape"])), entry))
    return specs


def consolidate(uri: str, out_uri: str, dtype: str = "fp32") -> ConsolidateReport:
    """Write the checkpoint at ``uri`` (see ``manifest.resolve``) as one safetensors file ``out_uri``."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(OUT_DTYPES)}, got {dtype!r}")
    checkpoint = resolve(uri)
    manifest = read_manifest(checkpoint)
    specs = output_specs(manifest, dtype)
    header, _ = build_header([s for s, _ in specs], {"format": "pt", "step": str(manifest["step"]),
                                                      "source": checkpoint.uri})
    protocol = out_uri.split("://", 1)[0] if "://" in out_uri else "file"
    written = 0
    with fsspec.open(out_uri, "wb", **storage_options(protocol)) as out:
        out.write(header)
        written += len(header)
        for spec, entry in specs:
            written += _stream_tensor(checkpoint, entry, spec.dtype, out)
    largest = max((s.nbytes for s, _ in specs), default=0)
    return ConsolidateReport(len(specs), written, largest, manifest["step"])


def _stream_tensor(checkpoint: Storage, entry: dict, out_dtype: str, out) -> int:
    total, written = numel(entry["shape"]), 0
    for lo in range(0, total, CHUNK_ELEMENTS):
        hi = min(total, lo + CHUNK_ELEMENTS)
        pieces = list(pieces_for(entry, lo, hi))
        blobs = checkpoint.read_ranges([(p.file, p.start, p.end) for p in pieces])
        raw = blobs[0] if len(blobs) == 1 else b"".join(blobs)
        if len(raw) != (hi - lo) * ITEMSIZE[entry["dtype"]]:
            raise ValueError(f"the checkpoint's pieces do not cover elements [{lo}, {hi})")
        data = memoryview(convert(raw, entry["dtype"], out_dtype)).cast("B")
        out.write(data)
        written += len(data)
        del raw, blobs, data
    return written
