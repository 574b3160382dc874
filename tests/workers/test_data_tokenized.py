"""The tokenized data kinds: text with a tokenizer, pre-tokenized tokens, SFT rows; and reading ahead.

A real BPE tokenizer trained here (tests/workers/data_parts.py); the files are real JSONL,
parquet, text and nanoGPT-style .bin files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from contract.spec import DataSpec
from tests.workers.data_parts import (
    DOCUMENTS,
    PAIRS,
    train_tokenizer,
    write_jsonl,
    write_parquet,
)
from workers.data import ShardedBatchLoader, build_dataset, check_vocabulary
from workers.loss import IGNORE_INDEX
from workers.models import GPT, preset_config

L = 8  # seq_len


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def encode(tokenizer_dir: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def spec(**fields) -> DataSpec:
    return DataSpec.model_validate({"seq_len": L, **fields})


def samples(dataset, n: int) -> list[list[int]]:
    return [torch.cat([x[:1], y]).tolist() for x, y in (dataset.sample(i) for i in range(n))]


def stream_of(tokenizer_dir: Path, documents: list[str]) -> list[int]:
    eos = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id("<eos>")
    return [t for d in documents for t in encode(tokenizer_dir, d) + [eos]]


# ----------------------------------------------------------------------------- text + tokenizer


def test_tokenized_text_is_the_document_stream_with_eos_cut_in_order(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "a.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCUMENTS[:4])])
    write_jsonl(tmp_path / "b.jsonl", [{"text": d} for d in DOCUMENTS[4:]])
    data = spec(kind="text", uri=tmp_path.as_uri(), glob="*.jsonl", format="jsonl",
                tokenizer=tokenizer_dir.as_uri(), shuffle=False)
    dataset = build_dataset(data)
    stream = stream_of(tokenizer_dir, DOCUMENTS)
    n = len(stream) // (L + 1)
    assert samples(dataset, n) == [stream[i * (L + 1):(i + 1) * (L + 1)] for i in range(n)]
    assert samples(dataset, n + 2)[n:] == samples(dataset, 2)  # the next epoch starts over
    x, y = dataset.sample(0)
    assert x.shape == y.shape == (L,) and torch.equal(x[1:], y[:-1])


def test_parquet_and_txt_give_the_same_stream_as_jsonl(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "j" / "d.jsonl", [{"body": d} for d in DOCUMENTS])
    write_parquet(tmp_path / "p" / "d.parquet", {"body": DOCUMENTS, "other": list(range(len(DOCUMENTS)))})
    for i, d in enumerate(DOCUMENTS):
        (tmp_path / "t").mkdir(exist_ok=True)
        (tmp_path / "t" / f"{i:02d}.txt").write_text(d)
    common = {"kind": "text", "tokenizer": (tokenizer_dir / "tokenizer.json").as_uri(), "shuffle": False}
    got = [samples(build_dataset(spec(uri=(tmp_path / d).as_uri(), format=fmt, **fields, **common)), 6)
           for d, fmt, fields in (("j", "jsonl", {"field": "body"}), ("p", "parquet", {"field": "body"}),
                                  ("t", "txt", {}))]
    assert got[0] == got[1] == got[2]


def test_shuffled_samples_are_a_seeded_permutation_per_epoch(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCUMENTS * 3])
    fields = {"kind": "text", "uri": tmp_path.as_uri(), "format": "jsonl", "tokenizer": tokenizer_dir.as_uri()}
    ordered = build_dataset(spec(shuffle=False, **fields))
    n = ordered.numbered.length
    shuffled = build_dataset(spec(**fields), seed=3)
    first, second = samples(shuffled, 2 * n)[:n], samples(shuffled, 2 * n)[n:]
    assert sorted(first) == sorted(samples(ordered, n)) == sorted(second)
    assert first != samples(ordered, n) and first != second
    assert samples(build_dataset(spec(**fields), seed=3), n) == first  # the same seed, the same order
    assert samples(build_dataset(spec(**fields), seed=4), n) != first


def test_eos_comes_from_the_model_config_without_a_tokenizer_config(tmp_path):
    tok = train_tokenizer(tmp_path / "bare", config=False)
    write_jsonl(tmp_path / "data" / "d.jsonl", [{"text": d} for d in DOCUMENTS])
    data = spec(kind="text", uri=(tmp_path / "data").as_uri(), format="jsonl", tokenizer="model", shuffle=False)
    with pytest.raises(ValueError, match=r"data\.tokenizer: no eos token"):
        build_dataset(data, model_dir=tok.as_uri())
    (tok / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 1}))
    stream = [t for d in DOCUMENTS for t in encode(tok, d) + [1]]
    assert samples(build_dataset(data, model_dir=tok.as_uri()), 3) == \
        [stream[i * (L + 1):(i + 1) * (L + 1)] for i in range(3)]


def test_bad_text_input_names_the_file_row_and_field(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"body": "no text"}])
    fields = {"kind": "text", "uri": tmp_path.as_uri(), "format": "jsonl", "tokenizer": tokenizer_dir.as_uri()}
    with pytest.raises(ValueError, match=r"d\.jsonl row 1: no 'text' \(data\.field\)"):
        build_dataset(spec(**fields))
    write_parquet(tmp_path / "p" / "d.parquet", {"body": ["x"]})
    with pytest.raises(ValueError, match=r"d\.parquet: no column 'text' \(data\.field\)"):
        build_dataset(spec(**{**fields, "uri": (tmp_path / "p").as_uri(), "format": "parquet"}))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "d.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no documents"):
        build_dataset(spec(**{**fields, "uri": (tmp_path / "e").as_uri()}))
    with pytest.raises(ValueError, match=r"data\.tokenizer: no tokenizer\.json"):
        build_dataset(spec(**{**fields, "tokenizer": tmp_path.as_uri()}))


# ----------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_tokens_are_read_in_order_across_files(tmp_path, dtype):
    big = 70_000 if dtype == "uint32" else 60_000  # an id only uint32 holds, or near uint16's top
    first, second = np.arange(20, dtype=dtype) + big, np.arange(25, dtype=dtype)
    first.tofile(tmp_path / "a.bin")
    second.tofile(tmp_path / "b.bin")
    dataset = build_dataset(spec(kind="tokens", uri=tmp_path.as_uri(), glob="*.bin", format="bin", dtype=dtype,
                                 shuffle=False))
    stream = np.concatenate([first, second]).astype(np.int64).tolist()
    assert samples(dataset, 5) == [stream[i * 9:(i + 1) * 9] for i in range(5)]  # 45 tokens: 5 samples
    assert samples(dataset, 6)[5] == samples(dataset, 1)[0]


def test_a_bin_file_of_a_partial_token_is_refused_naming_it(tmp_path):
    (tmp_path / "bad.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    with pytest.raises(ValueError, match=r"bad\.bin: 5 bytes is not a whole number of uint16 tokens"):
        build_dataset(spec(kind="tokens", uri=tmp_path.as_uri(), format="bin"))


def test_parquet_token_rows_are_concatenated_without_separators(tmp_path):
    rows = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    write_parquet(tmp_path / "t.parquet", {"ids": rows})
    dataset = build_dataset(spec(kind="tokens", uri=tmp_path.as_uri(), format="parquet", column="ids",
                                 shuffle=False))
    assert samples(dataset, 2) == [list(range(1, 10)), list(range(10, 19))]
    with pytest.raises(ValueError, match=r"t\.parquet: no column 'input_ids' \(data\.column\)"):
        build_dataset(spec(kind="tokens", uri=tmp_path.as_uri(), format="parquet"))
    write_parquet(tmp_path / "short" / "t.parquet", {"input_ids": [[1, 2]]})
    with pytest.raises(ValueError, match="2 tokens, fewer than seq_len"):
        build_dataset(spec(kind="tokens", uri=(tmp_path / "short").as_uri(), format="parquet"))


# ----------------------------------------------------------------------------- sft


def sft_spec(tmp_path: Path, tokenizer_dir: Path, seq_len: int = 24, **fields) -> DataSpec:
    return DataSpec.model_validate({"kind": "sft", "uri": tmp_path.as_uri(), "format": "jsonl", "seq_len": seq_len,
                                    "tokenizer": tokenizer_dir.as_uri(), "shuffle": False, **fields})


def test_sft_rows_mask_the_prompt_and_padding(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    dataset = build_dataset(sft_spec(tmp_path, tokenizer_dir))
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos, pad = tok.token_to_id("<eos>"), tok.token_to_id("<pad>")
    for i, (prompt, completion) in enumerate(PAIRS):
        p, c = encode(tokenizer_dir, prompt), encode(tokenizer_dir, completion)
        ids = p + c + [eos]
        padded = ids + [pad] * (25 - len(ids))
        x, y = dataset.sample(i)
        assert x.tolist() == padded[:-1]
        want = [IGNORE_INDEX] * (len(p) - 1) + c + [eos] + [IGNORE_INDEX] * (25 - len(ids))
        assert y.tolist() == want, (prompt, completion)
    assert dataset.sample(len(PAIRS))[0].tolist() == dataset.sample(0)[0].tolist()  # next epoch


def test_sft_from_parquet_with_other_field_names(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "j" / "rows.jsonl", [{"q": p, "a": c} for p, c in PAIRS])
    write_parquet(tmp_path / "p" / "rows.parquet", {"q": [p for p, _ in PAIRS], "a": [c for _, c in PAIRS]})
    names = {"prompt_field": "q", "completion_field": "a"}
    jsonl = build_dataset(sft_spec(tmp_path / "j", tokenizer_dir, **names))
    parquet = build_dataset(sft_spec(tmp_path / "p", tokenizer_dir, format="parquet", **names))
    for i in range(len(PAIRS)):
        assert all(torch.equal(a, b) for a, b in zip(jsonl.sample(i), parquet.sample(i)))


def test_bad_sft_rows_are_refused_naming_file_row_and_field(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    longest = max(len(encode(tokenizer_dir, p) + encode(tokenizer_dir, c)) + 1 for p, c in PAIRS)
    row = max(range(len(PAIRS)), key=lambda r: len(encode(tokenizer_dir, PAIRS[r][0] + PAIRS[r][1])))
    with pytest.raises(ValueError, match=rf"rows\.jsonl row {row}: {longest} tokens .* more than data\.seq_len"):
        build_dataset(sft_spec(tmp_path, tokenizer_dir, seq_len=longest - 2))
    write_jsonl(tmp_path / "m" / "rows.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "only"}])
    with pytest.raises(ValueError, match=r"row 1: no 'completion' \(data\.completion_field\)"):
        build_dataset(sft_spec(tmp_path / "m", tokenizer_dir))


def test_a_tokenizer_larger_than_the_models_embeddings_is_refused(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    dataset = build_dataset(sft_spec(tmp_path, tokenizer_dir))
    with torch.device("meta"):
        check_vocabulary(dataset, GPT(preset_config("gpt-nano")))  # 200 tokens, 256 rows
        with pytest.raises(ValueError, match=r"data\.tokenizer: its vocabulary has 200 tokens, more than the "
                                             r"model's 128 input embeddings"):
            check_vocabulary(dataset, GPT(preset_config("gpt-nano", vocab_size=128)))


# ----------------------------------------------------------------------------- reading ahead


class CountingDataset:
    def __init__(self):
        self.reads = []

    def sample(self, index):
        self.reads.append(index)
        return torch.tensor(index), torch.tensor(index)


def test_reading_ahead_gives_exactly_the_same_batches_and_positions():
    plain = ShardedBatchLoader(CountingDataset(), global_batch_size=8, micro_batch_size=2, rank=1, world_size=2)
    ahead = ShardedBatchLoader(CountingDataset(), global_batch_size=8, micro_batch_size=2, rank=1, world_size=2,
                               prefetch=True)
    for _ in range(3):
        want, got = plain.next_batch(), ahead.next_batch()
        assert [x.tolist() for x, _ in got] == [x.tolist() for x, _ in want]
        assert ahead.state_dict() == plain.state_dict()  # a checkpoint saves what was consumed
    ahead.load_state_dict({"position": 8, "global_batch_size": 8})  # resumed elsewhere: the read ahead is dropped
    plain.load_state_dict({"position": 8, "global_batch_size": 8})
    assert [x.tolist() for x, _ in ahead.next_batch()] == [x.tolist() for x, _ in plain.next_batch()] == [[12, 13],
                                                                                                       [14, 15]]
    ahead.close()  # which samples the background thread had read by now depends on scheduling: not asserted


@pytest.mark.parametrize("data", [
    {"kind": "text", "uri": "s3://b/c", "seq_len": 8},
    {"kind": "text", "uri": "s3://b/c", "seq_len": 8, "format": "parquet", "field": "body", "tokenizer": "s3://t"},
    {"kind": "tokens", "uri": "s3://b/c", "seq_len": 8, "format": "bin", "dtype": "uint32", "shuffle": False},
    {"kind": "sft", "uri": "s3://b/c", "seq_len": 8, "format": "jsonl", "tokenizer": "s3://t", "prompt_field": "q"},
    {"kind": "synthetic", "seq_len": 8},
    {"factory": "pkg.mod:fn", "kwargs": {"a": 1}},
])
def test_a_stored_data_block_validates_again_as_it_was(data):
    """The control plane stores every field, defaults included; the workers validate that again."""
    stored = DataSpec.model_validate(data).model_dump(mode="json")
    assert DataSpec.model_validate(stored).model_dump(mode="json") == stored
