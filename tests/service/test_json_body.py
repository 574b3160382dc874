"""``service.api.json_body``: a valid body reaches the route without ``json.loads`` (pydantic
read it in one pass), and every bad body gets exactly the answer a plain FastAPI route gives."""

from __future__ import annotations

import json

import pytest
import starlette.requests
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from service.api.errors import install_error_handlers
from service.api.json_body import OnePassJsonRoute
from service.schemas import MetricBatch


def _app(route_class: type | None) -> FastAPI:
    def ingest(batch: MetricBatch) -> dict:
        return {"steps": [record.step for record in batch.records], "kind": type(batch).__name__}

    router = APIRouter()
    router.add_api_route("/metrics", ingest, methods=["POST"], **({"route_class_override": route_class}
                                                                    if route_class else {}))
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router, prefix="/api")
    return app


@pytest.fixture
def loads_calls(monkeypatch):
    calls: list[int] = []
    real = starlette.requests.json.loads
    monkeypatch.setattr(starlette.requests.json, "loads", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_valid_body_is_read_once_by_pydantic(loads_calls):
    body = {"records": [{"attempt": 0, "rank": 1, "step": step, "loss": 0.5, "user": {"acc": 1}} for step in range(3)]}
    with TestClient(_app(OnePassJsonRoute)) as client:
        response = client.post("/api/metrics", json=body)
    assert loads_calls == []  # (json is stdlib's: the client's own parse below would count)
    assert response.status_code == 200 and response.json() == {"steps": [0, 1, 2], "kind": "MetricBatch"}


BAD_BODIES = [
    json.dumps({"records": [{"attempt": 0, "rank": 0, "step": 0}, {"attempt": 0, "rank": -1, "step": 1}]}),
    json.dumps({"records": [{"attempt": 0, "rank": 0, "step": 0, "loss": "not a number"}]}),
    json.dumps({"records": [{"attempt": 0, "rank": 0, "step": 0, "unknown": 1}]}),
    json.dumps({"records": [{"attempt": 0, "rank": 0, "step": step} for step in range(10_001)]}),
    json.dumps([1, 2]),
    "null",
    '{"records": [',
    '{"records": [{"attempt": 0, "rank": 0, "step": 0, "loss": NaN, "user": {"x": Infinity}}]}',
    b'{"records": [{"attempt": 0, "rank": 0, "step": 0, "loss": "\xff"}]}',
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_a_bad_body_gets_the_answer_a_plain_route_gives(body):
    answers = []
    for route_class in (None, OnePassJsonRoute):
        with TestClient(_app(route_class)) as client:
            response = client.post("/api/metrics", content=body, headers={"Content-Type": "application/json"})
        answers.append((response.status_code, response.content))
    assert answers[0][0] in (400, 422)
    assert answers[1] == answers[0]


def test_the_metric_ingest_route_reads_its_body_in_one_pass():
    from service.api import metrics

    route, = [route for route in metrics.router.routes if getattr(route, "name", None) == "ingest_metrics"]
    assert isinstance(route, OnePassJsonRoute) and route.methods == {"POST"}
