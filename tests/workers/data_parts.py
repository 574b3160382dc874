"""Small corpora and a BPE tokenizer trained here (no hub), for the data kinds' tests."""

from __future__ import annotations

import json
from pathlib import Path

DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be, or not to be, that is the question.",
    "All that glitters is not gold; all who wander are not lost.",
    "The only thing we have to fear is fear itself.",
    "In the middle of difficulty lies opportunity, said the fox.",
    "Brevity is the soul of wit, and the dog agreed.",
    "Ask not what your country can do for you.",
]

PAIRS = [  # prompt/completion rows of different lengths
    ("Q: colour of the sky? A:", " blue"),
    ("Q: what does the fox do? A:", " it jumps over the lazy dog"),
    ("Say hi:", " hi"),
    ("Q: first step of a journey? A:", " a single step begins a journey of a thousand miles"),
    ("Finish: to be or", " not to be"),
    ("Q: is all that glitters gold? A:", " no"),
    ("Echo: fear", " fear itself"),
    ("Q: soul of wit? A:", " brevity, said the dog"),
]


def train_tokenizer(directory: Path, vocab_size: int = 200, *, config: bool = True) -> Path:
    """A BPE tokenizer (Metaspace words, so the vocabulary stays below gpt-nano's 256 bytes) trained
    on ``DOCUMENTS`` and ``PAIRS``, saved as tokenizer.json
    (with tokenizer_config.json naming ``<eos>`` and ``<pad>`` unless ``config`` is false)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<pad>", "<unk>"],
                                  show_progress=False)
    text = DOCUMENTS + [p + c for p, c in PAIRS]
    tokenizer.train_from_iterator(text, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<pad>"}))
    return directory


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path
