"""Schemathesis hooks for tests/security/test_fuzz.py (loaded through ``SCHEMATHESIS_HOOKS``).

``no_stack_trace_in_body``  a check: no answer may carry a traceback, a source path, a
                            database driver's message (those tell an attacker what runs inside)
                            or any of the run's bearer tokens.
``before_call``             aims each generated request: ``ZT_FUZZ_PLAN`` (JSON) is a list of
                            ``[path_regex, job_id, token]``; the first entry whose regex matches
                            the operation's path decides the bearer token (none when null) and,
                            for half of the generated cases, replaces the ``job_id`` path
                            parameter with a real job, so bodies reach the handlers instead of
                            stopping at "no such job". The other half keeps the generated id.
                            With ``ZT_FUZZ_VALID_SUBMITS`` set (the stateful runs), half of the
                            generated ``POST /api/v1/jobs`` bodies become a valid spec (the
                            schema's example, ``contract.spec.EXAMPLE_SPEC``), so a chain gets
                            a 201 and follows its links to the new job: a generated body is
                            almost never a valid job, and a chain would stop at its 422.
                            Half of the ``POST /api/v1/webhooks`` bodies become a webhook the
                            service admits (``VALID_WEBHOOK``), for the same reason.
"""

from __future__ import annotations

import json
import os
import re
import zlib

import schemathesis

from contract.spec import EXAMPLE_SPEC

LEAK_MARKERS = ("Traceback (most recent call last)", 'File "/', "site-packages", "sqlalchemy.",
                "psycopg.", "[SQL:", "[parameters:", "pydantic_core")


@schemathesis.check
def no_stack_trace_in_body(ctx, response, case):  # noqa: ANN001
    body = response.text or ""
    found = [marker for marker in LEAK_MARKERS if marker in body]
    found += ["a bearer token" for secret in SECRETS if secret in body]
    if found:
        raise AssertionError(f"the response body leaks {found}: {body[:300]!r}")


def _plan() -> list[tuple[re.Pattern[str], str | None, str | None]]:
    return [(re.compile(regex), job_id, token) for regex, job_id, token in json.loads(os.environ.get("ZT_FUZZ_PLAN", "[]"))]


PLAN = _plan()
VALID_SUBMITS = bool(os.environ.get("ZT_FUZZ_VALID_SUBMITS"))
# A webhook the fuzzed service's allow-list admits (test_fuzz.py): nothing listens there.
VALID_WEBHOOK = {"url": "http://127.0.0.1:9/fuzz", "events": ["job.succeeded"], "secret": "fuzz-secret-0123456789"}
SECRETS = tuple({token for _, _, token in PLAN if token})  # no answer may echo a bearer token


@schemathesis.hook
def before_call(context, case, kwargs):  # noqa: ANN001
    path = case.operation.path
    for pattern, job_id, token in PLAN:
        if not pattern.search(path):
            continue
        if token:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
        params = case.path_parameters or {}
        if job_id and "job_id" in params and zlib.crc32(repr(params["job_id"]).encode()) % 2 == 0:
            case.path_parameters = {**params, "job_id": job_id}
        if (VALID_SUBMITS and case.operation.method.upper() == "POST" and path == "/api/v1/jobs"
                and zlib.crc32(repr(case.body).encode()) % 2 == 0):
            case.body = {**EXAMPLE_SPEC, "name": f"fuzz-{zlib.crc32(repr(case.body).encode()):08x}"}
        if (VALID_SUBMITS and case.operation.method.upper() == "POST" and path == "/api/v1/webhooks"
                and zlib.crc32(repr(case.body).encode()) % 2 == 0):
            case.body = VALID_WEBHOOK
        return

