"""A DeepSpeed config (``ds_config.json``) read as zerotrain's job spec fields.

``translate(ds, spec)`` maps the keys DeepSpeed users write onto ``train``, ``zero`` and their
neighbours, as HF Trainer reads the same file (docs/contracts.md has the table):

* batch: ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps`` (checked against ``resources.num_workers``);
* ``gradient_clipping``; ``bf16.enabled`` / ``fp16.enabled`` (dynamic loss scaling from 2**16);
* ``zero_optimization``: ``stage``, ``offload_optimizer.{device, nvme_path}``, ZeRO++'s
  ``zero_quantized_weights``, ``zero_quantized_gradients`` and ``zero_hpz_partition_size``;
* ``optimizer.{type: Adam | AdamW | SGD, params}`` (DeepSpeed's ``Adam`` is AdamW unless
  ``adam_w_mode: false``, as its FusedAdam and CPUAdam are);
* ``scheduler.{type: WarmupLR | WarmupDecayLR | WarmupCosineLR, params}`` onto ``lr``,
  ``warmup_steps``, ``warmup_type``, ``schedule`` and ``min_lr_ratio``;
* ``activation_checkpointing`` (its presence turns on ``zero.activation_checkpointing``).

[Note: what is refused, ignored or resolved]
A value of ``"auto"`` is left to the rest of the spec (its own field, or the default), as HF
Trainer fills it from its arguments. A key zerotrain does not know, or a value it cannot
honour (a static loss scale, parameter offload, a scheduler's floor it has no field for), is a
``DeepSpeedConfigError`` naming ``deepspeed.<path>`` and why; so is a mapped value that differs
from a field the spec sets itself (a field the spec sets to ``"auto"`` counts as unset). Keys that only tune DeepSpeed's own machinery (bucket
sizes, ``overlap_comm``, ``contiguous_gradients``, pinned buffers, monitors) are accepted and
listed in ``notes`` as "ignored: ...", for the job's events. The result is plain spec fields:
the stored spec shows what the block became.

Stdlib only: the control plane, the CLI and the SDK read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

AUTO = "auto"
# DeepSpeed's own defaults where they differ from ours and the key is absent (docs.deepspeed.ai)
DS_WARMUP_TYPE = "log"
DS_WARMUP_MAX_LR = 0.001
DS_WARMUP_NUM_STEPS = 1000
DS_COS_MIN_RATIO = 0.0001
DYNAMIC_SCALE_POWER = 16  # zerotrain's dynamic loss scale starts at 2**16 (ZeroConfig.initial_loss_scale)

#: keys that only tune DeepSpeed's machinery; zerotrain sizes or does these itself
IGNORED_TOP = {
    "steps_per_print": "zerotrain reports every step", "wall_clock_breakdown": "zerotrain reports its step times",
    "zero_allow_untested_optimizer": "the optimizer list is checked by the spec", "dump_state": "no effect here",
    "tensorboard": "zerotrain keeps its own metrics", "wandb": "zerotrain keeps its own metrics",
    "csv_monitor": "zerotrain keeps its own metrics", "comms_logger": "zerotrain counts its own communication",
    "flops_profiler": "zerotrain reports TFLOP/s and MFU", "prescale_gradients": "gradients are averaged once",
    "gradient_predivide_factor": "gradients are averaged once", "memory_breakdown": "see the job's memory report",
}
IGNORED_ZERO = {
    "reduce_bucket_size": "zerotrain sizes its buckets with zero.bucket_mb",
    "allgather_bucket_size": "zerotrain sizes its buckets with zero.bucket_mb",
    "overlap_comm": "zerotrain always overlaps communication with backward",
    "contiguous_gradients": "zerotrain's gradients are always contiguous",
    "reduce_scatter": "zerotrain reduce-scatters at stages 2-3", "allgather_partitions": "no effect here",
    "round_robin_gradients": "no effect here", "sub_group_size": "zerotrain steps the optimizer bucket by bucket",
    "stage3_prefetch_bucket_size": "zerotrain prefetches whole units (zero.prefetch)",
    "stage3_param_persistence_threshold": "zerotrain gathers whole units",
    "stage3_max_live_parameters": "zerotrain frees each unit after use (zero.reshard_after_forward)",
    "stage3_max_reuse_distance": "use zero.keep_gathered_bytes",
    "stage3_gather_16bit_weights_on_model_save": "use zerotrain ckpt consolidate",
    "elastic_checkpoint": "zerotrain checkpoints reshard at any world size",
    "load_from_fp32_weights": "zerotrain checkpoints hold fp32 weights",
    "ignore_unused_parameters": "zerotrain handles unused parameters",
}
IGNORED_OFFLOAD = {"pin_memory": "zerotrain pins what it copies", "buffer_count": "zerotrain keeps three buffers",
                   "buffer_size": "zerotrain sizes its buffers by bucket", "fast_init": "no effect here",
                   "max_in_cpu": "no effect here"}
NOT_BUILT_ZERO = {"mics_shard_size": "MiCS"}
#: ZeRO++'s DeepSpeed keys and the zero fields they set (``zero_hpz_partition_size`` 1, DeepSpeed's
#: default, is hpZ off: null)
ZEROPP_KEYS = {"zero_quantized_weights": "quantized_weights", "zero_quantized_gradients": "quantized_gradients"}
#: fp16 keys of DeepSpeed's dynamic loss scaler that zerotrain's scaler does its own way
FP16_NOT_HONOURED = {
    "loss_scale_window": "zerotrain doubles the scale after 2000 steps without overflow",
    "hysteresis": "zerotrain halves the scale at every overflow", "consecutive_hysteresis": "no hysteresis here",
    "min_loss_scale": "zerotrain's scale has no floor", "auto_cast": "inputs are cast to the compute dtype"}
OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd"}
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config key zerotrain cannot take: ``path`` (``deepspeed.zero_optimization.stage``) and why."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path, self.message = path, message


@dataclass
class Translation:
    """The spec fields a DeepSpeed config sets (``{"train": {...}, "zero": {...}}``) and its notes."""

    fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    origins: dict[tuple[str, str], str] = field(default_factory=dict)  # the DeepSpeed key behind each field

    def set(self, section: str, name: str, value: Any, origin: str) -> None:
        self.fields.setdefault(section, {})[name] = value
        self.origins[(section, name)] = origin


def translate(ds: Any, spec: dict[str, Any]) -> Translation:
    """The fields ``ds`` sets on the job spec ``spec`` (without its ``deepspeed`` block), or
    ``DeepSpeedConfigError``; conflicts with what ``spec`` sets itself are errors too."""
    reader = _Reader(ds, "deepspeed")
    out = Translation()
    _batch(reader, spec, out)
    if (clip := reader.value("gradient_clipping", _number)) is not None:
        out.set("train", "grad_clip", None if clip == 0 else clip, reader.path("gradient_clipping"))  # DeepSpeed's 0: no clipping
    _precision(reader, out)
    if (zero := reader.block("zero_optimization")) is not None:
        _zero(zero, out)
    if (optimizer := reader.block("optimizer")) is not None:
        _optimizer(optimizer, out)
    if (scheduler := reader.block("scheduler")) is not None:
        _scheduler(scheduler, spec, out)
    if (checkpointing := reader.block("activation_checkpointing")) is not None:
        if checkpointing.value("cpu_checkpointing", _bool):
            raise DeepSpeedConfigError(checkpointing.path("cpu_checkpointing"),
                                       "activations checkpointed to host memory are not built; leave it false")
        for key in checkpointing.rest():
            out.notes.append(f"ignored: {checkpointing.path(key)} (zerotrain recomputes each unit's activations)")
        out.set("zero", "activation_checkpointing", True, reader.path("activation_checkpointing"))
    for key in reader.rest():
        if key not in IGNORED_TOP:
            raise DeepSpeedConfigError(reader.path(key), f"not a DeepSpeed key zerotrain reads; it reads "
                                                         f"{sorted(_KNOWN_TOP)} and ignores {sorted(IGNORED_TOP)}")
        out.notes.append(f"ignored: {reader.path(key)} ({IGNORED_TOP[key]})")
    _check_conflicts(out, spec)
    return out


def apply(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``spec`` with its ``deepspeed`` block (if any) replaced by the fields it sets, and the notes."""
    rest = {k: v for k, v in spec.items() if k != "deepspeed"}
    if spec.get("deepspeed") is None:
        return rest, []
    translation = translate(spec["deepspeed"], rest)
    for section, values in translation.fields.items():
        rest[section] = {**(rest.get(section) or {}), **values}
    return rest, translation.notes


# ----------------------------------------------------------------------------- the parts

_KNOWN_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "gradient_clipping", "bf16", "fp16", "zero_optimization", "optimizer", "scheduler",
              "activation_checkpointing"}


def _batch(reader: _Reader, spec: dict[str, Any], out: Translation) -> None:
    total = reader.value("train_batch_size", _positive_int)
    micro = reader.value("train_micro_batch_size_per_gpu", _positive_int)
    accumulation = reader.value("gradient_accumulation_steps", _positive_int)
    workers = ((spec.get("resources") or {}).get("num_workers")) or 1
    train = spec.get("train") or {}
    micro_known = micro if micro is not None else train.get("micro_batch_size")
    if total is None and accumulation is not None and micro_known is not None:
        total = micro_known * accumulation * workers
    if total is not None and accumulation is not None and micro_known is not None \
            and total != micro_known * accumulation * workers:
        raise DeepSpeedConfigError(reader.path("gradient_accumulation_steps"),
                                   f"train_batch_size {total} is not micro-batch {micro_known} x {accumulation} "
                                   f"accumulation steps x {workers} workers (resources.num_workers)")
    if total is not None:
        out.set("train", "global_batch_size", total, reader.path("train_batch_size"))
    if micro is not None:
        out.set("train", "micro_batch_size", micro, reader.path("train_micro_batch_size_per_gpu"))


def _precision(reader: _Reader, out: Translation) -> None:
    bf16 = reader.block("bf16")
    fp16 = reader.block("fp16")
    bf16_on = bf16 is not None and bf16.value("enabled", _bool)
    fp16_on = fp16 is not None and fp16.value("enabled", _bool)
    if bf16_on and fp16_on:
        raise DeepSpeedConfigError("deepspeed.fp16.enabled", "bf16 and fp16 cannot both be enabled")
    if bf16 is not None:
        for key in bf16.rest():
            out.notes.append(f"ignored: {bf16.path(key)} (bf16 needs no loss scaling)")
    if fp16 is not None:
        if (scale := fp16.value("loss_scale", _number)) not in (None, 0):
            raise DeepSpeedConfigError(fp16.path("loss_scale"), f"a static loss scale ({scale}) is not built; "
                                                                "zerotrain scales dynamically (loss_scale 0)")
        if (power := fp16.value("initial_scale_power", _positive_int)) not in (None, DYNAMIC_SCALE_POWER):
            raise DeepSpeedConfigError(fp16.path("initial_scale_power"),
                                       f"zerotrain's dynamic scale starts at 2**{DYNAMIC_SCALE_POWER}; got {power}")
        for key in fp16.rest():
            if key not in FP16_NOT_HONOURED:
                raise DeepSpeedConfigError(fp16.path(key), "not an fp16 key zerotrain reads")
            out.notes.append(f"not honoured: {fp16.path(key)} ({FP16_NOT_HONOURED[key]})")
    if bf16_on or fp16_on:
        out.set("zero", "precision", "bf16" if bf16_on else "fp16", f"deepspeed.{'bf16' if bf16_on else 'fp16'}.enabled")
    elif any(block is not None and block.obj.get("enabled") is False for block in (bf16, fp16)):
        out.set("zero", "precision", "fp32", "deepspeed.bf16.enabled" if bf16 is not None else "deepspeed.fp16.enabled")


def _offload(block: _Reader, name: str, off: Any, out: Translation) -> None:
    """An ``offload_optimizer`` or ``offload_param`` block: its ``device`` to ``zero.<name>`` ("none"
    is ``off``), its ``nvme_path`` to ``zero.nvme_path``, which both share (one folder of swap files)."""
    device = block.value("device", _choice("none", "cpu", "nvme"))
    if device is not None:
        out.set("zero", name, off if device == "none" else device, block.path("device"))
    if (path := block.value("nvme_path", _str)) is None:
        return
    if device != "nvme":
        out.notes.append(f"ignored: {block.path('nvme_path')} (read with device 'nvme' only)")
    elif out.fields.get("zero", {}).get("nvme_path", path) != path:
        raise DeepSpeedConfigError(block.path("nvme_path"), "zerotrain keeps every swap file in one folder: "
                                                            "give the optimizer's nvme_path")
    else:
        out.set("zero", "nvme_path", path, block.path("nvme_path"))


def _zero(zero: _Reader, out: Translation) -> None:
    if (stage := zero.value("stage", _int)) is not None:
        if stage not in (0, 1, 2, 3):
            raise DeepSpeedConfigError(zero.path("stage"), f"ZeRO stage must be 0, 1, 2 or 3; got {stage}")
        out.set("zero", "stage", stage, zero.path("stage"))
    if zero.value("cpu_offload", _bool):  # DeepSpeed's older spelling of offload_optimizer.device: cpu
        out.set("zero", "offload_optimizer", "cpu", zero.path("cpu_offload"))
    if (optimizer := zero.block("offload_optimizer")) is not None:
        _offload(optimizer, "offload_optimizer", False, out)
        if optimizer.value("ratio", _number) not in (None, 1, 1.0):
            raise DeepSpeedConfigError(optimizer.path("ratio"), "a partial optimizer offload is not built; "
                                                                "zerotrain offloads every bucket (ratio 1)")
        _ignore_rest(optimizer, IGNORED_OFFLOAD, out)
    if (params := zero.block("offload_param")) is not None:
        _offload(params, "offload_params", None, out)
        _ignore_rest(params, IGNORED_OFFLOAD, out)
    for key, name in ZEROPP_KEYS.items():
        if (on := zero.value(key, _bool)) is not None:
            out.set("zero", name, on, zero.path(key))
    if (hpz := zero.value("zero_hpz_partition_size", _positive_int)) is not None and hpz != 1:
        out.set("zero", "hpz_partition_size", hpz, zero.path("zero_hpz_partition_size"))
    for key in zero.rest():
        if key in NOT_BUILT_ZERO:
            raise DeepSpeedConfigError(zero.path(key), f"{NOT_BUILT_ZERO[key]} is not built")
        if key not in IGNORED_ZERO:
            raise DeepSpeedConfigError(zero.path(key), "not a zero_optimization key zerotrain reads")
        out.notes.append(f"ignored: {zero.path(key)} ({IGNORED_ZERO[key]})")


def _optimizer(optimizer: _Reader, out: Translation) -> None:
    kind = optimizer.value("type", _str)
    if kind is None or kind.lower() not in OPTIMIZERS:
        raise DeepSpeedConfigError(optimizer.path("type"), f"one of Adam, AdamW or SGD; got {kind!r}")
    kind = OPTIMIZERS[kind.lower()]
    params = optimizer.block("params")
    if params is None:
        out.set("train", "optimizer", kind, optimizer.path("type"))
        return
    if kind == "adam" and params.value("adam_w_mode", _bool) is not False:
        kind = "adamw"  # DeepSpeed's Adam decouples weight decay unless adam_w_mode is false
    out.set("train", "optimizer", kind, optimizer.path("type"))
    for name, reader in (("lr", _positive), ("weight_decay", _number), ("eps", _positive),
                         ("momentum", _number), ("nesterov", _bool)):
        if (value := params.value(name, reader)) is not None:
            out.set("train", name, value, params.path(name))
    if (betas := params.value("betas", _pair)) is not None:
        out.set("train", "betas", betas, params.path("betas"))
    if params.value("amsgrad", _bool):
        raise DeepSpeedConfigError(params.path("amsgrad"), "AMSGrad is not among zerotrain's optimizers")
    if params.value("dampening", _number) not in (None, 0):
        raise DeepSpeedConfigError(params.path("dampening"), "SGD dampening is not a zerotrain field; leave it 0")
    params.value("torch_adam", _bool)  # which kernel DeepSpeed picks: the math is torch's here
    for key in params.rest():
        raise DeepSpeedConfigError(params.path(key), f"not a {kind} parameter zerotrain reads")


def _scheduler(scheduler: _Reader, spec: dict[str, Any], out: Translation) -> None:
    kind = scheduler.value("type", _str)
    if kind not in SCHEDULERS:
        raise DeepSpeedConfigError(scheduler.path("type"), f"one of {', '.join(SCHEDULERS)}; got {kind!r}")
    params = scheduler.block("params") or _Reader({}, scheduler.path("params"))
    warmup = params.value("warmup_num_steps", _int)
    out.set("train", "warmup_steps", DS_WARMUP_NUM_STEPS if warmup is None else warmup, params.path("warmup_num_steps"))
    out.set("train", "warmup_type", params.value("warmup_type", _choice("log", "linear")) or DS_WARMUP_TYPE,
            params.path("warmup_type"))
    if kind in ("WarmupLR", "WarmupDecayLR"):
        if params.value("warmup_min_lr", _number) not in (None, 0):
            raise DeepSpeedConfigError(params.path("warmup_min_lr"), "zerotrain warms up from 0; leave it 0")
        max_lr = params.value("warmup_max_lr", _positive)
        out.set("train", "lr", DS_WARMUP_MAX_LR if max_lr is None else max_lr, params.path("warmup_max_lr"))
    if kind == "WarmupLR":
        out.set("train", "schedule", "constant", scheduler.path("type"))
    else:
        steps = params.value("total_num_steps", _positive_int)
        train_steps = (spec.get("train") or {}).get("steps")
        if steps is not None and train_steps is not None and steps != train_steps:
            raise DeepSpeedConfigError(params.path("total_num_steps"), f"zerotrain decays over train.steps "
                                                                       f"({train_steps}); got {steps}")
        if kind == "WarmupDecayLR":
            out.set("train", "schedule", "linear", scheduler.path("type"))
            out.set("train", "min_lr_ratio", 0.0, scheduler.path("type"))
        else:
            if params.value("warmup_min_ratio", _number) not in (None, 0):
                raise DeepSpeedConfigError(params.path("warmup_min_ratio"), "zerotrain warms up from 0; leave it 0")
            ratio = params.value("cos_min_ratio", _number)
            out.set("train", "schedule", "cosine", scheduler.path("type"))
            out.set("train", "min_lr_ratio", DS_COS_MIN_RATIO if ratio is None else ratio, params.path("cos_min_ratio"))
    for key in params.rest():
        raise DeepSpeedConfigError(params.path(key), f"not a {kind} parameter zerotrain reads")


def _ignore_rest(reader: _Reader, known: dict[str, str], out: Translation) -> None:
    for key in reader.rest():
        if key not in known:
            raise DeepSpeedConfigError(reader.path(key), "not a key zerotrain reads here")
        out.notes.append(f"ignored: {reader.path(key)} ({known[key]})")


def _check_conflicts(out: Translation, spec: dict[str, Any]) -> None:
    for section, values in out.fields.items():
        given = spec.get(section) or {}
        for name, value in values.items():
            if name in given and given[name] not in (value, AUTO) and not (_is_number(value) and _is_number(given[name])
                                                               and float(value) == float(given[name])):
                raise DeepSpeedConfigError(out.origins[(section, name)],
                                           f"sets {section}.{name} to {value!r}, but the spec sets it to "
                                           f"{given[name]!r}; give it in one place")


# ----------------------------------------------------------------------------- reading values


class _Reader:
    """One object of the config: each key read once by ``value``/``block``; ``rest`` is what was not."""

    def __init__(self, obj: Any, where: str):
        if not isinstance(obj, dict):
            raise DeepSpeedConfigError(where, f"must be an object; got {type(obj).__name__}")
        self.obj, self.where, self.read = obj, where, set()

    def path(self, key: str) -> str:
        return f"{self.where}.{key}"

    def value(self, key: str, check: Callable[[str, Any], Any]) -> Any:
        """The value at ``key`` checked by ``check``, or None when absent or ``"auto"``."""
        self.read.add(key)
        value = self.obj.get(key)
        return None if value is None or value == AUTO else check(self.path(key), value)

    def block(self, key: str) -> _Reader | None:
        self.read.add(key)
        return None if self.obj.get(key) is None else _Reader(self.obj[key], self.path(key))

    def rest(self) -> list[str]:
        return sorted(k for k in self.obj if k not in self.read)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(path: str, value: Any) -> float:
    if not _is_number(value) or value != value or value in (float("inf"), float("-inf")):
        raise DeepSpeedConfigError(path, f"must be a finite number; got {value!r}")
    return value


def _positive(path: str, value: Any) -> float:
    if _number(path, value) <= 0:
        raise DeepSpeedConfigError(path, f"must be positive; got {value!r}")
    return value


def _int(path: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise DeepSpeedConfigError(path, f"must be an integer; got {value!r}")
    return value


def _positive_int(path: str, value: Any) -> int:
    if _int(path, value) < 1:
        raise DeepSpeedConfigError(path, f"must be at least 1; got {value!r}")
    return value


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise DeepSpeedConfigError(path, f"must be true or false; got {value!r}")
    return value


def _str(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise DeepSpeedConfigError(path, f"must be a non-empty string; got {value!r}")
    return value


def _pair(path: str, value: Any) -> list[float]:
    if not isinstance(value, list) or len(value) != 2 or not all(_is_number(v) for v in value):
        raise DeepSpeedConfigError(path, f"must be two numbers; got {value!r}")
    return list(value)


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def check(path: str, value: Any) -> str:
        if value not in allowed:
            raise DeepSpeedConfigError(path, f"must be one of {', '.join(allowed)}; got {value!r}")
        return value
    return check
