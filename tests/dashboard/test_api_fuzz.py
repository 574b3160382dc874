"""Schemathesis drives the dashboard's own endpoints with generated input: no answer may be
a 5xx and every answer must match the published schema (as tests/service/test_fuzz.py does
for the control plane's routes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.dashboard.conftest import spec


def test_generated_requests_never_crash_the_dashboard_api(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    service.client().submit(spec("fuzzed"))
    result = subprocess.run(
        [str(Path(sys.executable).with_name("schemathesis")), "run", f"{service.url}/openapi.json",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance",
         "--header", f"Authorization: Bearer {service.admin_token}",
         "--include-path-regex", r"(/metrics/chart|/dashboard/(progress|preemption|whoami))$",
         "--phases", "examples,coverage,fuzzing", "--max-examples", "20", "--seed", "1", "--workers", "1",
         "--no-color"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"},
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
