"""The job spec (docs/contracts.md): what a user submits, validated once, read as attributes everywhere.

The control plane validates a submission into ``JobSpec`` and stores ``model_dump()``; the
workers validate the stored spec again at their boundary (``JobSpec.model_validate``) and read
attributes from then on, so every default lives here and nowhere else. Input models are strict
and forbid unknown fields: a typo in a spec is a 422 that names the field, never a silently
ignored setting. Depends on pydantic alone (the SDK imports it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from contract.presets import PRESETS
from contract.zero_math import (DEFAULT_BUCKET_MB, DEFAULT_PRECISION, DEFAULT_PREFETCH, OPTIMIZER_STATE_TENSORS,
                                PRECISIONS, STAGES)
from contract.zero_rules import OFFLOAD_OPTIMIZER, ZeroRuleBroken, check_nvme_path, check_stage_fields, shard_group_misfits

# --------------------------------------------------------------------------- job spec

SLUG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
FACTORY_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$"
STORAGE_SCHEMES = ("file://", "s3://")
MAX_GLOB_CHARS = 1024
MAX_FIELD_NAME_CHARS = 256  # a JSONL key or parquet column name (data.field, data.column, ...)
_GLOB_FORBIDDEN = re.compile(r"[\\\x00-\x1f\x7f]")  # backslashes and control characters
MAX_INT32 = 2**31 - 1  # integers are stored in 32-bit columns (and read by torch/numpy seeds)
MAX_INT64 = 2**63 - 1
MAX_JSON_DEPTH = 32  # dicts/lists inside one another in a free-form block (kwargs)
MAX_JSON_VALUES = 10_000  # values (containers and scalars) in one free-form block

def _bounded_json(value: dict[str, Any]) -> dict[str, Any]:
    """Free-form JSON (a factory's ``kwargs``) that can be stored and served back.

    [Note: why bound it at validation] Whatever is accepted here is stored and later serialized
    into every list page that shows the job; pydantic refuses to serialize deeper than ~255
    levels, PostgreSQL refuses NaN/Infinity in JSON, and a huge block costs every reader. A
    value refused now is one 422 naming the field; a value refused later is a page that 500s
    for everyone who can see the job. Checked iteratively: a hostile depth cannot exhaust the
    Python stack here.
    """
    pending: list[tuple[Any, int]] = [(value, 1)]
    seen = 0
    while pending:
        node, depth = pending.pop()
        seen += 1
        if seen > MAX_JSON_VALUES:
            raise PydanticCustomError("json_too_large", "holds more than {limit} values", {"limit": MAX_JSON_VALUES})
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise PydanticCustomError(
                    "json_too_deep", "is nested deeper than {limit} levels", {"limit": MAX_JSON_DEPTH})
            children = node.values() if isinstance(node, dict) else node
            pending.extend((child, depth + 1) for child in children)
        elif isinstance(node, float) and not math.isfinite(node):
            raise PydanticCustomError(
                "json_not_finite", "holds a non-finite number ({value}); JSON has none", {"value": repr(node)})
        elif not isinstance(node, (str, int, float, bool, type(None))):
            raise PydanticCustomError(
                "json_value", "holds a {kind}, which is not a JSON value", {"kind": type(node).__name__})
    return value


BoundedJson = Annotated[dict[str, Any], AfterValidator(_bounded_json)]
"""A factory's keyword arguments: any JSON object within ``MAX_JSON_DEPTH`` / ``MAX_JSON_VALUES``."""


class SpecModel(BaseModel):
    """Base of every input model: strict types, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _storage_uri(value: str) -> str:
    if not value.startswith(STORAGE_SCHEMES):
        raise PydanticCustomError(
            "uri_scheme", "must start with file:// or s3:// (got '{value}')", {"value": value}
        )
    return value


def _factory_path(value: str) -> str:
    if not re.match(FACTORY_PATTERN, value):
        raise PydanticCustomError(
            "factory_path", "must look like 'package.module:function' (got '{value}')", {"value": value}
        )
    return value


MAX_URI_CHARS = 2048


def _model_dir_uri(value: str) -> str:
    """A directory the workers read: ``file://``/``s3://``, or a plain absolute path (made ``file://``)."""
    if value.startswith("/"):
        value = f"file://{value}"
    if not value.startswith(STORAGE_SCHEMES):
        raise PydanticCustomError(
            "uri_scheme", "must be an absolute path or start with file:// or s3:// (got '{value}')", {"value": value})
    return value.rstrip("/")


class ModelSpec(SpecModel):
    """A built-in preset, a Hugging Face model directory (``hf``), or a user factory ``pkg.mod:fn``
    called with ``kwargs``: exactly one of the three.

    ``hf`` names a directory holding a Hugging Face ``config.json`` (and usually the tokenizer
    files): ``file://``, ``s3://``, or a plain absolute path the workers see (stored as
    ``file://``). The workers build the model with transformers' own code from that config.

    ``init_from`` (fine-tuning): a ``file://`` or ``s3://`` URI of safetensors weights -- one
    ``.safetensors`` file, or a directory with ``model.safetensors.index.json`` as Hugging Face
    and ``zerotrain ckpt consolidate`` write it -- whose names and shapes are the model's
    ``state_dict()``. The workers build the model on the meta device and every rank reads only
    the bytes it keeps; a job resuming from a checkpoint (its own, or ``resume_from``) loads
    that instead. The control plane refuses a URI the user may not read (the ``data.uri``
    rules) and, when it can read it, weights that do not fit a preset.
    """

    preset: str | None = None
    hf: str | None = Field(default=None, max_length=MAX_URI_CHARS)
    factory: str | None = None
    kwargs: BoundedJson = Field(default_factory=dict)
    init_from: str | None = Field(default=None, max_length=MAX_URI_CHARS)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in PRESETS:
            raise PydanticCustomError(
                "unknown_preset",
                "unknown preset '{value}'; choose one of {known}",
                {"value": value, "known": ", ".join(PRESETS)},
            )
        return value

    @field_validator("factory")
    @classmethod
    def _factory(cls, value: str | None) -> str | None:
        return None if value is None else _factory_path(value)

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, value: str | None) -> str | None:
        return None if value is None else _storage_uri(value)

    @field_validator("hf")
    @classmethod
    def _hf(cls, value: str | None) -> str | None:
        return None if value is None else _model_dir_uri(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelSpec":
        if sum(choice is not None for choice in (self.preset, self.hf, self.factory)) != 1:
            raise PydanticCustomError(
                "model_choice", "give exactly one of model.preset, model.hf or model.factory", {"field": "model"}
            )
        if self.factory is None and self.kwargs:
            raise PydanticCustomError(
                "model_kwargs", "model.kwargs applies to model.factory only", {"field": "model.kwargs"}
            )
        return self

    def architecture(self) -> dict[str, Any]:
        """What the model is, as a consolidated checkpoint's ``config.json`` says it: a preset's
        name and its ``GPTConfig`` fields, or the factory and its kwargs (not ``init_from``:
        where the weights came from is not what the model is)."""
        if self.preset is not None:
            return {"preset": self.preset, **dataclasses.asdict(PRESETS[self.preset])}
        if self.hf is not None:
            return {"hf": self.hf}
        return {"factory": self.factory, "kwargs": self.kwargs}


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
        return None if value is None else _storage_uri(value)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, value: str | None) -> str | None:
        """``"model"`` or a storage URI of a directory holding ``tokenizer.json`` (or of the file)."""
        return value if value in (None, MODEL_TOKENIZER) else _storage_uri(value)

    @field_validator("glob")
    @classmethod
    def _glob(cls, value: str) -> str:
        """A pattern relative to ``uri`` that cannot leave it (workers glob ``{uri}/{glob}``)."""
        if len(value) > MAX_GLOB_CHARS:
            problem = f"is longer than {MAX_GLOB_CHARS} characters"
        elif value.startswith("/"):
            problem = f"must be relative to {cls.WHERE}.uri, not an absolute path"
        elif (bad := _GLOB_FORBIDDEN.search(value)) is not None:
            problem = f"must not contain {bad.group()!r} (backslashes and control characters are refused)"
        elif ".." in value.split("/"):
            problem = f"must not contain a '..' segment (it must stay below {cls.WHERE}.uri)"
        else:
            return value
        raise PydanticCustomError("glob_pattern", "{problem}", {"problem": problem})

    @field_validator("factory")
    @classmethod
    def _factory(cls, value: str | None) -> str | None:
        return None if value is None else _factory_path(value)

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
            self.vocab_size = 256
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


OPTIMIZERS = tuple(OPTIMIZER_STATE_TENSORS)  # ("adamw", "adam", "sgd")
"""``train.optimizer``: torch.optim's element-wise optimizers the engine is tested with."""
SHAPE_AWARE_OPTIMIZERS = {
    "muon": "orthogonalizes each 2-D update matrix",
    "adafactor": "factors the second moment of each matrix into row and column statistics",
    "shampoo": "preconditions each matrix by its row and column covariances",
    "soap": "preconditions each matrix by its row and column covariances",
}
"""Refused by name: each looks at a parameter's shape, which the ZeRO engine's flat 1-D shards do
not have, so running it sharded would silently be another optimizer."""
ADAM_BETAS = (0.9, 0.95)  # adam/adamw without train.betas (what every job got before the field)
ADAM_EPS = 1e-8
SCHEDULES = ("cosine", "linear", "constant")
MIN_LR_RATIO = 0.1  # cosine and linear decay to this fraction of the peak LR
MAX_NO_DECAY_PATTERNS = 64
MAX_PATTERN_CHARS = 256


def _train_error(field: str, message: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError("train_optimizer", message, {**ctx, "field": f"train.{field}"})


class TrainSpec(SpecModel):
    """The optimization: steps and batch, the optimizer and its groups, the LR schedule.

    [Note: optimizer, weight decay, schedule]
    ``optimizer`` is one of ``OPTIMIZERS`` (torch.optim's AdamW, Adam, SGD); ``betas``/``eps``
    apply to adam/adamw (default ``ADAM_BETAS``, ``ADAM_EPS``), ``momentum``/``nesterov`` to sgd
    (default 0 / false); an option given for the other kind is a 422 naming it. Shape-aware
    optimizers (``SHAPE_AWARE_OPTIMIZERS``) are refused with the reason.

    ``weight_decay`` applies to every parameter except those with fewer than two dimensions
    (biases, LayerNorm/RMSNorm gains; ``no_decay_1d``, default true) and those whose name (as in
    ``model.named_parameters()``) matches one of the ``no_decay`` ``fnmatch`` patterns
    (e.g. ``"*wte*"``). This is nanoGPT's rule, and HF Trainer's in effect: decaying a norm's
    gain or a bias pulls it towards 0, which nothing in the model asks for. Embeddings stay
    decayed by default, as in nanoGPT and HF Trainer: in the tied GPT presets the embedding is
    also the output projection, a matrix like any other. Before these fields weight decay went
    to every parameter; with the default ``weight_decay`` (0.0) nothing changes.

    ``schedule``: after ``warmup_steps`` of linear warmup, ``cosine`` (the default, as before)
    and ``linear`` decay to ``MIN_LR_RATIO`` of ``lr`` at the last step; ``constant`` stays at
    ``lr``.
    """

    steps: int = Field(ge=1, le=MAX_INT32)
    global_batch_size: int = Field(ge=1, le=MAX_INT32)
    micro_batch_size: int = Field(ge=1, le=MAX_INT32)
    lr: float = Field(default=3e-4, gt=0)
    warmup_steps: int = Field(default=0, ge=0, le=MAX_INT32)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float | None = Field(default=1.0, gt=0, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, le=MAX_INT32)
    optimizer: str = "adamw"
    betas: list[float] | None = Field(default=None, min_length=2, max_length=2)
    eps: float | None = Field(default=None, gt=0)
    momentum: float | None = Field(default=None, ge=0, lt=1)
    nesterov: bool = False
    no_decay: list[str] = Field(default_factory=list, max_length=MAX_NO_DECAY_PATTERNS)
    no_decay_1d: bool = True
    schedule: Literal[SCHEDULES] = "cosine"

    @field_validator("optimizer")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        if value in OPTIMIZERS:
            return value
        if value.lower() in SHAPE_AWARE_OPTIMIZERS:
            raise PydanticCustomError(
                "shape_aware_optimizer",
                "'{value}' is not supported: it {why}, and the ZeRO engine hands the optimizer flat 1-D "
                "shards, so it would silently become another optimizer; choose one of {known}",
                {"value": value, "why": SHAPE_AWARE_OPTIMIZERS[value.lower()], "known": ", ".join(OPTIMIZERS)})
        raise PydanticCustomError("unknown_optimizer", "unknown optimizer '{value}'; choose one of {known}",
                                  {"value": value, "known": ", ".join(OPTIMIZERS)})

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not all(0 <= b < 1 for b in value):
            raise PydanticCustomError("betas", "each beta must be in [0, 1) (got {value})", {"value": value})
        return value

    @field_validator("no_decay")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not pattern or len(pattern) > MAX_PATTERN_CHARS or _GLOB_FORBIDDEN.search(pattern):
                raise PydanticCustomError(
                    "name_pattern", "each pattern must be 1 to {limit} characters without control characters or "
                    "backslashes (got '{value}')", {"limit": MAX_PATTERN_CHARS, "value": pattern})
        return value

    @model_validator(mode="after")
    def _options_of_optimizer(self) -> "TrainSpec":
        adam = self.optimizer in ("adam", "adamw")
        for name in ("betas", "eps"):
            if getattr(self, name) is not None and not adam:
                raise _train_error(name, "train.{name} applies to adam and adamw, not to '{optimizer}'",
                                   name=name, optimizer=self.optimizer)
        for name, given in (("momentum", self.momentum is not None), ("nesterov", self.nesterov)):
            if given and self.optimizer != "sgd":
                raise _train_error(name, "train.{name} applies to sgd, not to '{optimizer}'",
                                   name=name, optimizer=self.optimizer)
        if self.nesterov and not self.momentum:
            raise _train_error("nesterov", "train.nesterov needs train.momentum > 0")
        return self

    def optimizer_options(self) -> dict[str, Any]:
        """The torch optimizer's keyword arguments besides ``lr`` and ``weight_decay``, defaults filled."""
        if self.optimizer == "sgd":
            return {"momentum": self.momentum or 0.0, "nesterov": self.nesterov}
        return {"betas": tuple(self.betas or ADAM_BETAS), "eps": ADAM_EPS if self.eps is None else self.eps}


# [Note: one validator, a schema generators read] ``zero.stage`` is validated as one literal, so
# a bad value is one error naming ``zero.stage`` ("Input should be 0, 1, 2, 3 or 'auto'"), where
# a union would report one error per branch under made-up locations. Its published schema is
# the equivalent ``anyOf`` of an integer enum and a string enum: pydantic's own rendering, one
# ``enum`` mixing integers and a string, is a shape client generators (openapi-python-client
# among them) cannot type, and they drop every model and route that reaches it.
Stage = Annotated[Literal[STAGES + ("auto",)], WithJsonSchema({
    "anyOf": [{"type": "integer", "enum": list(STAGES)}, {"type": "string", "enum": ["auto"]}],
    "title": "Stage", "description": "ZeRO stage 0-3, or \"auto\": the planner picks one"})]


# One literal, so a bad value is one error naming zero.offload_optimizer; published as the
# equivalent anyOf (the note on zero.stage's schema above).
OffloadOptimizer = Annotated[Literal[OFFLOAD_OPTIMIZER], WithJsonSchema({
    "anyOf": [{"type": "boolean"}, {"type": "string", "enum": ["cpu", "nvme"]}],
    "title": "Offload Optimizer",
    "description": "false, true or \"cpu\" (host memory), or \"nvme\" (swap files under nvme_path)"})]


class ZeroSpec(SpecModel):
    """The ``zero`` block: the one definition of the engine's job-facing fields and their defaults.

    The engine's ``ZeroConfig`` takes these defaults and is built from this block
    (``ZeroConfig.from_spec``); the cross-field rules live in ``contract/zero_rules.py`` and are
    checked here (a 422 naming the field) and by ``ZeroConfig`` (``ValueError``) alike.
    """

    stage: Stage = "auto"
    precision: Literal[PRECISIONS] = DEFAULT_PRECISION
    # False, True or "cpu" (host memory), "nvme": the optimizer state in swap files under nvme_path
    # (workers/zero/optimizer_swap.py); stages 1-3
    offload_optimizer: OffloadOptimizer = False
    # with "nvme": an absolute folder on a fast local disk of every worker node; the job's files go
    # to nvme_path/<job id>/<rank>/ and are removed when it ends
    nvme_path: str | None = Field(default=None, min_length=1, max_length=MAX_URI_CHARS)
    bucket_mb: float = Field(default=DEFAULT_BUCKET_MB, gt=0, allow_inf_nan=False)
    prefetch: int = Field(default=DEFAULT_PREFETCH, ge=0, le=MAX_INT32)
    activation_checkpointing: bool = False
    # stage 3: free each unit's gathered parameters after its forward (true), keep them all
    # (false: 2Φ per step), or keep the last block unit only ("all_but_last", as torchtitan does)
    reshard_after_forward: bool | Literal["all_but_last"] = True
    # stage 3: keep units gathered from their forward to their backward while they fit this many
    # bytes per rank, oldest let go first (0: off); each kept unit saves its re-gather
    keep_gathered_bytes: int = Field(default=0, ge=0, le=2**50)
    # rank 0's buffers (BatchNorm running statistics) to every rank after each training forward,
    # as DDP does; false: each rank keeps its own (workers/zero/module_buffers.py)
    broadcast_buffers: bool = True
    # BatchNorm statistics over every rank's rows (workers/zero/sync_batchnorm.py)
    sync_batchnorm: bool = False
    # hybrid sharding (HSDP, stages 1-3): shard within groups of this many contiguous ranks (a
    # node) and replicate across the groups; null: the whole world. Must divide every world size
    # the job may run at (JobSpec checks it against resources). Stage 0 ignores it.
    shard_group_size: int | None = Field(default=None, ge=1, le=MAX_INT32)

    @model_validator(mode="after")
    def _rules(self) -> "ZeroSpec":
        try:
            check_stage_fields(self.stage, self.offload_optimizer, self.keep_gathered_bytes)
            check_nvme_path(self.offload_optimizer, self.nvme_path)
        except ZeroRuleBroken as broken:
            raise PydanticCustomError("zero_rule", "{message}", {"message": broken.message, "field": broken.field})
        return self


class ResourcesSpec(SpecModel):
    """The worker group: ``num_workers`` ranks of ``cpus/gpus_per_worker`` each.

    ``min_workers`` (default: ``num_workers``, i.e. not elastic) makes the job elastic: it is
    admitted once ``min_workers`` fit, and after a node is lost it goes on at the largest world
    size in ``[min_workers, num_workers]`` that the cluster holds, from its latest checkpoint
    (docs/contracts.md, "Elastic jobs"). ``JobSpec`` checks that every such size splits the
    global batch into whole micro-batches per rank.
    """

    num_workers: int = Field(default=1, ge=1, le=MAX_INT32)
    min_workers: int | None = Field(default=None, ge=1, le=MAX_INT32,
                                    description="the fewest workers the job runs with (elastic); "
                                                "default: num_workers (not elastic)")
    gpus_per_worker: float = Field(default=0, ge=0)
    cpus_per_worker: float = Field(default=1, gt=0)
    gpu_memory_gb: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _worker_range(self) -> ResourcesSpec:
        if self.min_workers is None:
            self.min_workers = self.num_workers
        elif self.min_workers > self.num_workers:
            raise PydanticCustomError(
                "min_workers", "resources.min_workers ({min_workers}) must be at most resources.num_workers "
                "({num_workers})", {"min_workers": self.min_workers, "num_workers": self.num_workers,
                                     "field": "resources.min_workers"})
        return self

    @property
    def elastic(self) -> bool:
        """Whether the worker group may run with fewer than ``num_workers`` ranks."""
        return self.min_workers < self.num_workers

    @property
    def world_sizes(self) -> range:
        """Every world size the job may train at, ``min_workers`` … ``num_workers``."""
        return range(self.min_workers, self.num_workers + 1)


class CheckpointSpec(SpecModel):
    every_steps: int = Field(default=50, ge=1, le=MAX_INT32)
    keep_last: int = Field(default=2, ge=1, le=MAX_INT32)
    uri: str | None = None

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        return None if value is None else _storage_uri(value)


class ResumeFrom(SpecModel):
    job_id: str = Field(pattern=SLUG_PATTERN)
    step: int | Literal["latest"] = "latest"

    @field_validator("step")
    @classmethod
    def _non_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise PydanticCustomError("step", "must be >= 0 or 'latest' (got {value})", {"value": value})
        return value


class RuntimeSpec(SpecModel):
    """Code shipped with the job (Ray's ``runtime_env``), for user factories ("pkg.mod:fn").

    A zip package: a remote one (``s3://``, ``gs://``, ``https://``), or one the service keeps
    for its owner (``{storage}/users/{owner}/code/{sha256}.zip``, what ``zerotrain submit``
    uploads for a local folder; service/code_packages.py). The service refuses a ``file://``
    zip that is not the caller's own upload: a path of the control plane's machine would ship
    whatever that machine holds to the cluster. A directory path is never a value here; the
    CLI turns one into an upload before it submits.
    """

    working_dir: str | None = Field(default=None, max_length=2048, pattern=r"^(s3|gs|https|file)://[^\s]+\.zip$",
                                    description="a zip package of the user's code: s3://, gs:// or https:// URI, "
                                                "or the URI of a package uploaded to this service")


# The smallest useful job, shown in the OpenAPI document as JobSpec's example (client
# generators, /docs, and a stateful API tester start from it); tests/service check it is valid.
EXAMPLE_SPEC: dict = {
    "name": "example", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 64},
    "train": {"steps": 20, "global_batch_size": 8, "micro_batch_size": 2}, "resources": {"num_workers": 2},
}


class JobSpec(SpecModel):
    """A training job as the user submits it."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [EXAMPLE_SPEC]})

    name: str = Field(pattern=SLUG_PATTERN)
    model: ModelSpec
    data: DataSpec
    train: TrainSpec
    zero: ZeroSpec = Field(default_factory=ZeroSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    max_failures: int = Field(default=2, ge=0, le=MAX_INT32)
    resume_from: ResumeFrom | None = None
    max_runtime_s: int | None = Field(default=None, ge=1, le=MAX_INT32)
    runtime: RuntimeSpec | None = None
    eval: EvalSpec | None = None

    def data_blocks(self) -> list[tuple[str, DataSpec]]:
        """Every dataset the workers read, with its place in the spec (``data``, ``eval.data``):
        a rule about what a job may read (its URI, its factory) applies to each of them."""
        blocks: list[tuple[str, DataSpec]] = [("data", self.data)]
        if self.eval is not None:
            blocks.append(("eval.data", self.eval.data))
        return blocks

    @model_validator(mode="after")
    def _batch_arithmetic(self) -> "JobSpec":
        gbs, mbs = self.train.global_batch_size, self.train.micro_batch_size
        workers = self.resources.num_workers
        per_step = mbs * workers
        if gbs % per_step:
            raise PydanticCustomError(
                "batch_arithmetic",
                "train.global_batch_size ({gbs}) must equal train.micro_batch_size ({mbs}) × "
                "accumulation_steps × resources.num_workers ({workers}) for a whole "
                "accumulation_steps ≥ 1, i.e. a multiple of {per_step}",
                {"gbs": gbs, "mbs": mbs, "workers": workers, "per_step": per_step,
                 "field": "train.global_batch_size"},
            )
        self._elastic_batch_arithmetic()
        self._shard_groups()
        preset = PRESETS.get(self.model.preset or "")
        context = None if preset is None else preset.context
        for where, data in self.data_blocks():
            if data.tokenizer == MODEL_TOKENIZER and self.model.hf is None:
                raise PydanticCustomError(
                    "tokenizer_without_hf",
                    "{where}.tokenizer 'model' names the tokenizer files in model.hf, and the model is not "
                    "model.hf: give the tokenizer's URI", {"where": where, "field": f"{where}.tokenizer"})
            if context is not None and data.seq_len is not None and data.seq_len > context:
                raise PydanticCustomError(
                    "seq_len_context",
                    "{where}.seq_len ({seq_len}) exceeds the context of preset '{preset}' ({context})",
                    {"where": where, "seq_len": data.seq_len, "preset": self.model.preset, "context": context,
                     "field": f"{where}.seq_len"},
                )
        return self

    def _elastic_batch_arithmetic(self) -> None:
        """Every world size an elastic job may shrink to keeps the global batch whole.

        [Note: the same global batch at every world size]
        An elastic job keeps ``train.global_batch_size`` when its world shrinks: each rank's
        accumulation steps grow (``ShardedBatchLoader``), so every optimizer step averages the
        same samples as the full-size run would. That needs whole micro-batches per rank at
        every size ``N`` in ``[min_workers, num_workers]``: ``global_batch_size % (micro_batch_size
        × N) == 0``. DeepSpeed's elasticity needs such a precomputed set of compatible sizes for
        the same reason; here the spec is refused at submit with the sizes that do not divide.
        """
        gbs, mbs, resources = self.train.global_batch_size, self.train.micro_batch_size, self.resources
        bad = [n for n in resources.world_sizes if gbs % (mbs * n)]
        if bad:
            good = [n for n in resources.world_sizes if n not in bad]  # num_workers at least (checked first)
            raise PydanticCustomError(
                "elastic_batch_arithmetic",
                "every world size from resources.min_workers ({min_workers}) to resources.num_workers "
                "({num_workers}) must split train.global_batch_size ({gbs}) into whole micro-batches of "
                "train.micro_batch_size ({mbs}) per rank, so that a resized job keeps the same global batch "
                "(as DeepSpeed's elasticity, which needs a precomputed set of compatible sizes for the same "
                "reason); {bad_list} ({good_text})",
                {"min_workers": resources.min_workers, "num_workers": resources.num_workers, "gbs": gbs,
                 "mbs": mbs, "bad_list": (f"world size {bad[0]} does not" if len(bad) == 1
                                          else f"world sizes {', '.join(map(str, bad))} do not"),
                 "good_text": f"these do: {', '.join(map(str, good))}",
                 "incompatible": bad, "field": "resources.min_workers"})

    def _shard_groups(self) -> None:
        """``zero.shard_group_size`` splits every world the job may run at into whole groups."""
        g, resources = self.zero.shard_group_size, self.resources
        bad = shard_group_misfits(g, resources.world_sizes)
        if bad:
            raise PydanticCustomError(
                "shard_group_size",
                "zero.shard_group_size ({g}) must divide resources.num_workers ({num_workers}){elastic}: "
                "the ranks are split into shard groups of {g} contiguous ranks; world size {bad_list}",
                {"g": g, "num_workers": resources.num_workers,
                 "elastic": (f" and every world size down to resources.min_workers ({resources.min_workers})"
                             if resources.elastic else ""),
                 "bad_list": ", ".join(map(str, bad)) + (" does not" if len(bad) == 1 else " do not"),
                 "incompatible": bad, "field": "zero.shard_group_size"})

    @property
    def accumulation_steps(self) -> int:
        return self.accumulation_steps_at(self.resources.num_workers)

    def accumulation_steps_at(self, world_size: int) -> int:
        """Micro-batches per rank and step at ``world_size`` ranks (an elastic job's grow as it shrinks)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * world_size)

    @property
    def tokens_per_step(self) -> int | None:
        seq_len = self.data.seq_len
        return None if seq_len is None else seq_len * self.train.global_batch_size
