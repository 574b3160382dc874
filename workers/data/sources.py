"""What the data kinds read from storage: file listings, documents, SFT rows, token files, tokenizers.

Every reader goes through fsspec (``file://``, ``s3://``, ...) with the job's storage options,
and every error names what the user can fix: the file (and its row) and the spec field
(``data.field``, ``data.column``, ``data.tokenizer``, ...; ``eval.data.*`` for an eval block).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np


def filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) of ``uri``, with the job's storage options."""
    import fsspec

    from storage.storage import protocol_of, storage_options

    return fsspec.core.url_to_fs(uri, **storage_options(protocol_of(uri)))


def list_files(uri: str, glob: str, *, where: str = "data") -> tuple[Any, dict[str, int]]:
    """(filesystem, {path: size}) of the non-empty files under ``uri`` matching ``glob``, sorted."""
    fs, root = filesystem(uri)
    root = root.rstrip("/")
    pattern = f"{root}/{glob.lstrip('/')}" if glob else root
    sizes = {path: info["size"] for path, info in sorted(fs.glob(pattern, detail=True).items())
             if info.get("type", "file") == "file" and info.get("size")}
    if not sizes:
        raise ValueError(f"{where}: no non-empty files match {glob!r} under {uri!r}")
    return fs, sizes


# ----------------------------------------------------------------------------- records


def _jsonl_records(fs: Any, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row, object) of each non-blank line (row counts lines from 0)."""
    with fs.open(path, "rb") as file:
        for row, line in enumerate(file):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} row {row}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path} row {row}: a JSON object per line is expected")
            yield row, record


def _parquet_columns(fs: Any, path: str, columns: dict[str, str]) -> dict[str, list[Any]]:
    """{name: values} of the parquet columns ``columns`` ({column: the spec field naming it})."""
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as file:
        schema = pq.read_schema(file)
        for column, field in columns.items():
            if column not in schema.names:
                raise ValueError(f"{path}: no column {column!r} ({field}); the file has {schema.names}")
        file.seek(0)
        table = pq.read_table(file, columns=list(columns))
    return {column: table.column(column).to_pylist() for column in columns}


def _text(value: Any, path: str, row: int, name: str, field: str) -> str:
    if not isinstance(value, str):
        problem = "no" if value is None else f"a {type(value).__name__}, not a string, as"
        raise ValueError(f"{path} row {row}: {problem} {name!r} ({field})")
    return value


def read_documents(fs: Any, paths: list[str], fmt: str, name: str, *, where: str) -> Iterator[str]:
    """The documents of a ``text`` corpus: each line's (jsonl) or row's (parquet) ``name``
    (``data.field``), or each whole file (txt), in file order."""
    field = f"{where}.field"
    for path in paths:
        if fmt == "txt":
            yield fs.cat_file(path).decode("utf-8")
        elif fmt == "jsonl":
            for row, record in _jsonl_records(fs, path):
                yield _text(record.get(name), path, row, name, field)
        else:
            for row, value in enumerate(_parquet_columns(fs, path, {name: field})[name]):
                yield _text(value, path, row, name, field)


def read_pairs(fs: Any, paths: list[str], fmt: str, prompt: str, completion: str, *,
               where: str) -> Iterator[tuple[str, int, str, str]]:
    """(file, row, prompt, completion) of each SFT row, in file order."""
    fields = {prompt: f"{where}.prompt_field", completion: f"{where}.completion_field"}
    for path in paths:
        if fmt == "jsonl":
            rows = ((row, record.get(prompt), record.get(completion)) for row, record in _jsonl_records(fs, path))
        else:
            columns = _parquet_columns(fs, path, fields)
            rows = ((row, p, c) for row, (p, c) in enumerate(zip(columns[prompt], columns[completion])))
        for row, p, c in rows:
            yield (path, row, _text(p, path, row, prompt, fields[prompt]),
                   _text(c, path, row, completion, fields[completion]))


# ----------------------------------------------------------------------------- token files


def parquet_tokens(fs: Any, path: str, column: str, *, where: str) -> np.ndarray:
    """The list column ``column`` of a parquet file, rows concatenated (no separator added)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    field = f"{where}.column"
    with fs.open(path, "rb") as file:
        schema = pq.read_schema(file)
        if column not in schema.names:
            raise ValueError(f"{path}: no column {column!r} ({field}); the file has {schema.names}")
        file.seek(0)
        values = pq.read_table(file, columns=[column]).column(column)
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)) or \
            not pa.types.is_integer(values.type.value_type):
        raise ValueError(f"{path}: column {column!r} ({field}) is {values.type}, not a list of integer token ids")
    return values.combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


class BinTokens:
    """A nanoGPT-style ``.bin`` file: a raw array of ``dtype`` token ids, read by range.

    A local file is memory-mapped; a remote one is read by ranged requests, so no rank holds
    the whole file.
    """

    def __init__(self, fs: Any, path: str, size: int, dtype: str, *, where: str):
        self.dtype = np.dtype(dtype)
        if size % self.dtype.itemsize:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {dtype} tokens "
                             f"({where}.dtype: {self.dtype.itemsize} bytes each)")
        self.fs, self.path, self.length = fs, path, size // self.dtype.itemsize
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        self.memmap = np.memmap(path, dtype=self.dtype, mode="r") if local else None

    def read(self, start: int, end: int) -> np.ndarray:
        if self.memmap is not None:
            return np.asarray(self.memmap[start:end])
        size = self.dtype.itemsize
        return np.frombuffer(self.fs.cat_file(self.path, start=start * size, end=end * size), dtype=self.dtype)


# ----------------------------------------------------------------------------- tokenizers


@dataclass(frozen=True)
class LoadedTokenizer:
    """A ``tokenizers.Tokenizer`` with the ids the data kinds need."""

    tokenizer: Any
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without added special tokens."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


def _read_json(fs: Any, path: str) -> dict[str, Any] | None:
    if not fs.exists(path):
        return None
    value = json.loads(fs.cat_file(path))
    return value if isinstance(value, dict) else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(tokenizer: str, model_dir: str | None, *, where: str) -> LoadedTokenizer:
    """The tokenizer ``data.tokenizer`` names: ``"model"`` (the files in ``model_dir``, the job's
    ``model.hf``) or the URI of a directory holding ``tokenizer.json`` (or of the file itself).

    The eos id is the ``eos_token`` of tokenizer_config.json or special_tokens_map.json beside
    it, else the model config's ``eos_token_id``; the pad id is their ``pad_token``, else eos.
    """
    from tokenizers import Tokenizer

    field = f"{where}.tokenizer"
    uri = model_dir if tokenizer == "model" else tokenizer
    if uri is None:
        raise ValueError(f"{field} 'model' needs model.hf")
    fs, path = filesystem(uri)
    path = path.rstrip("/")
    if path.endswith(".json"):
        file, directory = path, posixpath.dirname(path)
    else:
        file, directory = f"{path}/tokenizer.json", path
    if not fs.exists(file):
        raise ValueError(f"{field}: no tokenizer.json at {uri!r}")
    loaded = Tokenizer.from_str(fs.cat_file(file).decode("utf-8"))
    settings: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        settings.update(_read_json(fs, f"{directory}/{name}") or {})

    def token_id(key: str) -> int | None:
        text = _token_text(settings.get(key))
        return None if text is None else loaded.token_to_id(text)

    eos = token_id("eos_token")
    if eos is None and model_dir is not None:
        model_fs, model_path = filesystem(model_dir)
        config = _read_json(model_fs, f"{model_path.rstrip('/')}/config.json") or {}
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        raise ValueError(f"{field}: no eos token: tokenizer_config.json / special_tokens_map.json beside "
                         f"{file!r} name no eos_token the tokenizer knows, and the model config has no eos_token_id")
    pad = token_id("pad_token")
    return LoadedTokenizer(loaded, eos, eos if pad is None else pad, loaded.get_vocab_size(with_added_tokens=True))
