"""MetricReporter against a tiny real HTTP server that can go down and come back on its port."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from service.schemas import MetricRecord
from workers.reporting import MetricReporter, StepMeter, WorkerAPI
from workers.zero.reports import StepInfo
from tests.helpers.waiting import wait_for


class IngestServer:
    """Stores records by (attempt, rank, step) like the control plane; counts re-sends."""

    def __init__(self, port: int = 0, status: int = 200):
        self.stored: dict[tuple[int, int, int], dict] = {}
        self.duplicates = 0
        self.requests = 0
        self.status = status
        self.port = port
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> "IngestServer":
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests += 1
                if owner.status == 200:
                    for record in body["records"]:
                        key = (record["attempt"], record["rank"], record["step"])
                        if key in owner.stored:
                            owner.duplicates += 1
                        owner.stored[key] = record
                self.send_response(owner.status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def records(n: int, start: int = 0, rank: int = 0) -> list[dict]:
    return [{"attempt": 1, "rank": rank, "step": s, "loss": 1.0 / (s + 1)} for s in range(start, start + n)]


@pytest.fixture
def server():
    srv = IngestServer().start()
    yield srv
    srv.stop()


def api_for(server: IngestServer) -> WorkerAPI:
    return WorkerAPI(server.url, "job-1", "zt_ingest_secret", timeout_s=2.0)


def test_batches_arrive_in_order_and_once(server):
    api = api_for(server)
    reporter = MetricReporter(api.post_metrics, flush_interval_s=0.05, max_batch=7)
    reporter.extend(records(50))
    assert reporter.close(timeout_s=10) == 0
    assert sorted(k[2] for k in server.stored) == list(range(50))
    assert server.duplicates == 0 and reporter.sent == 50
    assert server.requests >= 50 // 7  # batched, not one request per record


def test_an_outage_loses_nothing_and_duplicates_nothing(server):
    api = api_for(server)
    reporter = MetricReporter(api.post_metrics, flush_interval_s=0.05, max_backoff_s=0.5)
    reporter.extend(records(10))
    wait_for(lambda: len(server.stored) == 10, 10, "the 10 records stored", poll_s=0.02)
    port = server.port
    server.stop()  # the control plane goes away ...
    reporter.extend(records(30, start=10))
    wait_for(lambda: reporter.failures >= 2, 10, "two failed sends", poll_s=0.02)
    assert reporter.pending == 30
    revived = IngestServer(port=port).start()  # ... and comes back on the same address
    try:
        revived.stored.update(server.stored)
        reporter.extend(records(10, start=40))
        assert reporter.close(timeout_s=15) == 0
        assert sorted(k[2] for k in revived.stored) == list(range(50))
        assert revived.duplicates == 0
    finally:
        revived.stop()


def test_wait_delivered_returns_once_the_step_is_stored_and_gives_up_while_the_plane_is_down(server):
    """What a checkpoint's commit waits for (``workers.checkpointing.writer``): the step's record
    answered by the control plane -- sent at once, not at the next flush -- or, with the control
    plane down, False after the wait, so checkpoints are not held back for ever."""
    reporter = MetricReporter(api_for(server).post_metrics, flush_interval_s=3600, max_backoff_s=0.2)
    reporter.extend(records(4, start=1))  # steps 1..4
    assert reporter.wait_delivered(4, timeout_s=10)  # the hour-long flush interval is not waited for
    assert sorted(k[2] for k in server.stored) == [1, 2, 3, 4]
    server.stop()
    reporter.extend(records(1, start=5))
    started = time.monotonic()
    assert not reporter.wait_delivered(5, timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert reporter.pending == 1  # still kept, sent when the control plane is back


def test_close_keeps_retrying_until_its_deadline(server):
    port = server.port
    server.stop()
    reporter = MetricReporter(api_for(server).post_metrics, flush_interval_s=0.05, max_backoff_s=0.3)
    reporter.extend(records(5))
    revived = IngestServer(port=port)
    threading.Timer(1.0, revived.start).start()  # up again while close() is waiting
    try:
        assert reporter.close(timeout_s=10) == 0
        assert len(revived.stored) == 5
    finally:
        wait_for(lambda: revived._server is not None, 10, "the revived server", poll_s=0.02)
        revived.stop()


def test_bounded_buffer_drops_oldest_and_counts(server, caplog):
    port = server.port
    server.stop()
    reporter = MetricReporter(api_for(server).post_metrics, flush_interval_s=60, max_buffer=10)
    reporter.extend(records(25))
    assert reporter.pending == 10 and reporter.dropped == 15
    assert "dropped" in caplog.text
    revived = IngestServer(port=port).start()
    try:
        assert reporter.close(timeout_s=10) == 0
        assert sorted(k[2] for k in revived.stored) == list(range(15, 25))  # the newest survive
    finally:
        revived.stop()


def test_refused_batch_is_dropped_not_retried_forever():
    srv = IngestServer(status=401).start()
    try:
        reporter = MetricReporter(api_for(srv).post_metrics, flush_interval_s=0.05)
        reporter.extend(records(3))
        assert reporter.close(timeout_s=5) == 0
        assert reporter.rejected == 3 and srv.requests == 1
    finally:
        srv.stop()


def test_worker_api_sends_the_ingest_token_in_the_header():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers["authorization"]
        seen["url"] = str(request.url)
        return httpx.Response(200, json={"accepted": 1, "duplicates": 0})

    api = WorkerAPI("http://cp", "j1", "zt_ingest_abc", transport=httpx.MockTransport(handler))
    api.post_metrics(records(1))
    assert seen == {"auth": "Bearer zt_ingest_abc", "url": "http://cp/api/v1/jobs/j1/metrics"}


def test_worker_api_requests_leave_no_info_lines_in_the_jobs_log(server, caplog, monkeypatch):
    """A job's log is every rank's output: httpx's "HTTP Request: POST …" line per metric push
    once outnumbered the training lines. Requests through WorkerAPI log nothing below WARNING."""
    for name in ("httpx", "httpcore"):  # as a fresh worker process has them
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    caplog.set_level(logging.DEBUG)
    api = api_for(server)
    assert api.post_metrics(records(3)).status_code == 200
    api.close()
    assert server.requests == 1
    chatter = [r for r in caplog.records if r.name.split(".")[0] in ("httpx", "httpcore")]
    assert not chatter, [r.getMessage() for r in chatter]


def test_step_meter_derives_throughput_and_bytes():
    meter = StepMeter(rank=1, attempt=2, flops_per_token=6e6, comm_element_bytes=2, device="cpu")
    memory = {"params": 10, "grads": 20, "optimizer": 30, "buffers": 4, "total": 64}
    info = StepInfo(grad_norm=1.5, skipped=False, loss_scale=None, comm_exposed_s=0.01, step=3, micro_steps=1,
                    comm_elements=500)
    rec = meter.record(step=3, loss=2.5, lr=1e-3, step_time_s=0.5, samples=4, tokens=1000, info=info, memory=memory,
                       peak_memory_bytes=3 << 20, comm_volume={"total": 500})
    assert rec["tokens_per_s"] == 2000 and rec["samples_per_s"] == 8
    assert rec["tflops"] == pytest.approx(6e6 * 2000 / 1e12)
    assert rec["mfu"] is None  # no known peak on CPU
    assert (rec["mem_params_bytes"], rec["mem_grads_bytes"], rec["mem_optimizer_bytes"],
            rec["mem_buffers_bytes"]) == (10, 20, 30, 4)
    assert rec["mem_peak_bytes"] == 3 << 20  # the worker's meter's, as given
    assert rec["comm_bytes"] == 1000 and (rec["attempt"], rec["rank"], rec["step"]) == (2, 1, 3)
    # every field of the metric table, no other; "user" only when the user's code reported something
    assert list(rec) == [name for name in MetricRecord.model_fields if name != "user"]
    assert rec["eval_loss"] is None
    MetricRecord.model_validate(rec)
    rec = meter.record(step=4, loss=2.5, lr=1e-3, step_time_s=0.5, samples=4, tokens=1000, info=info, memory=memory,
                       peak_memory_bytes=3 << 20, comm_volume={}, eval_loss=2.75, user={"accuracy": 0.5})
    assert (rec["eval_loss"], rec["user"]) == (2.75, {"accuracy": 0.5})
    assert list(rec) == list(MetricRecord.model_fields)
    MetricRecord.model_validate(rec)
