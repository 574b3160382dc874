"""Operational endpoints outside ``/api/v1``: liveness with a database check, Prometheus."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from service.api.deps import SessionDep
from service.api.errors import text_response

router = APIRouter(tags=["health"])


@router.get("/healthz", name="healthz")
def healthz(session: SessionDep) -> dict[str, str]:
    session.execute(text("SELECT 1"))  # a DB error becomes the global 503
    return {"status": "ok", "database": "ok"}


@router.get("/metrics", name="prometheus_metrics", response_class=Response,
            responses=text_response(CONTENT_TYPE_LATEST, "the service's metrics in Prometheus text format"))
def prometheus_metrics(request: Request) -> Response:
    registry = request.app.state.service_metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
