"""A tiny Hugging Face model, tokenizer and data made locally (no hub): what ``examples/hf-finetune-tiny-llama.yaml`` trains.

    python -m examples.tiny_hf OUT_DIR

writes under ``OUT_DIR``:

* ``model/``: a tiny Llama (transformers code, random init, ``save_pretrained``: ``config.json``,
  ``model.safetensors``) and a byte-level BPE tokenizer trained on the corpus (``tokenizer.json``,
  ``tokenizer_config.json`` with ``eos_token``);
* ``corpus/docs.jsonl``: documents ``{"text": ...}`` (the standard library's docstrings);
* ``sft/pairs.jsonl``: prompt/completion pairs ``{"prompt": ..., "completion": ...}`` of different lengths.

The job YAML then points ``model.hf`` and ``model.init_from`` at ``model/`` and ``data.uri`` at
``corpus/`` (``tokenizer: model``). Tests build their models with the same functions.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EOS, PAD, BOS = "</s>", "<pad>", "<s>"


def corpus_texts(limit: int = 400) -> list[str]:
    """Docstrings of standard-library modules: real English-and-code text, on every machine."""
    import collections
    import email
    import json as json_module
    import pathlib
    import string
    import textwrap

    texts = []
    for module in (collections, email, json_module, pathlib, string, textwrap, inspect, argparse):
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40 and doc not in texts:
                texts.append(doc)
    return texts[:limit]


def make_tokenizer(out: Path, texts: list[str], vocab_size: int = 256):
    """A byte-level BPE tokenizer trained on ``texts`` (``tokenizers``), saved for ``AutoTokenizer``
    (``tokenizer.json`` + ``tokenizer_config.json`` naming ``eos_token``); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=BOS, pad_token=PAD)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def make_llama(out: Path, vocab_size: int, seed: int = 0, tied: bool = True, **overrides):
    """A tiny ``LlamaForCausalLM`` (hidden 64, 2 layers) with random weights, ``save_pretrained`` to ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))
    model.save_pretrained(str(out))
    return model


def make_all(root: Path, vocab_size: int = 384) -> dict[str, Path]:
    """The model directory (model + tokenizer), a JSONL corpus and an SFT file under ``root``."""
    texts = corpus_texts()
    model_dir = root / "model"
    tok = make_tokenizer(model_dir, texts, vocab_size)
    make_llama(model_dir, vocab_size=len(tok))
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    with open(corpus / "docs.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    sft = root / "sft"
    sft.mkdir(parents=True, exist_ok=True)
    with open(sft / "pairs.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(texts[:64]):
            first, _, rest = text.partition("\n")
            prompt = f"Summarize in one line ({i % 5 + 1}): {rest[:40 * (i % 4 + 1)]}"
            f.write(json.dumps({"prompt": prompt, "completion": first[:120]}) + "\n")
    return {"model": model_dir, "corpus": corpus, "sft": sft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-size", type=int, default=384)
    args = parser.parse_args()
    made = make_all(args.out.resolve(), args.vocab_size)
    for what, path in made.items():
        print(f"{what}: {path}")


if __name__ == "__main__":
    main()
