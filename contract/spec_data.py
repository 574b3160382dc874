"""The job spec's ``data`` block and the ``eval`` block that reads one (docs/contracts.md, "Data")."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from contract.presets import BYTE_VOCAB
from contract.spec_base import (BACKSLASH_OR_CONTROL, MAX_INT32, MAX_URI_CHARS, BoundedJson, SpecModel,
                                check_factory_path, check_storage_uri)

MAX_GLOB_CHARS = 1024
MAX_FIELD_NAME_CHARS = 256  # a JSONL key or parquet column name (data.field, data.column, ...)


DATA_FORMATS: dict[str, tuple[str, ...]] = {"text": ("jsonl", "parquet", "txt"), "tokens": ("bin", "parquet"),
                                            "sft": ("jsonl", "parquet")}
"""``data.format`` of each kind that reads files of a format (``text`` only with a ``tokenizer``)."""
TOKEN_DTYPES = ("uint16", "uint32")  # a ``.bin`` token stream's element type (``data.dtype``)
MODEL_TOKENIZER = "model"  # ``data.tokenizer``: the tokenizer files in ``model.hf``
# the fields only some kinds read, and those kinds
_KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "uri": ("text", "tokens", "sft"), "glob": ("text", "tokens", "sft"), "format": ("text", "tokens", "sft"),
    "field": ("text",), "tokenizer": ("text", "sft"), "dtype": ("tokens",), "column": ("tokens",),
    "prompt_field": ("sft",), "completion_field": ("sft",), "shuffle": ("text", "tokens", "sft"),
    "factory": ("factory",), "kwargs": ("factory",)}  # vocab_size: read by synthetic, accepted by every kind


class DataSpec(SpecModel):
    """The training data (docs/contracts.md, "Data"): ``text`` files (byte-level, or documents
    tokenized with ``tokenizer``), pre-tokenized ``tokens``, prompt/completion rows (``sft``),
    ``synthetic`` tokens, or a user ``factory``.

    ``WHERE`` is the block's place in the job spec, for the messages and the field an error
    names: ``data`` here, ``eval.data`` in ``EvalDataSpec`` (the same rules, one class).
    """

    WHERE: ClassVar[str] = "data"

    kind: Literal["text", "tokens", "sft", "synthetic", "factory"]
    uri: str | None = None
    glob: str = "**/*"
    format: str | None = None
    field: str = Field(default="text", min_length=1, max_length=MAX_FIELD_NAME_CHARS)
    tokenizer: str | None = Field(default=None, max_length=MAX_URI_CHARS)
    dtype: Literal[TOKEN_DTYPES] = "uint16"
    column: str = Field(default="input_ids", min_length=1, max_length=MAX_FIELD_NAME_CHARS)
    prompt_field: str = Field(default="prompt", min_length=1, max_length=MAX_FIELD_NAME_CHARS)
    completion_field: str = Field(default="completion", min_length=1, max_length=MAX_FIELD_NAME_CHARS)
    shuffle: bool = True
    seq_len: int | None = Field(default=None, ge=1, le=MAX_INT32)
    vocab_size: int | None = Field(default=None, ge=2, le=MAX_INT32)
    factory: str | None = None
    kwargs: BoundedJson = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _factory_implies_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and "kind" not in data and "factory" in data:
            return {**data, "kind": "factory"}
        return data

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        return None if value is None else check_storage_uri(value)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, value: str | None) -> str | None:
        """``"model"`` or a storage URI of a directory holding ``tokenizer.json`` (or of the file)."""
        return value if value in (None, MODEL_TOKENIZER) else check_storage_uri(value)

    @field_validator("glob")
    @classmethod
    def _glob(cls, value: str) -> str:
        """A pattern relative to ``uri`` that cannot leave it (workers glob ``{uri}/{glob}``)."""
        if len(value) > MAX_GLOB_CHARS:
            problem = f"is longer than {MAX_GLOB_CHARS} characters"
        elif value.startswith("/"):
            problem = f"must be relative to {cls.WHERE}.uri, not an absolute path"
        elif (bad := BACKSLASH_OR_CONTROL.search(value)) is not None:
            problem = f"must not contain {bad.group()!r} (backslashes and control characters are refused)"
        elif ".." in value.split("/"):
            problem = f"must not contain a '..' segment (it must stay below {cls.WHERE}.uri)"
        else:
            return value
        raise PydanticCustomError("glob_pattern", "{problem}", {"problem": problem})

    @field_validator("factory")
    @classmethod
    def _factory(cls, value: str | None) -> str | None:
        return None if value is None else check_factory_path(value)

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "DataSpec":
        where, kind = self.WHERE, self.kind

        def refuse(name: str, code: str, message: str, **ctx: Any) -> PydanticCustomError:
            return PydanticCustomError(code, message, {"where": where, "name": name, "kind": kind,
                                                       "field": f"{where}.{name}", **ctx})

        # a field counts as given when it is not its default: a stored spec (every field written
        # out, defaults included) validates again as it did at submit
        fields = type(self).model_fields
        given = {name for name in _KIND_FIELDS
                 if getattr(self, name) != fields[name].get_default(call_default_factory=True)}
        for name in sorted(given):
            if kind not in _KIND_FIELDS[name]:
                raise refuse(name, "field_for_kind", "{where}.{name} is not read when {where}.kind is '{kind}'")
        required = {"text": ("uri", "seq_len"), "tokens": ("uri", "seq_len", "format"),
                    "sft": ("uri", "seq_len", "format", "tokenizer"), "synthetic": ("seq_len",),
                    "factory": ("factory",)}[kind]
        if kind == "text" and self.tokenizer is not None:
            required += ("format",)
        for name in required:
            if getattr(self, name) is None:
                raise refuse(name, "missing_for_kind", "{where}.{name} is required when {where}.kind is '{kind}'"
                             + (" with a tokenizer" if kind == "text" else ""))
        if self.format is not None:
            formats = DATA_FORMATS[kind]
            if kind == "text" and self.tokenizer is None:
                raise refuse("format", "format_without_tokenizer",
                             "{where}.format is read with {where}.tokenizer only: without one, text is the "
                             "files' bytes")
            if self.format not in formats:
                raise refuse("format", "unknown_format", "{where}.format '{value}' is not one of {formats} "
                             "for {where}.kind '{kind}'", value=self.format, formats=list(formats))
        if "dtype" in given and self.format != "bin":
            raise refuse("dtype", "field_for_format", "{where}.dtype is read for {where}.format 'bin' only")
        if "column" in given and self.format != "parquet":
            raise refuse("column", "field_for_format", "{where}.column is read for {where}.format 'parquet' only")
        if "field" in given and self.format not in ("jsonl", "parquet"):
            raise refuse("field", "field_for_format",
                         "{where}.field is read for {where}.format 'jsonl' or 'parquet' only")
        if kind == "synthetic" and self.vocab_size is None:
            self.vocab_size = BYTE_VOCAB
        return self


class EvalDataSpec(DataSpec):
    """``eval.data``: every form and rule of ``data``; errors name ``eval.data.*``."""

    WHERE: ClassVar[str] = "eval.data"


MAX_EVAL_BATCHES = 10_000  # micro-batches per rank per evaluation


class EvalSpec(SpecModel):
    """Evaluation during training (docs/contracts.md, "Evaluation").

    After every ``every_steps`` steps, and after the last step, every rank runs ``batches``
    micro-batches (``train.micro_batch_size`` samples each) of ``data`` without gradients; the
    mean of their losses over every rank is the step's ``eval_loss``. Each evaluation reads the
    same samples (the dataset from its start), so evaluations are comparable with each other.
    """

    every_steps: int = Field(ge=1, le=MAX_INT32)
    batches: int = Field(default=8, ge=1, le=MAX_EVAL_BATCHES)
    data: EvalDataSpec

    def due(self, step: int, total_steps: int) -> bool:
        """Whether completed ``step`` (1-based) is evaluated."""
        return step % self.every_steps == 0 or step == total_steps
