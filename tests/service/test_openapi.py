"""The API's published shape: clean operation ids, schemas client generators can type, JSON
errors even for unknown routes."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import jsonschema

CORE_OPERATIONS = {
    ("post", "/api/v1/jobs"): "submit_job",
    ("get", "/api/v1/jobs"): "list_jobs",
    ("get", "/api/v1/jobs/{job_id}"): "get_job",
    ("post", "/api/v1/jobs/{job_id}/cancel"): "cancel_job",
    ("get", "/api/v1/jobs/{job_id}/events"): "list_job_events",
    ("get", "/api/v1/jobs/{job_id}/logs"): "get_job_logs",
    ("get", "/api/v1/jobs/{job_id}/metrics"): "list_metrics",
    ("post", "/api/v1/jobs/{job_id}/metrics"): "ingest_metrics",
    ("get", "/api/v1/jobs/{job_id}/metrics/stream"): "stream_metrics",
    ("get", "/api/v1/jobs/{job_id}/events/stream"): "stream_job_events",
    ("get", "/api/v1/jobs/{job_id}/checkpoints"): "list_checkpoints",
    ("get", "/api/v1/jobs/{job_id}/worker/spec"): "get_worker_spec",
    ("post", "/api/v1/jobs/{job_id}/worker/state"): "report_worker_state",
    ("post", "/api/v1/jobs/{job_id}/worker/checkpoints"): "register_checkpoint",
    ("post", "/api/v1/jobs/{job_id}/worker/memory"): "report_worker_memory",
    ("delete", "/api/v1/jobs/{job_id}/worker/checkpoints/{step}"): "forget_checkpoint",
    ("post", "/api/v1/jobs/{job_id}/worker/checkpoints/failed"): "report_checkpoint_failure",
    ("post", "/api/v1/jobs/{job_id}/worker/resized"): "report_worker_group_resized",
    ("get", "/healthz"): "healthz",
    ("get", "/metrics"): "prometheus_metrics",
}


def test_operation_ids_are_the_route_names_and_unique(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    schema = httpx.get(f"{service.url}/openapi.json").json()
    operations = {(method, path): op["operationId"]
                  for path, item in schema["paths"].items() for method, op in item.items()}
    assert CORE_OPERATIONS.items() <= operations.items()
    assert len(set(operations.values())) == len(operations)
    job_spec = schema["components"]["schemas"]["JobSpec"]
    assert job_spec["additionalProperties"] is False


def test_unknown_route_and_method_are_json_errors(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    missing = httpx.get(f"{service.url}/api/v1/nothing-here")
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found", "errors": []}
    wrong_method = httpx.delete(f"{service.url}/api/v1/jobs")
    assert wrong_method.status_code == 405 and wrong_method.json()["detail"] == "Method Not Allowed"


def schema_nodes(node: Any, path: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every JSON object in the document, with its JSON pointer."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from schema_nodes(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from schema_nodes(value, f"{path}/{index}")


JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}


def test_no_enum_mixes_types_and_each_says_its_type(make_live_service):
    """A generator turns an ``enum`` into one typed enum class: values of several types (stage's
    ``0..3 | "auto"`` once) made openapi-python-client drop the submit route and every model
    that reaches it. Every enum anywhere in the document holds one JSON type and declares it."""
    service = make_live_service(scheduler_enabled=False)
    schema = httpx.get(f"{service.url}/openapi.json").json()
    enums = [(path, node) for path, node in schema_nodes(schema) if isinstance(node.get("enum"), list)]
    assert enums, "the document has no enums at all: this check checks nothing"
    for path, node in enums:
        types = {JSON_TYPES[type(value)] for value in node["enum"]}
        assert len(types) == 1, f"{path}: enum mixes {sorted(types)}: {node['enum']}"
        assert node.get("type") == types.pop(), f"{path}: enum without its type: {node}"


def test_every_response_body_declares_a_schema(make_live_service):
    """A content type without a ``schema`` (the logs, the SSE stream, Prometheus once) reads as
    "no body" to generators: openapi-python-client typed those routes as returning ``None``."""
    service = make_live_service(scheduler_enabled=False)
    schema = httpx.get(f"{service.url}/openapi.json").json()
    bodies = [(f"{method.upper()} {path} {status} {media_type}", media)
              for path, item in schema["paths"].items() for method, operation in item.items()
              for status, response in operation["responses"].items()
              for media_type, media in response.get("content", {}).items()]
    assert len(bodies) > len(CORE_OPERATIONS), "too few bodies: this check checks nothing"
    assert [where for where, media in bodies if "schema" not in media] == []


def test_the_published_stage_schema_accepts_what_the_api_accepts(make_live_service):
    """The schema of ``zero.stage`` is written by hand (contract.spec.Stage): it must take and
    refuse the same values as the API itself."""
    service = make_live_service(scheduler_enabled=False)
    schema = httpx.get(f"{service.url}/openapi.json").json()
    stage = schema["components"]["schemas"]["ZeroSpec"]["properties"]["stage"]
    validator = jsonschema.Draft202012Validator(stage)
    for good in (0, 1, 2, 3, "auto"):
        assert validator.is_valid(good), good
    for bad in (4, -1, "2", "Auto", None, 1.5):
        assert not validator.is_valid(bad), bad
    headers = {"Authorization": f"Bearer {service.admin_token}"}
    spec = {"name": "stage-check", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 16},
            "train": {"steps": 1, "global_batch_size": 1, "micro_batch_size": 1},
            "zero": {"stage": "auto"}, "resources": {"num_workers": 1}}
    for good in (0, 3, "auto"):
        answer = httpx.post(f"{service.url}/api/v1/jobs", headers=headers,
                            json={**spec, "zero": {"stage": good}})
        assert answer.status_code == 201, answer.text
    for bad in (4, "2"):
        answer = httpx.post(f"{service.url}/api/v1/jobs", headers=headers, json={**spec, "zero": {"stage": bad}})
        assert answer.status_code == 422 and answer.json()["errors"][0]["field"] == "zero.stage", answer.text


def test_every_link_names_a_real_operation_and_parameter_and_the_example_spec_is_accepted(make_live_service):
    """The OpenAPI links (service/api/links.py) point at operations that exist and fill their
    path parameters; JobSpec's published example is a job the service accepts."""
    service = make_live_service(scheduler_enabled=False)
    schema = httpx.get(f"{service.url}/openapi.json").json()
    operations = {op["operationId"]: (path, op) for path, item in schema["paths"].items() for op in item.values()}
    links = [(name, link) for _path, item in schema["paths"].items() for op in item.values()
             for answer in op["responses"].values() for name, link in answer.get("links", {}).items()]
    assert len(links) >= 10, links
    for name, link in links:
        path, _op = operations[link["operationId"]]
        assert {f"{{{parameter}}}" for parameter in link["parameters"]} <= set(path.split("/")), (name, path)
    (example,) = schema["components"]["schemas"]["JobSpec"]["examples"]
    answer = httpx.post(f"{service.url}/api/v1/jobs", json=example,
                        headers={"Authorization": f"Bearer {service.admin_token}"})
    assert answer.status_code == 201, answer.text
    follow = httpx.get(f"{service.url}/api/v1/jobs/{answer.json()['id']}",
                       headers={"Authorization": f"Bearer {service.admin_token}"})
    assert follow.status_code == 200
