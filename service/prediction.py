"""The memory planner at submit time: every job records its prediction; "auto" is resolved here.

Why at submit: a job whose model cannot fit must be refused before it waits in a queue (a 422
with the numbers), and the rule "use the lowest ZeRO stage that fits" needs the prediction
anyway. The chosen stage (and offload) is written into the stored spec, so the workers, the
dashboard and the user all see what actually runs; the prediction says that "auto" chose it
and why (``prediction["requested_stage"]``).

The planner lives with the engine (``workers.zero.planner``, read a job spec by
``workers.planning``; both need torch); a control plane installed without the worker extra,
and jobs built by a user factory (never imported on the control plane: that would run user
code here), get no prediction at submit — the worker then plans for itself.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from contract.spec import DataSpec, JobSpec, ModelSpec, ResourcesSpec, TrainSpec, ZeroSpec
from contract.zero_math import DEFAULT_PRECISION, DEFAULT_SEQ_LEN, gb_to_bytes, gbps_to_bytes_per_s

log = logging.getLogger(__name__)

BlockT = TypeVar("BlockT", bound=BaseModel)


class NothingFits(ValueError):
    """Even the highest stage with offload does not fit; ``detail`` holds every candidate's numbers."""

    def __init__(self, detail: dict[str, Any]):
        super().__init__(detail["message"])
        self.detail = detail


def plan_at_submit(spec: JobSpec) -> tuple[JobSpec, dict[str, Any] | None]:
    """(the spec to store, the prediction or None). Raises ``NothingFits`` for an "auto" job.

    An "auto" stage comes back resolved in a copy of ``spec``: the planner's stage and offloads
    set in its ``zero`` block (``workers.planning.resolved_zero``).
    """
    try:
        from workers.planning import plan_for_spec, resolved_zero
        from workers.zero.planner import NoPlanFits
    except ImportError as missing:  # control plane without torch
        log.info("no memory prediction at submit: %s", missing)
        return spec, None
    try:
        plan = plan_for_spec(spec, allow_factories=False)
    except NoPlanFits as refused:
        raise NothingFits(refused.detail) from None
    except ValueError as unplannable:  # a user factory: the worker plans it
        log.info("no memory prediction at submit: %s", unplannable)
        return spec, None
    prediction = {**plan.to_dict(), "requested_stage": spec.zero.stage}
    if spec.zero.stage != "auto":
        return spec, prediction
    return spec.model_copy(update={"zero": resolved_zero(spec.zero, plan)}), prediction


def warm_up() -> None:
    """Import the planner and plan one tiny job, so the first real submission is not the one
    that pays for importing torch and tracing a model on the meta device (seconds)."""
    try:
        plan_at_submit(JobSpec(name="planner-warm-up", model=ModelSpec(preset="gpt-nano"),
                               data=DataSpec(kind="synthetic", seq_len=16),
                               train=TrainSpec(steps=1, global_batch_size=1, micro_batch_size=1),
                               zero=ZeroSpec(stage=0, precision="fp32"), resources=ResourcesSpec(num_workers=1)))
    except Exception:  # a warm-up must never stop the service; the real submit reports errors
        log.exception("planner warm-up failed")
    # [Note: the imported heap is frozen] Importing torch leaves millions of long-lived objects
    # that every full (generation 2) collection would walk again: a pause of a few hundred ms in
    # which no request of any user is answered. ``gc.freeze`` moves what exists now, the modules
    # above all, out of the collector's sight; what requests allocate later is collected as ever.
    # Collected first, so that no garbage of the start-up is frozen with them (it would never go);
    # once per process: a later service in the same process (tests) finds the heap frozen already.
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


def plan_for_question(question: Any, spec: dict[str, Any] | None = None, allow_factories: bool = True) -> Any:
    """What ``POST /plan`` and ``zerotrain plan`` answer (a ``planner.Plan``): one function, so the two
    always agree. Raises ``planner.NoPlanFits`` or ``ValueError`` (an invalid spec included).

    ``question`` is the request model or the parsed arguments; both use the same attribute
    names, in the units people type (decimal GB, Gbit/s). The budget and time model:
    ``gpu_mem_gb``, ``host_mem_gb``, ``margin``, ``bandwidth_gbps``, ``disk_gbps``, ``compute_s``,
    ``target_efficiency``. With a ``spec`` (a whole job spec or the part of one a plan needs,
    ``question_spec``) the model comes from it (``plan_for_spec``); without,
    from a bare count: ``params``, ``gpus``, ``precision`` (None: ``DEFAULT_PRECISION``, as a job's), ``bucket_mb``,
    ``prefetch``, ``activation_gb``, ``units``, ``offload_params`` (``plan_for_count``; a spec
    question carries the last in its ``zero`` block).
    """
    from workers.planning import plan_for_spec
    from workers.zero.planner import plan_for_count

    common = dict(
        gpu_memory_bytes=gb_to_bytes(question.gpu_mem_gb),
        margin=question.margin,
        host_memory_bytes=gb_to_bytes(question.host_mem_gb),
        bandwidth_bytes_per_s=None if question.bandwidth_gbps is None else gbps_to_bytes_per_s(question.bandwidth_gbps),
        compute_s=question.compute_s,
        target_efficiency=question.target_efficiency,
        disk_bytes_per_s=gbps_to_bytes_per_s(question.disk_gbps),
    )
    if spec is not None:
        return plan_for_spec(question_spec(spec), allow_factories=allow_factories, **common)
    return plan_for_count(
        question.params,
        question.gpus,
        precision=question.precision or DEFAULT_PRECISION,
        bucket_mb=question.bucket_mb,
        prefetch=question.prefetch,
        activation_bytes=gb_to_bytes(question.activation_gb),
        units=question.units,
        offload_params=question.offload_params,
        **common,
    )


def question_spec(spec: dict[str, Any]) -> JobSpec:
    """A plan question's spec as a ``JobSpec``: what a plan does not depend on may be left out.

    A question gives the blocks that matter (``model``, ``data.seq_len``,
    ``train.micro_batch_size``, ``zero``, ``resources``); the rest gets placeholders that
    change no prediction (a name, one step, synthetic data, one micro-step per step).

    [Note: typed blocks] Each block is validated by its own model and the spec is built from
    the typed blocks, so the whole-spec rules (batch arithmetic, ZeRO rules) still run once
    in ``JobSpec``'s constructor; a bad block is a ``ValueError`` naming ``block.field``.
    """
    resources = _block("resources", ResourcesSpec, spec.get("resources") or {})
    data = dict(spec.get("data") or {})
    if "kind" not in data and "factory" not in data:
        data["kind"] = "synthetic"
    if data.get("kind") == "synthetic":
        data.setdefault("seq_len", DEFAULT_SEQ_LEN)
    train = {"steps": 1, "micro_batch_size": 1, **(spec.get("train") or {})}
    train.setdefault("global_batch_size", train["micro_batch_size"] * resources.num_workers)
    return JobSpec(name=spec.get("name") or "plan", model=_block("model", ModelSpec, spec.get("model")),
                   data=_block("data", DataSpec, data), train=_block("train", TrainSpec, train),
                   zero=_block("zero", ZeroSpec, spec.get("zero") or {}), resources=resources)


def _block(name: str, model: type[BlockT], value: Any) -> BlockT:
    """One block of a plan question, typed; its errors name the field as ``name.field``."""
    try:
        return model.model_validate(value)
    except ValidationError as invalid:
        raise ValueError("; ".join(f"{'.'.join(map(str, (name, *error['loc'])))}: {error['msg']}"
                                   for error in invalid.errors())) from None


def check_against_prediction(prediction: dict[str, Any], measured: dict[str, float]) -> dict[str, Any]:
    """Each term predicted vs measured (``workers.zero.planner.compare``)."""
    from workers.zero.planner import compare

    return compare(prediction, measured)
