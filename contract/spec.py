"""The job spec (docs/contracts.md): what a user submits, validated once, read as attributes everywhere.

The control plane validates a submission into ``JobSpec`` and stores ``model_dump()``; the
workers validate the stored spec again at their boundary (``JobSpec.model_validate``) and read
attributes from then on, so every default lives here and nowhere else. Input models are strict
and forbid unknown fields: a typo in a spec is a 422 that names the field, never a silently
ignored setting. Depends on pydantic alone (the SDK imports it).

Parts live in modules of their own and are re-exported here: the base model, limits and field
checks (``contract.spec_base``), the ``model`` block (``contract.spec_model``), the ``data`` and
``eval`` blocks (``contract.spec_data``), the ``resources`` block (``contract.spec_resources``).
This module holds the rest and ``JobSpec``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from contract.presets import PRESETS
# the blocks and limits that live in their own modules, re-exported: callers import every part of
# the spec from here
from contract.spec_base import (  # noqa: F401
    BACKSLASH_OR_CONTROL,
    FACTORY_PATTERN,
    MAX_INT32,
    MAX_INT64,
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    MAX_URI_CHARS,
    SLUG_PATTERN,
    STORAGE_SCHEMES,
    BoundedJson,
    SpecModel,
    check_storage_uri,
)
from contract.spec_data import (  # noqa: F401
    DATA_FORMATS,
    MAX_FIELD_NAME_CHARS,
    MAX_GLOB_CHARS,
    MODEL_TOKENIZER,
    TOKEN_DTYPES,
    DataSpec,
    EvalDataSpec,
    EvalSpec,
)
from contract.spec_model import ModelSpec
from contract.spec_resources import ResourcesSpec
from contract.zero_math import (DEFAULT_BUCKET_MB, DEFAULT_PRECISION, DEFAULT_PREFETCH, OPTIMIZER_STATE_TENSORS,
                                PRECISIONS, STAGES)
from contract import deepspeed as deepspeed_config
from contract.zero_rules import (OFFLOAD_OPTIMIZER, OFFLOAD_PARAMS, ZeroRuleBroken, check_nvme_path,
                                 check_hpz_groups, check_stage_fields, hpz_misfits,
                                 shard_group_misfits)

# --------------------------------------------------------------------------- job spec

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
ADAM_BETAS = (0.9, 0.95)  # adam/adamw without train.betas
ADAM_EPS = 1e-8
SCHEDULES = ("cosine", "linear", "constant")
MIN_LR_RATIO = 0.1  # cosine and linear decay to this fraction of the peak LR (train.min_lr_ratio's default)
WARMUP_TYPES = ("linear", "log")
MAX_NO_DECAY_PATTERNS = 64
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000  # a job's priority; 0 by default
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
    also the output projection, a matrix like any other. With the default ``weight_decay``
    (0.0) the rules change nothing.

    ``schedule``: after ``warmup_steps`` of warmup, ``cosine`` (the default) and
    ``linear`` decay to ``min_lr_ratio`` (default ``MIN_LR_RATIO``) of ``lr`` at the last step;
    ``constant`` stays at ``lr``. ``warmup_type``: ``linear`` (step ``s`` at ``lr·(s+1)/W``) or
    ``log`` (DeepSpeed's WarmupLR default: ``lr·log(s+1)/log(W)``, 0 at the first step).
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
    warmup_type: Literal[WARMUP_TYPES] = "linear"
    min_lr_ratio: float = Field(default=MIN_LR_RATIO, ge=0, le=1)

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
            if not pattern or len(pattern) > MAX_PATTERN_CHARS or BACKSLASH_OR_CONTROL.search(pattern):
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


# One literal, published as null or a string enum (the note on zero.stage's schema above).
OffloadParams = Annotated[Literal[OFFLOAD_PARAMS], WithJsonSchema({
    "anyOf": [{"type": "null"}, {"type": "string", "enum": ["cpu", "nvme"]}],
    "title": "Offload Params", "description": "null (in memory), \"cpu\" (host memory) or \"nvme\" (swap files)"})]


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
    # stage 3: each rank's parameter shard kept off the device, read just before each gather:
    # null (in memory), "cpu" (host memory) or "nvme" (swap files under nvme_path)
    offload_params: OffloadParams = None
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
    # ZeRO++ (stage 3, workers/zero/quantized_comm.py): the parameter all-gather sends blockwise
    # int8 and fp32 scales instead of the compute dtype (qwZ); the masters are never quantized
    quantized_weights: bool = False
    # ZeRO++ (stage 3): the gradient reduce-scatter sends blockwise int4 through an all-to-all and
    # reduces in fp32 (qgZ, the one-level variant)
    quantized_gradients: bool = False
    # ZeRO++ hpZ (stage 3, workers/zero/hpz.py): after a unit's forward gather each rank keeps its
    # part of the unit's parameters over a group of this many contiguous ranks (a node), so the
    # backward gather stays inside the group; must divide every world size (and shard_group_size)
    hpz_partition_size: int | None = Field(default=None, ge=1, le=MAX_INT32)

    @field_validator("stage", "offload_optimizer", mode="before")
    @classmethod
    def _exact_kind(cls, value: Any, info: Any) -> Any:
        """A literal matches by equality, so ``True`` would pass as stage 1 and ``1`` as ``True``:
        a stage is an integer (not a bool), an offload a bool or a name, as ``ZeroConfig`` takes them."""
        stage = info.field_name == "stage"
        if isinstance(value, float) or (isinstance(value, bool) if stage else isinstance(value, int) and value is not True
                                         and value is not False):
            expected = "0, 1, 2, 3 or 'auto'" if stage else "false, true, 'cpu' or 'nvme'"
            raise PydanticCustomError("zero_kind", "zero.{name} must be {expected}, not {shown}",
                                      {"name": info.field_name, "expected": expected, "shown": repr(value)})
        return value

    @model_validator(mode="after")
    def _rules(self) -> "ZeroSpec":
        try:
            check_stage_fields(self.stage, self.offload_optimizer, self.keep_gathered_bytes, self.offload_params,
                               quantized_weights=self.quantized_weights,
                               quantized_gradients=self.quantized_gradients,
                               hpz_partition_size=self.hpz_partition_size)
            check_nvme_path(self.offload_optimizer, self.nvme_path, self.offload_params, self.stage)
            check_hpz_groups(self.hpz_partition_size, self.shard_group_size)
        except ZeroRuleBroken as broken:
            raise PydanticCustomError("zero_rule", "{message}", {"message": broken.message, "field": broken.field})
        return self


class CheckpointSpec(SpecModel):
    every_steps: int = Field(default=50, ge=1, le=MAX_INT32)
    keep_last: int = Field(default=2, ge=1, le=MAX_INT32)
    uri: str | None = None

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        return None if value is None else check_storage_uri(value)


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
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description=(
        "higher starts first; equal priorities start in submission order. Above the service's "
        "max_user_priority only admins may submit"))
    team: str | None = Field(default=None, pattern=SLUG_PATTERN, description=(
        "the team the job belongs to: its members see it, its maintainers may cancel it; "
        "submitting needs the member role (docs/contracts.md, Teams)"))
    preemptible: bool = Field(default=True, description=(
        "whether a higher-priority job may stop this one at a checkpoint boundary to take its "
        "workers (it then queues again and resumes from that checkpoint); false: admins only"))
    resume_from: ResumeFrom | None = None
    max_runtime_s: int | None = Field(default=None, ge=1, le=MAX_INT32)
    runtime: RuntimeSpec | None = None
    eval: EvalSpec | None = None
    # a DeepSpeed config (ds_config.json) read as the fields above before they are validated
    # (contract/deepspeed.py); always null once validated: the stored spec holds what it became
    deepspeed: dict[str, Any] | None = Field(default=None, description=(
        "A DeepSpeed config, mapped onto train/zero fields at submit (docs/contracts.md, DeepSpeed configs)"))

    # what the deepspeed block left aside ("ignored: ..."), for the job's events; not a field
    _deepspeed_notes: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _from_deepspeed(cls, data: Any, handler: Any) -> "JobSpec":
        notes: list[str] = []
        if isinstance(data, dict) and data.get("deepspeed") is not None:
            try:
                data, notes = deepspeed_config.apply(data)
            except deepspeed_config.DeepSpeedConfigError as refused:
                raise PydanticCustomError("deepspeed", "{message}",
                                          {"message": refused.message, "field": refused.path}) from None
        spec = handler(data)
        spec._deepspeed_notes = notes
        return spec

    @property
    def deepspeed_notes(self) -> list[str]:
        """What the submitted ``deepspeed`` block left aside (empty without one, or once stored)."""
        return list(self._deepspeed_notes)

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
        """``zero.shard_group_size`` and ``zero.hpz_partition_size`` split every world the job may run
        at into whole groups."""
        resources = self.resources
        for field, misfits, why in (
                ("shard_group_size", shard_group_misfits,
                 "the ranks are split into shard groups of {g} contiguous ranks"),
                ("hpz_partition_size", hpz_misfits,
                 "hpZ keeps a secondary partition over groups of {g} contiguous ranks")):
            g = getattr(self.zero, field)
            bad = misfits(g, resources.world_sizes)
            if bad:
                raise PydanticCustomError(
                    field,
                    f"zero.{field} ({{g}}) must divide resources.num_workers ({{num_workers}}){{elastic}}: "
                    f"{why}; world size {{bad_list}}",
                    {"g": g, "num_workers": resources.num_workers,
                     "elastic": (f" and every world size down to resources.min_workers ({resources.min_workers})"
                                 if resources.elastic else ""),
                     "bad_list": ", ".join(map(str, bad)) + (" does not" if len(bad) == 1 else " do not"),
                     "incompatible": bad, "field": f"zero.{field}"})

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
