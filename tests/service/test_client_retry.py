"""The SDK honours ``Retry-After`` (issue 33): a busy service's 429/503 is tried again after the
seconds it asks for, when repeating is safe; otherwise, or past the budget, the error is raised.

The service here is a small real HTTP server on loopback that answers a scripted sequence."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from service import client as sdk
from service.client import Client, ServiceUnavailable, ZerotrainError

JOB = {"id": "j1", "name": "n", "owner": "alice", "state": "QUEUED", "reason": "submitted", "attempt": 0,
       "spec": {}, "created_at": "2026-12-04T00:00:00Z", "updated_at": "2026-12-04T00:00:00Z"}


class Scripted(BaseHTTPRequestHandler):
    answers: list[tuple[int, dict]] = []
    seen: list[tuple[str, float]] = []

    def _answer(self) -> None:
        Scripted.seen.append((self.command, time.monotonic()))
        status, headers = Scripted.answers.pop(0) if Scripted.answers else (200, {})
        body = json.dumps(JOB if status == 200 else {"detail": "busy", "errors": []}).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Scripted.answers, Scripted.seen = [], []
    try:
        yield Client(f"http://127.0.0.1:{httpd.server_address[1]}", "token")
    finally:
        httpd.shutdown()


def test_a_read_waits_as_long_as_a_503_asks_then_succeeds(server):
    Scripted.answers = [(503, {"Retry-After": "1"}), (503, {"Retry-After": "0.5"})]
    assert server.get("j1").id == "j1"
    times = [t for _, t in Scripted.seen]
    assert len(times) == 3 and times[1] - times[0] >= 1.0 and times[2] - times[1] >= 0.5


def test_a_submit_is_repeated_after_a_429_or_with_an_idempotency_key_only(server):
    Scripted.answers = [(429, {"Retry-After": "0.2"})]
    assert server.submit({"name": "n"}).id == "j1" and len(Scripted.seen) == 2
    Scripted.answers, Scripted.seen = [(503, {"Retry-After": "0.2"})], []
    with pytest.raises(ServiceUnavailable):  # a 503 POST might have been half done: not repeated
        server.submit({"name": "n"})
    assert len(Scripted.seen) == 1
    Scripted.answers, Scripted.seen = [(503, {"Retry-After": "0.2"})], []
    assert server.submit({"name": "n"}, idempotency_key="k").id == "j1" and len(Scripted.seen) == 2


def test_past_the_budget_or_without_retry_after_the_error_is_raised(server, monkeypatch):
    monkeypatch.setattr(sdk, "RETRY_AFTER_BUDGET_S", 1.0)
    Scripted.answers = [(503, {"Retry-After": "0.6"}), (503, {"Retry-After": "0.6"})]
    with pytest.raises(ZerotrainError) as raised:
        server.get("j1")
    assert raised.value.status == 503 and len(Scripted.seen) == 2
    Scripted.answers, Scripted.seen = [(503, {})], []
    with pytest.raises(ZerotrainError):
        server.get("j1")
    assert len(Scripted.seen) == 1


class GrowingLog(BaseHTTPRequestHandler):
    """A job that ends on the third poll, its log growing by a line each poll; answers from ``offset``
    as the service does (past the end: the whole log)."""

    polls = 0
    offsets: list[str | None] = []

    def do_GET(self) -> None:
        from urllib.parse import parse_qs, urlparse

        url = urlparse(self.path)
        if url.path.endswith("/logs"):
            GrowingLog.polls += 1
            log = "".join(f"line {i}\n" for i in range(GrowingLog.polls)).encode()
            offset = parse_qs(url.query).get("offset", [None])[0]
            GrowingLog.offsets.append(offset)
            body = log[int(offset):] if offset is not None and int(offset) <= len(log) else log
            headers = {"Content-Type": "text/plain", "Zerotrain-Log-Bytes": str(len(log))}
        else:
            body = json.dumps({**JOB, "state": "SUCCEEDED" if GrowingLog.polls >= 2 else "RUNNING"}).encode()
            headers = {"Content-Type": "application/json"}
        self.send_response(200)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_following_a_log_fetches_only_what_is_new():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), GrowingLog)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    GrowingLog.polls, GrowingLog.offsets = 0, []
    try:
        parts = list(Client(f"http://127.0.0.1:{httpd.server_address[1]}", "t").follow_logs("j1", poll=0.01))
    finally:
        httpd.shutdown()
    assert "".join(parts) == "line 0\nline 1\nline 2\n" and parts == ["line 0\n", "line 1\n", "line 2\n"]
    assert GrowingLog.offsets == [None, "7", "14"]  # each poll from the size the last answer reported


# ----------------------------------------------------------------------------- several replicas


def _refused_url() -> str:
    """A loopback URL where nothing listens: connections to it are refused."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_call_goes_to_the_next_replica_when_the_current_one_refuses_and_stays_there(server):
    live = server.url
    client = Client(f"{_refused_url()}, {live}/", "token")
    assert client.urls == [client.urls[0], live]
    assert client.get("j1").id == "j1"  # refused by the first: sent to the second
    assert client.url == live
    assert client.submit({"name": "x"}).id == "j1"  # a POST never sent may go elsewhere too
    assert [method for method, _ in Scripted.seen] == ["GET", "POST"]
    with pytest.raises(ServiceUnavailable) as raised:
        Client(f"{_refused_url()},{_refused_url()}", "token").get("j1")
    assert raised.value.message.count("127.0.0.1") == 2  # every replica tried is named


def test_a_submit_that_may_have_arrived_is_not_sent_to_another_replica():
    class Silent(BaseHTTPRequestHandler):  # reads the request, then never answers
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(2)

        def log_message(self, *args) -> None:
            pass

    silent = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    threading.Thread(target=silent.serve_forever, daemon=True).start()
    other = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    Scripted.answers, Scripted.seen = [], []
    try:
        urls = f"http://127.0.0.1:{silent.server_address[1]},http://127.0.0.1:{other.server_address[1]}"
        with Client(urls, "token", timeout=0.5) as client, pytest.raises(ServiceUnavailable):
            client.submit({"name": "x"})  # read timeout: it may have been stored
        assert Scripted.seen == []
        with Client(urls, "token", timeout=0.5) as client:
            assert client.submit({"name": "x"}, idempotency_key="k").id == "j1"  # safe to repeat
        assert [method for method, _ in Scripted.seen] == ["POST"]
    finally:
        for httpd in (silent, other):
            httpd.shutdown()
            httpd.server_close()
