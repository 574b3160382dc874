"""Schemathesis drives every route of the OpenAPI schema -- user, worker, dashboard and
operational ones -- with generated input, once per kind of caller: nobody, a forged token, the
admin, a user and a job's ingest token. No answer may be a 5xx, break the published schema's
status codes or content types, or leak a stack trace, a driver message or a token
(tests/security/fuzz_hooks.py). Half of the generated job ids are replaced with real jobs so
that bodies reach the handlers. Bounded by MAX_EXAMPLES per operation in the fuzzing phase
(the coverage phase is a fixed set); about three minutes in all on two busy cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers.service_specs import make_spec

REPO = Path(__file__).resolve().parents[2]
SCHEMATHESIS = str(Path(sys.executable).with_name("schemathesis"))
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,no_stack_trace_in_body"
MAX_EXAMPLES = 25  # per operation and caller in the fuzzing phase (no --max-time: it repeats fuzzing)
# Stateful runs follow the schema's own links only (service/api/links.py): the ones schemathesis
# infers from any id-like field outnumber them ten to one, and which of those a seeded run
# happens to try decided whether it reached ours at all.
STATEFUL_CONFIG = "[phases.stateful.inference]\nalgorithms = []\n"
MIN_LINKS_FOLLOWED = 5  # of the schema's links (ours and the ones schemathesis infers), per stateful run


@pytest.fixture
def jobs(make_live_service):
    """A server with: alice's running job (metrics, a checkpoint), a second running job whose
    state route the fuzzer may drive to an end, and a finished job (so its SSE stream ends)."""
    service = make_live_service(scheduler_enabled=False, webhook_allowed_hosts="127.0.0.1")
    alice = service.create_user("alice")
    running, stateful, finished = (service.client(alice).submit(make_spec()).id for _ in range(3))
    tokens = dict(service.app.state.scheduler.claim())
    for job_id in (running, stateful, finished):
        worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}",
                              headers={"Authorization": f"Bearer {tokens[job_id]}"})
        worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()
        worker.post("/metrics", json={"records": [{"attempt": 0, "rank": 0, "step": s, "loss": 1.0}
                                                  for s in range(3)]}).raise_for_status()
        worker.post("/worker/checkpoints", json={
            "step": 2, "uri": f"{service.settings.storage_uri}/{job_id}/checkpoints/step_00000002",
            "world_size": 1, "stage": 0, "size_bytes": 1, "manifest_sha256": "0" * 64}).raise_for_status()
        if job_id == finished:
            worker.post("/worker/state", json={"state": "SUCCEEDED"}).raise_for_status()
        worker.close()
    return service, alice, tokens, running, stateful, finished


def fuzz(service, plan: list[list], tmp_path: Path, phases: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(REPO), "ZT_FUZZ_PLAN": json.dumps(plan),
           "SCHEMATHESIS_HOOKS": "tests.security.fuzz_hooks"}
    if phases == "stateful":
        env["ZT_FUZZ_VALID_SUBMITS"] = "1"  # chains that start with a real job (fuzz_hooks.py)
    # Each run in a folder of its own: schemathesis keeps its state, and Hypothesis its example
    # database, in the working directory, and a stateful run that replays the fuzzing phase's
    # examples never reaches a 201 to follow a link from.
    cwd = tmp_path / re.sub(r"[^a-z0-9]+", "-", f"{plan}-{phases}".lower())[:80]
    cwd.mkdir(exist_ok=True)
    (cwd / "schemathesis.toml").write_text(STATEFUL_CONFIG)
    return subprocess.run(
        [SCHEMATHESIS, "run", f"{service.url}/openapi.json", "--checks", CHECKS,
         "--phases", phases, "--max-examples", str(MAX_EXAMPLES), "--seed", "1", "--workers", "1",
         "--request-timeout", "20", "--no-color"],
        capture_output=True, text=True, timeout=300, env=env, cwd=cwd,
    )


@pytest.mark.slow  # two and a half minutes on two cores: `make test-slow` (and CI) run it, `make test` stays under 25
def test_no_caller_gets_a_5xx_or_a_leak_from_any_route(jobs, tmp_path):
    service, alice, tokens, running, stateful, finished = jobs
    # Without a valid token every route but /healthz and /metrics answers 401 before reading
    # input, so the systematic coverage phase is enough there; valid callers are also fuzzed.
    unauthenticated = {
        "nobody": [[".", running, None]],
        "a forged token": [[".", running, "zt_" + "A" * 43]],
    }
    authenticated = {
        "a job's ingest token": [["/worker/state$", stateful, tokens[stateful]],
                                 ["/(metrics|events)/stream$", finished, tokens[running]],
                                 [".", running, tokens[running]]],
        "a user": [["/(metrics|events)/stream$", finished, alice], [".", running, alice]],
        "the admin": [["/(metrics|events)/stream$", finished, service.admin_token], [".", running, service.admin_token]],
    }
    runs = [(caller, lambda plan=plan: plan, "coverage") for caller, plan in unauthenticated.items()]
    runs += [(caller, lambda plan=plan: plan, "coverage,fuzzing") for caller, plan in authenticated.items()]
    # Chained calls along the schema's OpenAPI links (service/api/links.py): submit, then
    # follow, cancel, read *that* job; create a token, then revoke it. With tokens made for
    # them: the fuzzing phase may have revoked the caller's own (DELETE /tokens/{id} is a route).
    runs += [("a user, stateful", lambda: [[".", running, service.create_user("alice")]], "stateful"),
             ("the admin, stateful", lambda: [[".", running, service.create_user("root", is_admin=True)]], "stateful")]
    failures = {}
    for caller, make_plan, phases in runs:
        plan = make_plan()
        result = fuzz(service, plan, tmp_path, phases)
        (tmp_path / f"{caller}.log").write_text(result.stdout + result.stderr)  # kept for a look afterwards
        if result.returncode != 0:
            failures[caller] = result.stdout[-5000:] + result.stderr[-1500:]
        elif phases == "stateful":  # the chains really followed links to the jobs and tokens they made
            covered = re.search(r"API Links:\s+(\d+) covered", result.stdout)
            if not covered or int(covered.group(1)) < MIN_LINKS_FOLLOWED:
                failures[caller] = f"the stateful run followed too few links:\n{result.stdout[-2000:]}"
    assert not failures, "\n\n".join(f"=== {caller}\n{output}" for caller, output in failures.items())
    assert httpx.get(f"{service.url}/healthz").status_code == 200
