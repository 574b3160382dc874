"""``POST /plan``: the memory planner over HTTP (mounted under ``/api/v1``).

Two ways to ask, so that both a whiteboard question and a job about to be submitted get an
answer: a bare parameter count (``{"params": 7.5e9, "gpus": 64, ...}``) or a job spec, or
the part of one that matters (``{"model", "data.seq_len", "train.micro_batch_size", "zero",
"resources"}``; other JobSpec fields are ignored here, the jobs route validates them). Only
presets are planned from a spec: a factory would run user code on the server. The
answer is the plan: the chosen stage, why, and every candidate's terms in bytes. When
nothing fits, the answer is a 422 that carries the same numbers (``plan``), so the caller
sees how far off each stage is. Auth is added by whoever mounts the router.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from contract.spec import OffloadParams
from contract.zero_defaults import ZERO_DEFAULTS
from contract.zero_math import (DEFAULT_BUCKET_MB, DEFAULT_DISK_GBPS, DEFAULT_MARGIN, DEFAULT_PRECISION,
                                DEFAULT_PREFETCH, DEFAULT_TARGET_EFFICIENCY, DEFAULT_UNITS, PRECISIONS)
from service.api.deps import current_user, get_settings
from service.prediction import plan_for_question
from service.schemas import ErrorOut
from service.storage_policy import UnsafeUri, check_data_uri

router = APIRouter(tags=["plan"])


class PlanRequest(BaseModel):
    """Either ``params`` (+ ``gpus``) or ``model`` (+ the job-spec blocks it needs)."""

    # [Note: bounded questions] Every number is finite and bounded: an infinite rate or count
    # has no plan, and the planner's work grows with `units` and `gpus`, so an unbounded
    # question would hold the server's CPU. The bounds are far beyond any real cluster.
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)

    # a bare count
    params: float | None = Field(default=None, gt=0, le=1e15, description="Φ, number of parameters")
    gpus: int = Field(default=1, ge=1, le=1_000_000, description="data-parallel ranks (with params)")
    precision: Literal[PRECISIONS] | None = Field(
        default=None, description=f"default: zero.precision of the spec, else {DEFAULT_PRECISION} (a job's default)"
    )
    activation_gb: float | None = Field(default=None, ge=0, le=1e6, description="activations per rank, GB (with params)")
    units: int = Field(default=DEFAULT_UNITS, ge=1, le=10_000, description="stage-3 units assumed for a bare count")
    offload_params: OffloadParams = Field(default=None, description=(
        "stage 3's parameter shards: null (in memory), \"cpu\" or \"nvme\" (swap files: on disk, a buffer pool "
        "in memory); default: zero.offload_params of the spec"))
    # a job spec (or its relevant part)
    model: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    train: dict[str, Any] | None = None
    zero: dict[str, Any] | None = None
    resources: dict[str, Any] | None = None
    # budget and time model (both ways)
    gpu_mem_gb: float | None = Field(default=None, gt=0, le=1e6, description="memory per GPU (or per CPU worker), GB")
    host_mem_gb: float | None = Field(default=None, gt=0, le=1e7, description="host memory per rank for offload, GB")
    margin: float = Field(default=DEFAULT_MARGIN, ge=0, lt=1, description="fraction of the budget kept free")
    bandwidth_gbps: float | None = Field(default=None, gt=0, le=1e6, description="per-rank link, gigabits/s")
    compute_s: float | None = Field(default=None, gt=0, le=1e6, description="compute time of one step, s")
    disk_gbps: float = Field(default=DEFAULT_DISK_GBPS, gt=0, le=1e6, description=(
        "offload_optimizer 'nvme': the swap disk's sequential rate, read and write each, gigabits/s"))
    target_efficiency: float = Field(default=DEFAULT_TARGET_EFFICIENCY, gt=0, lt=1)
    bucket_mb: float = Field(default=DEFAULT_BUCKET_MB, gt=0, le=1e6)
    prefetch: int = Field(default=DEFAULT_PREFETCH, ge=0, le=1000)

    @model_validator(mode="after")
    def _one_way(self) -> "PlanRequest":
        if (self.params is None) == (self.model is None):
            raise ValueError("give exactly one of 'params' (a parameter count) or 'model' (a job spec)")
        return self


class PlanResponse(BaseModel):
    """``planner.Plan.to_dict()``: bytes per rank for every candidate; ``chosen`` is the pick."""

    model_config = ConfigDict(extra="allow")

    stage: int
    offload_optimizer: bool | Literal["nvme"]  # True: host memory; "nvme": swap files (zero.nvme_path)
    offload_params: OffloadParams = ZERO_DEFAULTS["offload_params"]  # stage 3: "nvme" prices the shards as swap files
    reason: str
    budget_bytes: int | None
    host_budget_bytes: int | None
    margin: float
    inputs: dict[str, Any]
    chosen: dict[str, Any]
    candidates: list[dict[str, Any]]
    method: dict[str, str]


class NoPlanOut(ErrorOut):
    """The 422 of ``/plan``: the error shape, plus every candidate's numbers when nothing fits
    (absent when the request itself is invalid)."""

    plan: dict[str, Any] | SkipJsonSchema[None] = Field(default=None,
                                                        description="the planner's numbers when no stage fits")


# The 422 of both routes that plan (this one, and submit for `zero.stage: "auto"`).
NO_PLAN_RESPONSES: dict[int | str, dict[str, Any]] = {422: {
    "model": NoPlanOut,
    "description": "invalid request (`errors` names each bad field), or nothing fits the memory budget "
                   "(every candidate's numbers under `plan`)"}}


def plan_from_request(req: PlanRequest) -> "Any":
    """The ``planner.Plan`` a request asks for; raises ``planner.NoPlanFits`` or ``ValueError``."""
    spec = None
    if req.model is not None:
        zero = dict(req.zero or {})
        if req.precision:
            zero["precision"] = req.precision
        if req.offload_params:
            zero["offload_params"] = req.offload_params
        spec = {"model": req.model, "data": req.data, "train": req.train, "zero": zero, "resources": req.resources}
    return plan_for_question(req, spec, allow_factories=False)


def no_plan_response(detail: dict[str, Any]) -> JSONResponse:
    """422 in the service's error shape, with every candidate's numbers under ``plan``."""
    error = {"field": "zero.stage", "message": detail["message"], "type": "no_plan_fits"}
    return JSONResponse({"detail": detail["message"], "errors": [error], "plan": detail}, status_code=422)


@router.post(
    "/plan",
    response_model=PlanResponse,
    responses=NO_PLAN_RESPONSES,
)
def post_plan(req: PlanRequest, request: Request) -> Any:
    try:
        from workers.zero.planner import NoPlanFits
    except ImportError as exc:  # a control plane installed without the worker extra (torch)
        message = f"the planner needs the worker extra (torch): {exc}"
        return JSONResponse({"detail": message, "errors": []}, status_code=503)
    if (refused := hf_access(req, request)) is not None:
        return refused

    try:
        return plan_from_request(req).to_dict()
    except NoPlanFits as exc:
        return no_plan_response(exc.detail)
    except ValueError as exc:  # unknown preset, unimportable factory, ...
        return JSONResponse({"detail": str(exc), "errors": [{"field": "model", "message": str(exc),
                                                               "type": "value_error"}]}, status_code=422)


def hf_access(req: PlanRequest, request: Request) -> JSONResponse | None:
    """A 422 naming ``model.hf`` when the planner would read a model directory the caller may not
    read at submit (the ``data.uri`` rules; worker-local ``file://`` where user code is off): the
    planner reads its ``config.json`` here. The caller is looked up only then (the router's own
    dependency has authenticated them already)."""
    hf = req.model.get("hf") if isinstance(req.model, dict) else None
    if not isinstance(hf, str):
        return None
    hf = f"file://{hf}" if hf.startswith("/") else hf  # as the spec stores a plain path
    settings = get_settings(request)
    with request.app.state.sessionmaker() as session:
        user = current_user(request, session)
    try:
        check_data_uri(hf, settings.storage_uri, user.name, is_admin=user.is_admin)
        if hf.startswith("file://") and not settings.allow_user_code and not user.is_admin:
            raise UnsafeUri("worker-local files are disabled on this service; use an s3:// model directory")
    except UnsafeUri as exc:
        return JSONResponse({"detail": str(exc), "errors": [{"field": "model.hf", "message": str(exc),
                                                             "type": "storage_prefix"}]}, status_code=422)
    return None
