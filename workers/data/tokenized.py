"""Token datasets: tokenized text, pre-tokenized streams (``tokens``) and prompt/completion rows (``sft``).

[Note: sample numbering of token streams and rows]
A token stream (``text`` with a tokenizer: ``doc0 + eos + doc1 + eos + ...``; ``tokens``: the
files' ids as they are) holds ``n = len(stream) // (seq_len + 1)`` samples; the tail that does
not fill one is not read. With ``shuffle: false`` sample ``i`` is tokens ``[j(L+1), (j+1)(L+1))``
with ``j = i mod n``: the stream in order, again from its start each epoch. With ``shuffle:
true`` ``j`` is a seeded permutation of ``0..n-1``, a fresh one per epoch (``i // n``). SFT rows
number the same way: row ``j`` of the files in order (0-based over every file). Samples
depend only on ``(seed, i)``, so the loader's guarantees (resume at any world size) hold.

Tokenized text is tokenized once when the dataset is built (no cache between runs); ``tokens``
``.bin`` files are read by range per sample (memory-mapped locally), parquet token columns
are read whole.
"""

from __future__ import annotations

import bisect
import functools
from typing import Any, Protocol

import numpy as np
import torch

from contract.spec import DataSpec
from workers.data.sources import (
    BinTokens,
    LoadedTokenizer,
    list_files,
    load_tokenizer,
    parquet_tokens,
    read_documents,
    read_pairs,
)
from workers.loss import IGNORE_INDEX

Sample = tuple[torch.Tensor, torch.Tensor]


def epoch_permutation(seed: int, epoch: int, length: int) -> list[int]:
    """The seeded order of ``length`` items in ``epoch`` (the same in every process)."""
    from workers.data.builtin import _rng

    gen = torch.Generator().manual_seed(_rng(seed, epoch, "epoch").getrandbits(63))
    return torch.randperm(length, generator=gen).tolist()


class Numbered:
    """Sample ``i`` → item ``j`` of ``length`` items, in order or shuffled per epoch (the Note)."""

    def __init__(self, length: int, seed: int, shuffle: bool):
        self.length, self.seed, self.shuffle = length, seed, shuffle

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> list[int]:
        return epoch_permutation(self.seed, epoch, self.length)

    def item(self, index: int) -> int:
        epoch, within = divmod(index, self.length)
        return self._order(epoch)[within] if self.shuffle else within


class TokenSource(Protocol):
    length: int

    def read(self, start: int, end: int) -> np.ndarray: ...


class InMemoryTokens:
    def __init__(self, tokens: np.ndarray):
        self.tokens, self.length = tokens, len(tokens)

    def read(self, start: int, end: int) -> np.ndarray:
        return self.tokens[start:end]


class ConcatTokens:
    """Several token sources read as one stream."""

    def __init__(self, parts: list[TokenSource]):
        self.parts, self.starts, self.length = parts, [], 0
        for part in parts:
            self.starts.append(self.length)
            self.length += part.length

    def read(self, start: int, end: int) -> np.ndarray:
        pieces, at = [], start
        index = bisect.bisect_right(self.starts, at) - 1
        while at < end:
            local = at - self.starts[index]
            take = min(end - at, self.parts[index].length - local)
            if take > 0:
                pieces.append(self.parts[index].read(local, local + take).astype(np.int64, copy=False))
                at += take
            index += 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]


class TokenStreamDataset:
    """Samples of ``seq_len + 1`` consecutive tokens of a stream (the Note above)."""

    def __init__(self, stream: TokenSource, seq_len: int, seed: int, shuffle: bool, *, what: str,
                 vocab_size: int | None = None):
        span = seq_len + 1
        if stream.length < span:
            raise ValueError(f"{what} holds {stream.length} tokens, fewer than seq_len + 1 = {span}")
        self.stream, self.span, self.vocab_size = stream, span, vocab_size
        self.numbered = Numbered(stream.length // span, seed, shuffle)

    def sample(self, index: int) -> Sample:
        j = self.numbered.item(index)
        tokens = torch.from_numpy(self.stream.read(j * self.span, (j + 1) * self.span).astype(np.int64))
        return tokens[:-1], tokens[1:]


class SFTDataset:
    """Prompt/completion rows: ``prompt ids + completion ids + eos``, right-padded to ``seq_len + 1``;
    the targets of the prompt and of the padding are ``IGNORE_INDEX`` (not trained on)."""

    def __init__(self, rows: list[tuple[np.ndarray, int]], seq_len: int, seed: int, shuffle: bool, *,
                 pad_id: int, vocab_size: int, what: str):
        if not rows:
            raise ValueError(f"{what} holds no rows")
        self.rows, self.span, self.pad_id, self.vocab_size = rows, seq_len + 1, pad_id, vocab_size
        self.numbered = Numbered(len(rows), seed, shuffle)

    def sample(self, index: int) -> Sample:
        ids, prompt = self.rows[self.numbered.item(index)]
        tokens = torch.full((self.span,), self.pad_id, dtype=torch.long)
        tokens[:len(ids)] = torch.from_numpy(ids)
        inputs, targets = tokens[:-1], tokens[1:].clone()
        targets[:max(prompt - 1, 0)] = IGNORE_INDEX  # target t is token t + 1: prompt tokens 1..prompt-1
        targets[len(ids) - 1:] = IGNORE_INDEX  # padding
        return inputs, targets


# ----------------------------------------------------------------------------- building


def _tokenizer(data: DataSpec, model_dir: str | None) -> LoadedTokenizer:
    return load_tokenizer(data.tokenizer, model_dir, where=data.WHERE)


def build_tokenized_text(data: DataSpec, seed: int, model_dir: str | None) -> TokenStreamDataset:
    """``text`` with a tokenizer: the documents tokenized into ``doc0 + eos + doc1 + eos + ...``."""
    tokenizer = _tokenizer(data, model_dir)
    fs, sizes = list_files(data.uri, data.glob, where=data.WHERE)
    pieces: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode(batch):
            pieces.append(np.asarray(ids + [tokenizer.eos_id], dtype=np.int64))
        batch.clear()

    for document in read_documents(fs, list(sizes), data.format, data.field, where=data.WHERE):
        batch.append(document)
        if len(batch) >= 1024:
            flush()
    flush()
    if not pieces:
        raise ValueError(f"{data.WHERE}: no documents in {data.uri!r} ({data.glob!r})")
    stream = InMemoryTokens(np.concatenate(pieces))
    return TokenStreamDataset(stream, data.seq_len, seed, data.shuffle, vocab_size=tokenizer.vocab_size,
                              what=f"{data.WHERE}: {data.uri!r} ({data.glob!r}, tokenized)")


def build_tokens(data: DataSpec, seed: int) -> TokenStreamDataset:
    """``tokens``: ``.bin`` files of ``dtype`` or parquet list columns, concatenated in file order
    (no eos or separator is added between files or rows)."""
    fs, sizes = list_files(data.uri, data.glob, where=data.WHERE)
    parts: list[Any] = []
    for path, size in sizes.items():
        if data.format == "bin":
            parts.append(BinTokens(fs, path, size, data.dtype, where=data.WHERE))
        else:
            parts.append(InMemoryTokens(parquet_tokens(fs, path, data.column, where=data.WHERE)))
    return TokenStreamDataset(ConcatTokens(parts), data.seq_len, seed, data.shuffle,
                              what=f"{data.WHERE}: {data.uri!r} ({data.glob!r})")


def build_sft(data: DataSpec, seed: int, model_dir: str | None) -> SFTDataset:
    """``sft``: every row tokenized up front, so a row longer than ``seq_len + 1`` tokens is an
    error before the first step, naming its file and row."""
    tokenizer = _tokenizer(data, model_dir)
    fs, sizes = list_files(data.uri, data.glob, where=data.WHERE)
    rows: list[tuple[np.ndarray, int]] = []
    span = data.seq_len + 1
    pairs = list(read_pairs(fs, list(sizes), data.format, data.prompt_field, data.completion_field,
                            where=data.WHERE))
    for start in range(0, len(pairs), 1024):
        chunk = pairs[start:start + 1024]
        prompts = tokenizer.encode([p for _, _, p, _ in chunk])
        completions = tokenizer.encode([c for _, _, _, c in chunk])
        for (path, row, _, _), prompt, completion in zip(chunk, prompts, completions):
            ids = prompt + completion + [tokenizer.eos_id]
            if len(ids) > span:
                raise ValueError(f"{path} row {row}: {len(ids)} tokens (prompt, completion and eos), more than "
                                 f"{data.WHERE}.seq_len + 1 = {span}")
            rows.append((np.asarray(ids, dtype=np.int64), len(prompt)))
    return SFTDataset(rows, data.seq_len, seed, data.shuffle, pad_id=tokenizer.pad_id,
                      vocab_size=tokenizer.vocab_size, what=f"{data.WHERE}: {data.uri!r} ({data.glob!r})")


def check_vocabulary(dataset: Any, model: torch.nn.Module, *, where: str = "data") -> None:
    """A tokenizer whose vocabulary exceeds the model's input embeddings is an error naming
    ``data.tokenizer`` (its ids would index past the embedding table)."""
    vocab = getattr(dataset, "vocab_size", None)
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else getattr(model, "wte", None)
    rows = getattr(embedding, "num_embeddings", None)
    if vocab is not None and rows is not None and vocab > rows:
        raise ValueError(f"{where}.tokenizer: its vocabulary has {vocab} tokens, more than the model's "
                         f"{rows} input embeddings")
