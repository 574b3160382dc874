"""Training data: every rank reads its own slice of every global batch, reproducibly.

A dataset here is *indexable by a global sample number*: sample ``i`` is always the same
tokens for a given seed, whichever rank reads it and however often. The loader turns a
position in that numbering (``position`` = samples the whole job has consumed) into this
rank's micro-batches, so

- the ranks of one step read disjoint slices that together are exactly the global batch,
- the same seed gives the same batches, run after run,
- a checkpoint saves ``position`` and a resumed job continues with the very next sample:
  nothing skipped, nothing seen twice — at any world size, since the split is recomputed.

Three sources (the job spec's ``data`` block, a ``contract.spec.DataSpec``):

``synthetic``  tokens from a seeded sparse Markov chain (each token has four possible
               successors), so a model can learn it: loss falls from ln(vocab) toward ln(4).
``text``       byte-level windows of ``seq_len + 1`` bytes from the files ``glob`` selects under
               any fsspec ``uri`` (``file://``, ``s3://``, ...), taken at seeded random offsets
               of the files' concatenation.
``factory``    ``"pkg.mod:fn"`` called with ``kwargs``; it returns a map-style dataset whose items
               are a 1-D tensor of ``seq_len + 1`` tokens or an ``(input, target)`` pair.
               Indices wrap around its length with a fresh seeded permutation per epoch.
"""

from __future__ import annotations

import bisect
import functools
import random
from collections import OrderedDict
from typing import Any, Protocol, Sequence

import torch

from contract.spec import DataSpec
from workers.models import resolve_factory

Sample = tuple[torch.Tensor, torch.Tensor]  # (input ids [seq_len], target ids [seq_len])


class IndexedDataset(Protocol):
    def sample(self, index: int) -> Sample: ...


def _split(tokens: torch.Tensor) -> Sample:
    tokens = tokens.to(torch.long)
    return tokens[:-1], tokens[1:]


def _rng(seed: int, index: int, salt: str) -> random.Random:
    # String seeds go through SHA-512: the same numbers in every process, unlike hash().
    return random.Random(f"{salt}:{seed}:{index}")


# ----------------------------------------------------------------------------- synthetic


class SyntheticDataset:
    """Sequences from a seeded Markov chain with ``branching`` successors per token."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, branching: int = 4):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        table_gen = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=table_gen)

    def sample(self, index: int) -> Sample:
        gen = torch.Generator().manual_seed(_rng(self.seed, index, "synthetic").getrandbits(63))
        choices = torch.randint(self.successors.shape[1], (self.seq_len,), generator=gen)
        tokens = torch.empty(self.seq_len + 1, dtype=torch.long)
        tokens[0] = int(torch.randint(self.vocab_size, (1,), generator=gen))
        for t in range(self.seq_len):  # a short Python loop: seq_len is a few hundred
            tokens[t + 1] = self.successors[tokens[t], choices[t]]
        return _split(tokens)


# ----------------------------------------------------------------------------- text files


class TextFilesDataset:
    """Byte windows from the concatenation of the files under ``uri`` matching ``glob``.

    Only the file listing is read up front; bytes are fetched per window (whole files up to
    ``cache_file_bytes`` are cached, larger ones are read by range), so an object-store corpus
    much larger than memory works.
    """

    def __init__(self, uri: str, glob: str, seq_len: int, seed: int = 0,
                 cache_file_bytes: int = 8 << 20, cache_files: int = 256):
        import fsspec

        from workers.checkpointing.storage import protocol_of, storage_options

        self.seq_len, self.seed = seq_len, seed
        self.fs, root = fsspec.core.url_to_fs(uri, **storage_options(protocol_of(uri)))
        root = root.rstrip("/")
        pattern = f"{root}/{glob.lstrip('/')}" if glob else root
        sizes = {path: info["size"] for path, info in self.fs.glob(pattern, detail=True).items()
                 if info.get("type", "file") == "file" and info.get("size")}
        if not sizes:
            raise ValueError(f"data: no non-empty files match {glob!r} under {uri!r}")
        self.paths: list[str] = sorted(sizes)
        self.starts: list[int] = []  # offset of each file in the concatenation
        total = 0
        for path in self.paths:
            self.starts.append(total)
            total += sizes[path]
        self.sizes = [sizes[p] for p in self.paths]
        self.total_bytes = total
        if total < seq_len + 1:
            raise ValueError(f"data: {uri!r} holds {total} bytes, fewer than seq_len + 1 = {seq_len + 1}")
        self.cache_file_bytes = cache_file_bytes
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cache_files = cache_files

    def _read(self, file_index: int, start: int, end: int) -> bytes:
        if self.sizes[file_index] > self.cache_file_bytes:
            return self.fs.cat_file(self.paths[file_index], start=start, end=end)
        data = self._cache.get(file_index)
        if data is None:
            data = self.fs.cat_file(self.paths[file_index])
            self._cache[file_index] = data
            if len(self._cache) > self._cache_files:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(file_index)
        return data[start:end]

    def window(self, offset: int, length: int) -> bytes:
        """``length`` bytes of the concatenation from ``offset`` (may span files)."""
        out = bytearray()
        file_index = bisect.bisect_right(self.starts, offset) - 1
        while len(out) < length:
            local = offset + len(out) - self.starts[file_index]
            take = min(length - len(out), self.sizes[file_index] - local)
            out += self._read(file_index, local, local + take)
            file_index += 1
        return bytes(out)

    def sample(self, index: int) -> Sample:
        span = self.seq_len + 1
        offset = _rng(self.seed, index, "text").randrange(self.total_bytes - span + 1)
        return _split(torch.frombuffer(bytearray(self.window(offset, span)), dtype=torch.uint8))


# ----------------------------------------------------------------------------- user factory


class FactoryDataset:
    """A user's map-style dataset, walked in a seeded permutation per epoch."""

    def __init__(self, dataset: Sequence[Any], seed: int = 0):
        self.dataset, self.seed = dataset, seed
        self.length = len(dataset)
        if self.length == 0:
            raise ValueError("data: the factory returned an empty dataset")

    @functools.lru_cache(maxsize=2)
    def _permutation(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(_rng(self.seed, epoch, "epoch").getrandbits(63))
        return torch.randperm(self.length, generator=gen).tolist()

    def sample(self, index: int) -> Sample:
        epoch, within = divmod(index, self.length)
        item = self.dataset[self._permutation(epoch)[within]]
        if isinstance(item, (tuple, list)):
            x, y = item
            return torch.as_tensor(x, dtype=torch.long), torch.as_tensor(y, dtype=torch.long)
        return _split(torch.as_tensor(item))


def build_dataset(data: DataSpec, seed: int = 0) -> IndexedDataset:
    """The dataset a job spec's ``data`` block names (its defaults, e.g. ``vocab_size``, are the spec's)."""
    if data.kind == "synthetic":
        return SyntheticDataset(data.vocab_size, data.seq_len, seed)
    if data.kind == "text":
        return TextFilesDataset(data.uri, data.glob, data.seq_len, seed)
    return FactoryDataset(resolve_factory(data.factory)(**data.kwargs), seed)


# ----------------------------------------------------------------------------- the loader


class ShardedBatchLoader:
    """This rank's micro-batches of each global batch, from a resumable global position.

    Global batch ``k`` holds samples ``[position, position + global_batch_size)``. Rank ``r``
    owns the contiguous slice ``[position + r·A·b, position + (r+1)·A·b)`` (``A`` accumulation
    steps of micro-batch ``b``) and reads it as ``A`` micro-batches in order.
    """

    def __init__(self, dataset: IndexedDataset, *, global_batch_size: int, micro_batch_size: int,
                 rank: int = 0, world_size: int = 1, position: int = 0):
        per_step = micro_batch_size * world_size
        if global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a multiple of micro_batch_size "
                f"({micro_batch_size}) × world_size ({world_size}) = {per_step}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.accumulation_steps = global_batch_size // per_step
        self.position = position

    def slice_indices(self, position: int | None = None) -> list[list[int]]:
        """Global sample numbers of this rank's micro-batches for the batch at ``position``."""
        start = (self.position if position is None else position) + \
            self.rank * self.accumulation_steps * self.micro_batch_size
        b = self.micro_batch_size
        return [list(range(start + m * b, start + (m + 1) * b)) for m in range(self.accumulation_steps)]

    def next_batch(self) -> list[Sample]:
        """This rank's ``accumulation_steps`` micro-batches of the next global batch."""
        micro_batches = []
        for indices in self.slice_indices():
            samples = [self.dataset.sample(i) for i in indices]
            micro_batches.append((torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])))
        self.position += self.global_batch_size
        return micro_batches

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
