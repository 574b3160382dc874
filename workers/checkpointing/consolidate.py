"""Ordinary weights from a sharded checkpoint, in memory that does not grow with the model.

Two outputs: a directory as Hugging Face's ``save_pretrained`` writes it (the default) --
``model-0000k-of-0000N.safetensors`` shards of at most ``max_shard_bytes`` each (a tensor larger
than that gets a shard of its own), ``model.safetensors.index.json`` mapping every key to its
shard, and ``config.json`` saying what the model is (the manifest's ``model``: a preset's
``GPTConfig`` fields, or the factory and its kwargs) -- or, for an ``OUT`` ending in
``.safetensors``, one file. Our metadata (job id, step, dtype, source checkpoint) is in every
file's safetensors ``__metadata__`` and in the index's ``metadata``. Either is a valid
``model.init_from`` (``workers.checkpointing.pretrained``): train -> consolidate -> fine-tune.
The index is written last (and an old one removed first), so a directory whose writing was
cut short is never mistaken for complete weights.

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

import json
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import numpy as np

from .export_hf import plan_export
from .hf_dir import model_files
from storage.manifest import numel, pieces_for, read_manifest, resolve
from storage.stfile import FLOATS, INDEX_NAME, ITEMSIZE, TensorSpec, build_header, shard_file_name
from storage.storage import Storage, protocol_of, storage_options

CHUNK_ELEMENTS = 4 << 20  # 16 MiB of fp32
OUT_DTYPES = {"fp32": "F32", "bf16": "BF16"}
DEFAULT_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size ("5GB")
CONFIG_NAME = "config.json"


@dataclass
class ConsolidateReport:
    tensors: int
    bytes_written: int
    largest_tensor_bytes: int  # in the output dtype
    step: int
    files: int = 1  # safetensors files written
    config: bool = False  # whether config.json was written (the manifest named the model)


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


def output_specs(manifest: dict[str, Any], dtype: str, layout: str = "zerotrain"
                 ) -> tuple[list[tuple[TensorSpec, dict]], bytes | None]:
    """What to write (``export_hf.plan_export``: names, which tensors go transposed) and the
    ``config.json`` bytes it implies (None: the manifest's ``model``, or copied for an HF job)."""
    out_float = OUT_DTYPES[dtype]
    keys = [tuple(k) for k in manifest["model_state_dict"]]
    plan, config = plan_export(manifest.get("model"), keys, layout, dtype)
    specs = []
    for key, section, name, transposed in plan:
        entry = manifest["tensors"][section][name]
        out = out_float if entry["dtype"] in FLOATS else entry["dtype"]
        shape = tuple(entry["shape"])
        if transposed:
            shape, entry = shape[::-1], {**entry, "transpose": True}
        specs.append((TensorSpec(key, out, shape), entry))
    return specs, config


def consolidate(uri: str, out_uri: str, dtype: str = "fp32", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                layout: str = "zerotrain") -> ConsolidateReport:
    """Write the checkpoint at ``uri`` (see ``manifest.resolve``) as weights at ``out_uri``: a
    Hugging Face-style directory, or one file when ``out_uri`` ends in ``.safetensors``.
    ``layout="gpt2"`` writes a preset as ``GPT2LMHeadModel`` (``export_hf``); an HF job is always
    written with its own names, config and tokenizer files."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(OUT_DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"the shard size must be at least 1 byte, got {max_shard_bytes}")
    checkpoint = resolve(uri)
    manifest = read_manifest(checkpoint)
    specs, config = output_specs(manifest, dtype, layout)
    metadata = {"format": "pt", "job_id": str(manifest["job_id"]), "step": str(manifest["step"]),
                "dtype": dtype, "source": checkpoint.uri}
    largest = max((s.nbytes for s, _ in specs), default=0)
    report = ConsolidateReport(len(specs), 0, largest, manifest["step"])
    if out_uri.rstrip("/").endswith(".safetensors"):
        with fsspec.open(out_uri, "wb", **storage_options(protocol_of(out_uri))) as out:
            report.bytes_written = _write_file(checkpoint, specs, metadata, out)
        return report
    out = Storage.at(out_uri)
    out.remove([INDEX_NAME])  # until the new index exists, the directory is not weights
    shards = plan_shards(specs, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = shard_file_name(i, len(shards))
        with out.open_write(name) as sink:
            report.bytes_written += _write_file(checkpoint, shard, metadata, sink)
        weight_map.update({spec.name: name for spec, _ in shard})
    model = manifest.get("model")
    if model is not None and "hf" in model:  # the model's own config.json and tokenizer files
        for name, data in model_files(model["hf"]).items():
            out.write_atomic(name, data)
        report.config = True
    elif config is not None or model is not None:
        out.write_atomic(CONFIG_NAME, config if config is not None else json.dumps(model, indent=1).encode())
        report.config = True
    index = {"metadata": {"total_size": sum(s.nbytes for s, _ in specs), **metadata}, "weight_map": weight_map}
    out.write_atomic(INDEX_NAME, json.dumps(index, indent=1).encode())
    report.files = len(shards)
    return report


def plan_shards(specs: list[tuple[TensorSpec, dict]], max_shard_bytes: int) -> list[list[tuple[TensorSpec, dict]]]:
    """Consecutive tensors in shards of at most ``max_shard_bytes`` (a larger tensor alone), in order."""
    shards: list[list[tuple[TensorSpec, dict]]] = []
    size = 0
    for item in specs:
        if not shards or (shards[-1] and size + item[0].nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[0].nbytes
    return shards or [[]]


def _write_file(checkpoint: Storage, specs: list[tuple[TensorSpec, dict]], metadata: dict[str, str],
                out: IO[bytes]) -> int:
    """One safetensors file of ``specs`` into ``out``: the header, then each tensor streamed."""
    header, _ = build_header([s for s, _ in specs], metadata)
    out.write(header)
    written = len(header)
    for spec, entry in specs:
        written += _stream_tensor(checkpoint, entry, spec.dtype, out)
    return written


def _stream_tensor(checkpoint: Storage, entry: dict, out_dtype: str, out) -> int:
    if entry.get("transpose"):
        return _stream_transposed(checkpoint, entry, out_dtype, out)
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


def _read(checkpoint: Storage, entry: dict, lo: int, hi: int) -> bytes:
    """Elements ``[lo, hi)`` of a stored tensor, from whichever shards hold them."""
    pieces = list(pieces_for(entry, lo, hi))
    blobs = checkpoint.read_ranges([(p.file, p.start, p.end) for p in pieces])
    raw = blobs[0] if len(blobs) == 1 else b"".join(blobs)
    if len(raw) != (hi - lo) * ITEMSIZE[entry["dtype"]]:
        raise ValueError(f"the checkpoint's pieces do not cover elements [{lo}, {hi})")
    return raw


def _stream_transposed(checkpoint: Storage, entry: dict, out_dtype: str, out) -> int:
    """A stored ``[rows, cols]`` float tensor written as ``[cols, rows]``, in bounded memory.

    [Note: transposing in chunks]
    The output is written ``k`` of its rows at a time (``k · rows`` elements, at most a chunk);
    each such block is columns ``[c0, c0 + k)`` of the stored tensor, gathered by reading the
    stored rows a chunk at a time. Memory stays a few chunks; the tensor is read ``cols / k``
    times (once for any tensor up to a chunk, four times for a 2048 x 8192 one).
    """
    rows, cols = entry["shape"]
    k = max(1, CHUNK_ELEMENTS // max(1, rows))
    step = max(1, CHUNK_ELEMENTS // max(1, cols))
    written = 0
    for c0 in range(0, cols, k):
        c1 = min(cols, c0 + k)
        block = np.empty((c1 - c0, rows), dtype=np.float32)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            values = to_float32(_read(checkpoint, entry, r0 * cols, r1 * cols), entry["dtype"]).reshape(r1 - r0, cols)
            block[:, r0:r1] = values[:, c0:c1].T
        data = float32_to_bf16(block) if out_dtype == "BF16" else block
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        out.write(view)
        written += len(view)
    return written
