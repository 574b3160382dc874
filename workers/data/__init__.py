"""Training data: every rank reads its own slice of every global batch, reproducibly.

A dataset here is *indexable by a global sample number*: sample ``i`` is always the same
tokens for a given seed, whichever rank reads it and however often. The loader turns a
position in that numbering (``position`` = samples the whole job has consumed) into this
rank's micro-batches, so

- the ranks of one step read disjoint slices that together are exactly the global batch,
- the same seed gives the same batches, run after run,
- a checkpoint saves ``position`` and a resumed job continues with the very next sample:
  nothing skipped, nothing seen twice — at any world size, since the split is recomputed.

The kinds (the job spec's ``data`` block, a ``contract.spec.DataSpec``; docs/contracts.md):
``synthetic``, byte-level ``text`` and ``factory`` (``builtin.py``); ``text`` with a tokenizer,
``tokens`` and ``sft`` (``tokenized.py``, reading through ``sources.py``). ``loader.py`` splits
global batches into this rank's micro-batches and reads the next one ahead.
"""

from __future__ import annotations

from contract.spec import DataSpec
from workers.data.builtin import (
    FactoryDataset,
    IndexedDataset,
    Sample,
    SyntheticDataset,
    TextFilesDataset,
)
from workers.data.loader import ShardedBatchLoader
from workers.data.tokenized import (
    SFTDataset,
    TokenStreamDataset,
    build_sft,
    build_tokenized_text,
    build_tokens,
    check_vocabulary,
)

__all__ = ["FactoryDataset", "IndexedDataset", "SFTDataset", "Sample", "ShardedBatchLoader", "SyntheticDataset",
           "TextFilesDataset", "TokenStreamDataset", "build_dataset", "check_vocabulary"]


def build_dataset(data: DataSpec, seed: int = 0, model_dir: str | None = None) -> IndexedDataset:
    """The dataset a job spec's ``data`` block names (its defaults, e.g. ``vocab_size``, are the
    spec's); ``model_dir`` is the job's ``model.hf``, where ``tokenizer: "model"`` is read."""
    if data.kind == "synthetic":
        return SyntheticDataset(data.vocab_size, data.seq_len, seed)
    if data.kind == "text" and data.tokenizer is None:
        return TextFilesDataset(data.uri, data.glob, data.seq_len, seed, shuffle=data.shuffle)
    if data.kind == "text":
        return build_tokenized_text(data, seed, model_dir)
    if data.kind == "tokens":
        return build_tokens(data, seed)
    if data.kind == "sft":
        return build_sft(data, seed, model_dir)
    from workers.models import resolve_factory

    return FactoryDataset(resolve_factory(data.factory)(**data.kwargs), seed)
