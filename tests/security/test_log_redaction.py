"""A token sent in a query string never reaches the access log (the API refuses it, but uvicorn
logs the request line before any handler runs)."""

from __future__ import annotations

import logging

import httpx
import pytest

from service.log_redaction import redact


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access_log(live_service):
    logger = logging.getLogger("uvicorn.access")
    collect, level = Collect(), logger.level
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    yield live_service, collect.lines
    logger.removeHandler(collect)
    logger.setLevel(level)


def test_a_token_in_the_query_string_is_redacted_from_the_access_log(access_log):
    service, lines = access_log
    token = service.admin_token
    for path in (f"/api/v1/jobs?token={token}", f"/api/v1/jobs?limit=5&access_token={token}&state=QUEUED",
                 f"/api/v1/jobs/{token}"):
        httpx.get(service.url + path, headers={"Authorization": f"Bearer {token}"})
    logged = "\n".join(lines)
    assert lines, "the access log recorded nothing"
    assert token not in logged and token[len("zt_"):] not in logged, logged
    assert "limit=5" in logged and "state=QUEUED" in logged  # other parameters stay readable


@pytest.mark.parametrize(("line", "expected"), [
    ("GET /x?token=abc&n=1", "GET /x?token=[redacted]&n=1"),
    ("GET /x?n=1&X-Amz-Signature=deadbeef", "GET /x?n=1&X-Amz-Signature=[redacted]"),
    ("GET /x?monkey=1", "GET /x?monkey=[redacted]"),  # a name containing 'key' is redacted too
    ("GET /x?n=zt_abcdefghijklmnop", "GET /x?n=zt_[redacted]"),
    ("GET /jobs?state=RUNNING", "GET /jobs?state=RUNNING"),
])
def test_redact(line, expected):
    assert redact(line) == expected
