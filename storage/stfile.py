"""The safetensors file format, written incrementally and read by byte range.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header + the tensors'
bytes back to back; the header maps each name to ``{"dtype", "shape", "data_offsets": [b, e]}``
relative to the end of the header. Because every shape and dtype is known before a byte is
written, we write the header first and then stream each tensor, never holding the file in
memory (``safetensors.torch.save`` builds the whole file as one ``bytes``). Readers that
know a tensor's absolute offsets fetch just the bytes they need.

[Note: order and alignment]
Tensors are laid out in the order given; callers put larger item sizes first (as the
safetensors library does) so every tensor starts at a multiple of its item size, and the
header is padded with spaces to a multiple of 8.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import IO, Any, Optional, Sequence

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FLOATS = ("F64", "F32", "F16", "BF16")

# A directory of weights as Hugging Face lays it out: shards named ``shard_file_name(i, n)``,
# the index mapping every tensor to its shard (written last), or one ``model.safetensors``.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def shard_file_name(i: int, n: int) -> str:
    """``model-00001-of-00003.safetensors`` for shard ``i`` (0-based) of ``n``, as ``save_pretrained`` names it."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype name ("F32", "BF16", ...)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


def build_header(specs: Sequence[TensorSpec], metadata: Optional[dict[str, str]] = None
                 ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The file's first bytes (length prefix + padded JSON) and each tensor's absolute byte range."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    relative, offset = {}, 0
    for spec in specs:
        if spec.name in relative:
            raise ValueError(f"duplicate tensor name {spec.name!r}")
        relative[spec.name] = (offset, offset + spec.nbytes)
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    absolute = {name: (start + b, start + e) for name, (b, e) in relative.items()}
    return struct.pack("<Q", len(text)) + text, absolute


def parse_header(prefix: bytes) -> tuple[int, dict[str, Any]]:
    """``(data_start, header)`` from a file's first bytes (at least ``8 + N`` of them)."""
    (n,) = struct.unpack("<Q", prefix[:8])
    if len(prefix) < 8 + n:
        raise ValueError(f"safetensors header needs {8 + n} bytes, got {len(prefix)}")
    return 8 + n, json.loads(prefix[8 : 8 + n])


class HashingWriter:
    """Writes through to ``sink`` while counting bytes and computing their sha256."""

    def __init__(self, sink: IO[bytes]):
        self.sink = sink
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.sink.write(view)
        self.size += len(view)

    def hexdigest(self) -> str:
        return self.sha256.hexdigest()


def sha256_of(stream: IO[bytes], chunk: int = 8 << 20) -> tuple[int, str]:
    """``(size, sha256 hex)`` of what remains in ``stream``, read ``chunk`` bytes at a time."""
    digest, size = hashlib.sha256(), 0
    while True:
        block = stream.read(chunk)
        if not block:
            return size, digest.hexdigest()
        digest.update(block)
        size += len(block)
