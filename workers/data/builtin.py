"""The built-in sample sources that need no tokenizer: ``synthetic``, byte-level ``text``, ``factory``.

``synthetic``  tokens from a seeded sparse Markov chain (each token has four possible
               successors), so a model can learn it: loss falls from ln(vocab) toward ln(4).
``text``       byte-level windows of ``seq_len + 1`` bytes from the files ``glob`` selects under
               any fsspec ``uri`` (``file://``, ``s3://``, ...): at seeded random offsets of the
               files' concatenation, or with ``shuffle: false`` bytes ``[i(L+1), (i+1)(L+1))``
               of it (again from its start each epoch).
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

    def __init__(self, uri: str, glob: str, seq_len: int, seed: int = 0, shuffle: bool = True,
                 cache_file_bytes: int = 8 << 20, cache_files: int = 256):
        from workers.data.sources import list_files

        self.seq_len, self.seed, self.shuffle = seq_len, seed, shuffle
        self.fs, sizes = list_files(uri, glob)
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
        if self.shuffle:
            offset = _rng(self.seed, index, "text").randrange(self.total_bytes - span + 1)
        else:
            offset = index % (self.total_bytes // span) * span
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
