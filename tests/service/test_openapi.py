"""The API's published shape: clean operation ids, JSON errors even for unknown routes."""

from __future__ import annotations

import httpx

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
    ("get", "/api/v1/jobs/{job_id}/checkpoints"): "list_checkpoints",
    ("get", "/api/v1/jobs/{job_id}/worker/spec"): "get_worker_spec",
    ("post", "/api/v1/jobs/{job_id}/worker/state"): "report_worker_state",
    ("post", "/api/v1/jobs/{job_id}/worker/checkpoints"): "register_checkpoint",
    ("post", "/api/v1/jobs/{job_id}/worker/memory"): "report_worker_memory",
    ("delete", "/api/v1/jobs/{job_id}/worker/checkpoints/{step}"): "forget_checkpoint",
    ("post", "/api/v1/jobs/{job_id}/worker/checkpoints/failed"): "report_checkpoint_failure",
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
