"""Pretrained weights in safetensors, read by byte range: what ``init_weights=<uri>`` loads.

A source is one ``.safetensors`` file or a directory as Hugging Face writes it
(``model.safetensors.index.json`` mapping each tensor to one of several shard files; a
directory holding a single ``model.safetensors`` works too). Opening it reads the index and
each file's header only; ``read`` then fetches exactly the bytes of the elements asked for,
so a rank that keeps a slice of a tensor reads that slice (ranged reads, ``Storage``). No
torch here: the control plane uses ``resolve`` to refuse a ``model.init_from`` whose names or
shapes do not fit the model before a job starts (``service/init_from.py``).

[Note: tied weights]
``model.state_dict()`` lists a tied parameter under every name it is registered by (GPT's
``wte.weight`` and ``lm_head.weight``). Hugging Face stores such a tensor once, under one of
them; our consolidation writes it under both. So the expected names come in alias groups
(one per distinct tensor): a group is satisfied by any one of its names, every name present
must have the right shape, and the first name present is the one read.
"""

from __future__ import annotations

import json
import math
import posixpath
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from .consolidate import to_float32
from storage.stfile import FLOATS, INDEX_NAME, ITEMSIZE, SINGLE_NAME, parse_header
from storage.storage import Storage

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on a header
_NUMPY = {"I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64}


class WeightsNotFound(ValueError):
    """Nothing at the URI: no such file, or a directory without an index or ``model.safetensors``
    (as opposed to a source that is there but malformed, a plain ``ValueError``)."""


@dataclass(frozen=True)
class StoredTensor:
    name: str
    file: str  # relative to the source's directory
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    start: int  # absolute byte offset of element 0 in ``file``

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class PretrainedWeights:
    """The tensors of a safetensors source, by name; ``read`` fetches element ranges of them."""

    def __init__(self, storage: Storage, tensors: dict[str, StoredTensor], uri: str):
        self.storage = storage
        self.tensors = tensors
        self.uri = uri
        self.bytes_read = 0  # tensor bytes fetched by read() (headers and index not counted)
        self._lock = threading.Lock()

    # -- opening -----------------------------------------------------------------------------------
    @classmethod
    def open(cls, uri: str) -> "PretrainedWeights":
        """Read the index (directory) or header (file) at ``uri``; ``ValueError`` if it is neither."""
        uri = uri.rstrip("/")
        if uri.endswith(".safetensors"):
            head, _, name = uri.rpartition("/")
            storage = Storage.at(head or ".")
            if not storage.exists(name):
                raise WeightsNotFound(f"{uri}: no such safetensors file")
            return cls(storage, _headers(storage, [name]), uri)
        storage = Storage.at(uri)
        if storage.exists(INDEX_NAME):
            try:
                index = json.loads(storage.read_bytes(INDEX_NAME))
                weight_map = index["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{uri}/{INDEX_NAME}: not a safetensors index ({exc})") from exc
            files = sorted(set(weight_map.values()))
            for f in files:
                if posixpath.isabs(f) or ".." in f.split("/"):
                    raise ValueError(f"{uri}/{INDEX_NAME}: shard file {f!r} is outside the directory")
            tensors = _headers(storage, files)
            missing = sorted(n for n, f in weight_map.items() if n not in tensors or tensors[n].file != f)
            if missing:
                raise ValueError(f"{uri}/{INDEX_NAME}: {missing[0]!r} is not in the file the index names")
            return cls(storage, {n: tensors[n] for n in weight_map}, uri)
        if storage.exists(SINGLE_NAME):
            return cls(storage, _headers(storage, [SINGLE_NAME]), uri)
        raise WeightsNotFound(f"{uri}: neither a .safetensors file nor a directory with {INDEX_NAME} or "
                              f"{SINGLE_NAME}")

    # -- checking ----------------------------------------------------------------------------------
    def resolve(self, expected: Sequence[tuple[Sequence[str], Sequence[int]]]) -> dict[str, str]:
        """Map every expected name to the stored name it loads from; ``ValueError`` naming the key.

        ``expected`` is one ``(names, shape)`` per distinct tensor, ``names`` its aliases in
        ``state_dict()`` order (see the note on tied weights). Refused: a tensor none of whose
        names is stored ("missing key"), a stored name of the wrong shape, a stored name no
        expected tensor has ("unexpected key").
        """
        out: dict[str, str] = {}
        known: set[str] = set()
        for names, shape in expected:
            shape = tuple(int(d) for d in shape)
            known.update(names)
            present = [n for n in names if n in self.tensors]
            if not present:
                raise ValueError(f"{self.uri}: missing key {names[0]!r} (shape {list(shape)})")
            for n in present:
                if self.tensors[n].shape != shape:
                    raise ValueError(f"{self.uri}: key {n!r} has shape {list(self.tensors[n].shape)}, "
                                     f"the model's is {list(shape)}")
            for n in names:
                out[n] = present[0]
        unexpected = sorted(set(self.tensors) - known)
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise ValueError(f"{self.uri}: unexpected key {unexpected[0]!r}{more}: the model has no such tensor")
        return out

    # -- reading -----------------------------------------------------------------------------------
    def read(self, requests: Iterable[tuple[str, int, int]]) -> list[np.ndarray]:
        """Elements ``[lo, hi)`` of the flattened tensor ``name`` for each ``(name, lo, hi)``.

        Floating tensors come back as float32 (bf16/fp16 widened exactly), others in their own
        dtype. All ranges are fetched in one batch (concurrently on object stores).
        """
        requests = list(requests)
        ranges = []
        for name, lo, hi in requests:
            t = self.tensors[name]
            if not 0 <= lo <= hi <= t.numel:
                raise ValueError(f"{name}: elements [{lo}, {hi}) outside its {t.numel}")
            size = ITEMSIZE[t.dtype]
            ranges.append((t.file, t.start + lo * size, t.start + hi * size))
        blobs = self.storage.read_ranges([r for r in ranges if r[2] > r[1]])
        it = iter(blobs)
        out = []
        for (name, lo, hi), (_, a, b) in zip(requests, ranges):
            t = self.tensors[name]
            raw = next(it) if b > a else b""
            with self._lock:
                self.bytes_read += len(raw)
            if t.dtype in FLOATS:
                out.append(to_float32(raw, t.dtype))
            else:
                out.append(np.frombuffer(raw, dtype=_NUMPY[t.dtype]))
        return out


def expected_tensors(named: Mapping[str, object], shape_of) -> list[tuple[list[str], tuple[int, ...]]]:
    """Alias groups of ``named`` (a ``state_dict()``-like mapping name -> tensor): one group per
    distinct object, in first-appearance order. ``shape_of(tensor)`` gives its shape."""
    groups: dict[int, tuple[list[str], tuple[int, ...]]] = {}
    for name, t in named.items():
        key = id(t)
        if key not in groups:
            groups[key] = ([], tuple(shape_of(t)))
        groups[key][0].append(name)
    return list(groups.values())


def _headers(storage: Storage, files: Sequence[str]) -> dict[str, StoredTensor]:
    """Every tensor of ``files`` (two small ranged reads per file: the length, then the header)."""
    lengths = [int.from_bytes(n, "little") for n in storage.read_ranges([(f, 0, 8) for f in files])]
    for f, n in zip(files, lengths):
        if n > MAX_HEADER_BYTES:  # not a safetensors file; do not read gigabytes to find out
            raise ValueError(f"{storage.uri}/{f}: not a safetensors file (its header would be {n} bytes)")
    prefixes = storage.read_ranges([(f, 0, 8 + n) for f, n in zip(files, lengths)])
    out: dict[str, StoredTensor] = {}
    for f, prefix in zip(files, prefixes):
        data_start, header = parse_header(prefix)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = entry["dtype"]
            if dtype not in ITEMSIZE:
                raise ValueError(f"{storage.uri}/{f}: tensor {name!r} has unsupported dtype {dtype}")
            begin, end = entry["data_offsets"]
            shape = tuple(int(d) for d in entry["shape"])
            if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
                raise ValueError(f"{storage.uri}/{f}: tensor {name!r}'s byte range does not match its shape")
            if name in out:
                raise ValueError(f"{storage.uri}: tensor {name!r} is stored twice ({out[name].file}, {f})")
            out[name] = StoredTensor(name, f, dtype, shape, data_start + begin)
    return out
