"""The data factory: a deterministic map-style dataset of token sequences.

The contract (docs/user-code.md): ``load(**data.kwargs)`` returns something with ``len(ds)``
and ``ds[i]``; each item here is a 1-D tensor of ``seq_len + 1`` tokens, which the loader
splits into inputs and targets. ``ds[i]`` must be the same on every call and every worker:
each sequence comes from its own seeded generator.

The sequences follow a rule the model can learn -- each token is the previous one plus a
step fixed per sequence, modulo the vocabulary -- so the loss visibly falls within a few
dozen steps.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class CountingSequences(Dataset):
    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int):
        self.size, self.seq_len, self.vocab_size, self.seed = size, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=generator))
        step = int(torch.randint(1, 4, (1,), generator=generator))
        return (start + step * torch.arange(self.seq_len + 1)) % self.vocab_size


def load(seq_len: int = 32, vocab_size: int = 64, size: int = 4096, seed: int = 0) -> CountingSequences:
    return CountingSequences(size, seq_len, vocab_size, seed)
