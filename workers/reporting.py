"""What a worker tells the control plane: per-step metric records, pushed batched and safely.

Three parts, used by ``workers.train`` and ``workers.launch``:

``WorkerAPI``       the job's worker endpoints (docs/contracts.md) over HTTP with the ingest
                    token, retrying what is safe to retry (every worker call is idempotent).
``StepMeter``       turns one step's observations into a metric record, the way
                    torchtitan's metrics component does: the fields and how each is derived
                    (tokens/s, TFLOPs from FLOPs per token, MFU only when the device's peak
                    is known, memory from ``engine.step_memory()`` plus the rank's peak (the
                    worker's ``PeakMemoryMeter``: ``contract.metrics.PEAK_MEASURE``),
                    communication bytes) are the metric table's (``contract.metrics``).
``MetricReporter``  a per-rank buffer flushed by a background thread about once a second.
                    A failed POST keeps its batch and retries with backoff, so a control plane
                    that is down for a while loses nothing; the server ignores re-sent
                    records (unique on job, attempt, rank, step), so a batch whose answer was
                    lost is simply sent again. The buffer is bounded: only past the bound are
                    the oldest records dropped, counted and warned about.

[Note: metrics before checkpoints]
A restarted attempt resumes after the latest committed checkpoint, so a record of a step at
or before it is never produced again: if it is still in a dead rank's buffer, it is lost for
good. So a checkpoint of step N is committed only once every rank's record of step N (and so,
records going out oldest first, of every earlier step) has been answered:
``workers.checkpointing.writer`` calls ``MetricReporter.wait_delivered(N)`` on each rank
before the commit's gather. A control plane that stays unreachable longer than the wait
(``DELIVERY_WAIT_S``) does not hold checkpoints back for ever: the checkpoint is committed
with a warning, and only then can a lost rank take records at or before it with it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable

import httpx

from contract.environment import api_urls
from contract.job_states import JobState
from contract.metrics import StepObservation, record_values
from contract.reasons import bounded_details
from contract.zero_math import DEFAULT_PRECISION

if TYPE_CHECKING:  # the engine's report types; this module stays free of torch
    from workers.zero.reports import MemoryReport, StepInfo
from workers.peak_flops import peak_flops

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {408, 425, 429, 500, 502, 503, 504}
DELIVERY_WAIT_S = 120.0  # how long a checkpoint's commit waits for the metrics of its step


class JobNotActive(RuntimeError):
    """The control plane refused a state report: the job was cancelled or already ended."""


HTTP_CLIENT_LOGGERS = ("httpx", "httpcore")


def quiet_http_client_logs() -> None:
    """httpx logs every request at INFO ("HTTP Request: POST …/metrics "HTTP/1.1 200 OK"") and
    httpcore every connection step at DEBUG: in a job's log, which is the driver's and every
    rank's output, that buried the training lines (a metric push a second per rank). Only
    their warnings are kept; our own retries log what went wrong (``WorkerAPI._with_retries``)."""
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class WorkerAPI:
    """The worker endpoints of one job, authenticated with its ingest token.

    Every process of a job that talks to the control plane does it through this class (the
    driver, each rank, the Ray Train controller's restart callback), so it quiets the HTTP
    client's per-request log lines where they would start (``quiet_http_client_logs``).

    [Note: replicas] ``api_url`` may name several control-plane replicas, comma-separated
    (``contract.environment.api_urls``). A request that fails to reach one (refused, reset,
    timed out: any transport error) is sent to the next at once, and the one that answered
    stays current for later requests; only when none answers does the error reach the caller,
    which keeps its records and retries as during a database outage. Every worker call is
    idempotent (metrics are unique on job, attempt, rank and step on every replica's shared
    database), so a request that did arrive at a replica that died before answering is
    harmless to send again.
    """

    def __init__(self, api_url: str, job_id: str, token: str, *, timeout_s: float = 10.0,
                 transport: httpx.BaseTransport | None = None):
        quiet_http_client_logs()
        self.job_id = job_id
        self.urls = api_urls(api_url)
        if not self.urls:
            raise ValueError(f"no control-plane URL in {api_url!r}")
        self._current = 0  # index into self.urls of the replica that answered last
        self.failovers = 0
        self.http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s,
                                 transport=transport)

    @property
    def base(self) -> str:
        """The job's endpoints on the current replica."""
        return f"{self.urls[self._current]}/api/v1/jobs/{self.job_id}"

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """``method`` on ``path`` (below the job's endpoints), failing over between replicas."""
        start = self._current
        for turn in range(len(self.urls)):
            index = (start + turn) % len(self.urls)
            try:
                response = self.http.request(method, f"{self.urls[index]}/api/v1/jobs/{self.job_id}{path}", **kwargs)
            except httpx.TransportError as error:
                if turn == len(self.urls) - 1:
                    raise
                log.warning("control plane %s unreachable (%s: %s); trying %s", self.urls[index],
                            type(error).__name__, error, self.urls[(index + 1) % len(self.urls)])
                self.failovers += 1
                continue
            self._current = index
            return response
        raise AssertionError("unreachable")  # the loop returns or raises

    def close(self) -> None:
        self.http.close()

    def post_metrics(self, records: list[dict[str, Any]]) -> httpx.Response:
        """One attempt (on each replica at most); the reporter decides about retries."""
        return self.request("POST", "/metrics", json={"records": records})

    def _with_retries(self, send: Callable[[], httpx.Response], what: str, deadline_s: float) -> httpx.Response:
        deadline = time.monotonic() + deadline_s
        delay = 0.25
        while True:
            try:
                response = send()
                if response.status_code not in RETRYABLE_STATUS:
                    return response
                problem = f"HTTP {response.status_code}"
            except httpx.TransportError as error:
                problem = f"{type(error).__name__}: {error}"
            if time.monotonic() + delay > deadline:
                raise ConnectionError(f"{what}: control plane unreachable for {deadline_s:.0f} s ({problem})")
            log.warning("%s failed (%s); retrying in %.1f s", what, problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def register_checkpoint(self, record: dict[str, Any], deadline_s: float = 120.0) -> None:
        """A committed checkpoint (docs/contracts.md); idempotent on (job, step)."""
        response = self._with_retries(lambda: self.request("POST", "/worker/checkpoints", json=record),
                                      f"registering checkpoint step {record['step']}", deadline_s)
        response.raise_for_status()

    def forget_checkpoint(self, step: int, deadline_s: float = 60.0) -> httpx.Response:
        """Drop a deleted checkpoint's record; 204 also when it is already gone."""
        return self._with_retries(lambda: self.request("DELETE", f"/worker/checkpoints/{step}"),
                                  f"forgetting checkpoint step {step}", deadline_s)

    def report_checkpoint_failure(self, step: int, error: str, deadline_s: float = 60.0) -> None:
        """A checkpoint that was not committed; idempotent (the same report twice is one event)."""
        body = {"step": step, "error": error[-10_000:]}
        response = self._with_retries(lambda: self.request("POST", "/worker/checkpoints/failed", json=body),
                                      f"reporting the failed checkpoint of step {step}", deadline_s)
        response.raise_for_status()

    def post_resized(self, from_workers: int, to_workers: int, deadline_s: float = 60.0) -> None:
        """An elastic worker group now runs with ``to_workers`` ranks instead of ``from_workers``;
        idempotent (the same report twice in one attempt is one event)."""
        body = {"from_workers": from_workers, "to_workers": to_workers}
        response = self._with_retries(lambda: self.request("POST", "/worker/resized", json=body),
                                      f"reporting the resize {from_workers} -> {to_workers}", deadline_s)
        response.raise_for_status()

    def get_preemption(self, deadline_s: float = 30.0) -> dict[str, Any]:
        """``{"requested", "for_job", "grace_left_s", "shrink_to"}``: whether the job is asked to make room
        (service.preemption); polled by rank 0 (workers.preemption)."""
        response = self._with_retries(lambda: self.http.get(f"{self.base}/worker/preemption"),
                                      "asking whether the job is preempted", deadline_s)
        response.raise_for_status()
        return response.json()

    def post_shrunk(self, step: int, workers: int, deadline_s: float = 120.0) -> None:
        """The ranks committed the checkpoint of ``step`` and their group restarts at ``workers``
        from it (an elastic job asked to shrink); idempotent. Raises ``JobNotActive`` when the
        control plane refuses it (409/401)."""
        body = {"step": step, "workers": workers}
        response = self._with_retries(lambda: self.http.post(f"{self.base}/worker/shrunk", json=body),
                                      f"reporting the shrink to {workers} workers at step {step}", deadline_s)
        if response.status_code in (401, 409):
            raise JobNotActive(f"control plane refused the shrink: {response.text}")
        response.raise_for_status()

    def post_preempted(self, step: int, deadline_s: float = 120.0) -> None:
        """The ranks stopped after committing the checkpoint of ``step``: the job queues again;
        idempotent. Raises ``JobNotActive`` when the control plane refuses it (409/401)."""
        response = self._with_retries(lambda: self.http.post(f"{self.base}/worker/preempted", json={"step": step}),
                                      f"reporting the preemption at step {step}", deadline_s)
        if response.status_code in (401, 409):
            raise JobNotActive(f"control plane refused the preemption: {response.text}")
        response.raise_for_status()

    def get_spec(self, deadline_s: float = 120.0) -> dict[str, Any]:
        """``{"job_id", "attempt", "state", "spec", "storage_uri"}``."""
        response = self._with_retries(lambda: self.request("GET", "/worker/spec"), "fetching the job spec",
                                      deadline_s)
        response.raise_for_status()
        return response.json()

    def post_state(self, state: JobState, *, reason: str | None = None, message: str | None = None,
                   attempt: int | None = None, details: str | None = None,
                   deadline_s: float = 120.0) -> dict[str, Any]:
        """Report a state (with FAILED, ``details``: the traceback, bounded here); raises
        ``JobNotActive`` when the control plane refuses it (409/401)."""
        body = {"state": JobState(state).value, "reason": reason, "message": message and message[-10_000:], "attempt": attempt}
        if details:
            body["details"] = bounded_details(details)
        response = self._with_retries(lambda: self.request("POST", "/worker/state", json=body),
                                      f"reporting {state}", deadline_s)
        if response.status_code in (401, 409):
            raise JobNotActive(f"control plane refused {state}: {response.text}")
        response.raise_for_status()
        return response.json()


    def post_memory(self, attempt: int, ranks: list[dict[str, float]], deadline_s: float = 60.0) -> bool:
        """Every rank's measured memory, for the planner's predicted-vs-measured check.

        Best effort: False (and a log line) when the control plane cannot take it, e.g. 409
        because the job has no prediction to compare with.
        """
        body = {"attempt": attempt, "ranks": ranks}
        response = self._with_retries(lambda: self.request("POST", "/worker/memory", json=body),
                                      "reporting measured memory", deadline_s)
        if not response.is_success:
            log.info("measured memory not recorded (HTTP %d): %s", response.status_code, response.text[:300])
        return response.is_success


    def post_step_time(self, report: dict[str, Any], deadline_s: float = 60.0) -> bool:
        """The rates the ranks measured at start and the step time predicted from them
        (``StepTimeReportIn``). Best effort: False (and a log line) when it is not taken."""
        response = self._with_retries(lambda: self.http.post(f"{self.base}/worker/step-time", json=report),
                                      "reporting the predicted step time", deadline_s)
        if not response.is_success:
            log.info("predicted step time not recorded (HTTP %d): %s", response.status_code, response.text[:300])
        return response.is_success


# ----------------------------------------------------------------------------- metrics


class StepMeter:
    """Builds one rank's metric record for a step: every field of the metric table
    (``contract.metrics``), measured by the table's own rules from this step's observations.

    Throughput numbers are this rank's own (its slice of the global batch, what it achieved;
    MFU only over a known device peak, in the run's ``precision``: ``workers.peak_flops``); the
    loss is this rank's mean over its micro-batches.
    """

    def __init__(self, *, rank: int, attempt: int, flops_per_token: float, comm_element_bytes: int,
                 device: Any, precision: str = DEFAULT_PRECISION, world_size: int = 1):
        self.rank, self.attempt, self.world_size = rank, attempt, world_size
        self.flops_per_token = flops_per_token
        self.comm_element_bytes = comm_element_bytes
        self.device = device
        self.peak = peak_flops(device, precision)

    def record(self, *, step: int, loss: float, lr: float, step_time_s: float, samples: int, tokens: int,
               info: StepInfo, memory: MemoryReport, peak_memory_bytes: int, comm_volume: dict[str, int],
               checkpoint_blocked_s: float = 0.0, eval_loss: float | None = None,
               user: dict[str, float] | None = None, comm_bytes: int | None = None) -> dict[str, Any]:
        """The step's record; ``peak_memory_bytes`` the rank's peak so far (``PeakMemoryMeter.peak_growth()``),
        ``eval_loss`` on evaluated steps, ``user`` the scalars the user's code reported
        (``workers.user_metrics``), sent as the record's ``user`` object; ``comm_bytes`` the bytes
        sent (``comm_volume("bytes")["total"]``: ZeRO++'s quantized bytes), else elements x element size."""
        observation = StepObservation(
            loss=loss, lr=lr, grad_norm=_finite_or_none(info.grad_norm), step_time_s=step_time_s,
            samples=samples, tokens=tokens, flops_per_token=self.flops_per_token, peak_flops=self.peak,
            memory=memory, peak_memory_bytes=peak_memory_bytes,
            comm_bytes=comm_volume.get("total", 0) * self.comm_element_bytes if comm_bytes is None else comm_bytes,
            comm_exposed_s=info.comm_exposed_s, checkpoint_blocked_s=checkpoint_blocked_s,
            eval_loss=_finite_or_none(eval_loss), io_read_bytes=info.io_read_bytes,
            io_write_bytes=info.io_write_bytes, io_wait_s=info.io_wait_s,
        )
        record = {"attempt": self.attempt, "rank": self.rank, "step": step, "time": time.time(),
                  "world_size": self.world_size, **record_values(observation)}
        if user:
            record["user"] = dict(user)
        return record


def _finite_or_none(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


# ----------------------------------------------------------------------------- the reporter


class MetricReporter:
    """Buffers records and pushes them in batches from a background thread.

    ``send(records) -> httpx.Response`` is the transport (``WorkerAPI.post_metrics``). 2xx
    means stored (or already stored); a retryable answer or a transport error keeps the batch
    and backs off (0.5 s doubling to ``max_backoff_s``); any other answer (e.g. 401 once the
    job has ended, 422) drops that batch with an error, since sending it again cannot help.
    """

    def __init__(self, send: Callable[[list[dict[str, Any]]], httpx.Response], *, flush_interval_s: float = 1.0,
                 max_buffer: int = 200_000, max_batch: int = 5_000, max_backoff_s: float = 5.0):
        self.send = send
        self.flush_interval_s = flush_interval_s
        self.max_buffer, self.max_batch, self.max_backoff_s = max_buffer, max_batch, max_backoff_s
        self._buffer: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # notified when a batch is answered
        self.answered_through = 0  # the highest step whose record the control plane has answered
        self._awaited_step: int | None = None  # a wait_delivered() in progress, so report() wakes the sender
        self._wake = threading.Event()
        self._closing = threading.Event()
        self.sent = 0
        self.dropped = 0
        self.rejected = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="zerotrain-metrics", daemon=True)
        self._thread.start()

    def report(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._buffer.append(record)
            overflow = len(self._buffer) - self.max_buffer
            for _ in range(max(0, overflow)):
                self._buffer.popleft()
            if overflow > 0:
                self.dropped += overflow
            awaited = self._awaited_step is not None and record.get("step", 0) >= self._awaited_step
        if awaited:
            self._wake.set()  # a checkpoint commit waits for this record: send it now, not in a second
        if overflow > 0:
            log.warning("metric buffer full (%d records): dropped %d oldest, %d dropped in total",
                        self.max_buffer, overflow, self.dropped)

    def extend(self, records: Iterable[dict[str, Any]]) -> None:
        for record in records:
            self.report(record)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._buffer)

    def _take_batch(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._buffer[i] for i in range(min(self.max_batch, len(self._buffer)))]

    def _drop_sent(self, batch: list[dict[str, Any]]) -> None:
        """The control plane answered ``batch`` (stored, duplicate or refused): out of the buffer."""
        with self._lock:  # the batch is still the oldest records unless overflow dropped some
            for record in batch:
                if self._buffer and self._buffer[0] is record:
                    self._buffer.popleft()
            self.answered_through = max([self.answered_through, *(record.get("step", 0) for record in batch)])
            self._answered.notify_all()

    def wait_delivered(self, step: int, timeout_s: float = DELIVERY_WAIT_S) -> bool:
        """Block until the record of ``step`` (and every one before it) has been answered by the
        control plane; False after ``timeout_s`` (see [Note: metrics before checkpoints])."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._awaited_step = step
            self._wake.set()
            try:
                while self.answered_through < step:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        return False
                    self._answered.wait(left)
                return True
            finally:
                self._awaited_step = None

    def _flush_once(self) -> bool:
        """Send the oldest batch; True when the buffer made progress (or is empty)."""
        batch = self._take_batch()
        if not batch:
            return True
        try:
            response = self.send(batch)
        except httpx.TransportError as error:
            self.failures += 1
            log.warning("metric push failed (%s: %s); %d records kept", type(error).__name__, error, self.pending)
            return False
        if response.status_code in RETRYABLE_STATUS:
            self.failures += 1
            log.warning("metric push answered HTTP %d; %d records kept", response.status_code, self.pending)
            return False
        if response.is_success:
            self.sent += len(batch)
        else:
            self.rejected += len(batch)
            log.error("metric push rejected with HTTP %d (%s); dropping %d records",
                      response.status_code, response.text[:300], len(batch))
        self._drop_sent(batch)
        return True

    def _run(self) -> None:
        backoff = 0.0
        while True:
            self._wake.wait(backoff or self.flush_interval_s)
            self._wake.clear()
            while self.pending:
                if not self._flush_once():
                    backoff = min(max(0.5, backoff * 2), self.max_backoff_s) * random.uniform(0.8, 1.2)
                    break
                backoff = 0.0
            if self._closing.is_set() and (not self.pending or self._closing_deadline_passed()):
                return

    def _closing_deadline_passed(self) -> bool:
        return time.monotonic() >= self._deadline

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Push everything buffered now; True if the buffer emptied within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while self.pending and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        return not self.pending

    def close(self, timeout_s: float = 60.0) -> int:
        """Final flush, retrying until ``timeout_s``; returns how many records were left unsent."""
        self._deadline = time.monotonic() + timeout_s
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout_s + 5)
        left = self.pending
        if left:
            log.error("metric reporter closed with %d records unsent (control plane unreachable)", left)
        return left
