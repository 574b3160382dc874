"""Schemathesis drives every documented user route with generated input: no answer may be a
5xx, and every answer must match the published schema."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.service.conftest import make_spec


def test_generated_requests_never_crash_the_server(make_live_service, tmp_path):
    service = make_live_service(scheduler_enabled=False)
    service.client().submit(make_spec())
    result = subprocess.run(
        [str(Path(sys.executable).with_name("schemathesis")), "run", f"{service.url}/openapi.json",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance",
         "--header", f"Authorization: Bearer {service.admin_token}",
         "--include-path-regex", r"^/api/v1/jobs",  # the worker routes need an ingest token
         "--exclude-path-regex", r"(/worker/|/metrics/stream|/metrics/chart)",
         "--phases", "coverage,fuzzing", "--max-examples", "5", "--seed", "1", "--workers", "1",
         "--no-color"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"},
        cwd=tmp_path,  # schemathesis keeps its state in ./.schemathesis
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
