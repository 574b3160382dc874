"""Free-form JSON in a spec is bounded at validation, and a list survives a row it cannot show.

The finding: a ``data.kwargs`` nested ~255 levels deep was accepted and stored, after which
``GET /api/v1/jobs`` answered 500 for every user who could see that job (pydantic's
serialization depth), until someone deleted the row by hand.
"""

from __future__ import annotations

import copy
import json
import math

import httpx
import pytest
from sqlalchemy import create_engine, text

from contract.spec import MAX_JSON_DEPTH, MAX_JSON_VALUES
from tests.helpers.service_specs import make_spec


def nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"k": value}
    return value


@pytest.fixture
def service(make_live_service):
    return make_live_service(scheduler_enabled=False)


def _admin(service) -> httpx.Client:
    return httpx.Client(base_url=f"{service.url}/api/v1", headers={"Authorization": f"Bearer {service.admin_token}"})


@pytest.mark.parametrize("block", ["model", "data"])
def test_deeply_nested_kwargs_are_refused_and_the_list_stays_served(service, block):
    admin = _admin(service)
    spec = make_spec()
    if block == "data":
        spec["data"] = {"kind": "factory", "factory": "tests.fake:data", "kwargs": nested(255)}
    else:
        spec["model"]["kwargs"] = nested(255)
    answer = admin.post("/jobs", json=spec)
    assert answer.status_code == 422, answer.text
    fields = [error["field"] for error in answer.json()["errors"]]
    assert f"{block}.kwargs" in fields, answer.json()
    assert str(MAX_JSON_DEPTH) in answer.text
    assert admin.get("/jobs").status_code == 200


def test_kwargs_at_the_depth_limit_are_accepted_and_round_trip(service):
    admin = _admin(service)
    spec = make_spec()
    spec["model"]["kwargs"] = {**nested(MAX_JSON_DEPTH), "lr": 0.5, "sizes": [1, 2.5, None, True, "x"]}
    job = admin.post("/jobs", json=spec)
    assert job.status_code == 201, job.text
    stored = admin.get(f"/jobs/{job.json()['id']}").json()["spec"]["model"]["kwargs"]
    assert stored == {**nested(MAX_JSON_DEPTH), "lr": 0.5, "sizes": [1, 2.5, None, True, "x"]}


@pytest.mark.parametrize("kwargs", [
    {"wide": list(range(MAX_JSON_VALUES + 1))},
    {"x": math.inf},
    {"x": [1.0, math.nan]},
])
def test_oversized_or_non_finite_kwargs_are_refused(service, kwargs):
    spec = make_spec()
    spec["model"]["kwargs"] = kwargs
    body = json.dumps(spec)  # Python's json writes Infinity/NaN, as a careless client would
    answer = _admin(service).post("/jobs", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    assert "model.kwargs" in [error["field"] for error in answer.json()["errors"]]


def test_a_stored_row_that_cannot_be_shown_does_not_break_the_list(service):
    """A row written before these limits existed (or by hand): the page is still served, that
    job is named as unreadable, and every other job is listed as usual."""
    admin = _admin(service)
    good = admin.post("/jobs", json=make_spec()).json()["id"]
    bad = admin.post("/jobs", json=make_spec()).json()["id"]
    deep = copy.deepcopy(make_spec())
    deep["model"]["kwargs"] = nested(300)
    engine = create_engine(service.database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE jobs SET spec = CAST(:spec AS JSON) WHERE id = :id"),
                           {"spec": json.dumps(deep), "id": bad})
    engine.dispose()
    page = admin.get("/jobs")
    assert page.status_code == 200, page.text
    assert [item["id"] for item in page.json()["items"]] == [good]
    assert [row["id"] for row in page.json()["unreadable"]] == [bad]
    detail = admin.get(f"/jobs/{bad}")
    assert detail.status_code == 500 and "cannot be shown" in detail.json()["detail"], detail.text
    assert admin.get(f"/jobs/{good}").status_code == 200


def test_a_spec_larger_than_the_service_stores_is_refused_naming_the_block(make_live_service):
    service = make_live_service(scheduler_enabled=False, max_spec_bytes=4096)
    spec = make_spec()
    spec["model"]["kwargs"] = {"vocabulary": ["token"] * 2000}  # ~20 KB, well within the value limits
    answer = _admin(service).post("/jobs", json=spec)
    assert answer.status_code == 422, answer.text
    error = answer.json()["errors"][0]
    assert error["field"] == "model.kwargs" and "ZEROTRAIN_MAX_SPEC_BYTES" in error["message"]
    assert _admin(service).get("/jobs").json()["items"] == []
