"""Fixtures of the browser tests: Debian's Chromium under Playwright, and a live zerotrain
server on PostgreSQL whose jobs the test itself feeds as their workers would.

``dashboard``   a live server (``make_live_service``) whose local launcher runs ``driver.py``;
                ``dashboard.submit(spec, token)`` submits through the API and returns a
                ``Worker`` holding the job's ingest token once its driver reports RUNNING.
``page``        a fresh browser page (own context, so its sessionStorage is empty); any
                JavaScript error on it fails the test.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

DRIVER = str(Path(__file__).with_name("driver.py"))
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "screenshots"

# gpt-nano on two CPU workers at ZeRO-2 in bf16: the page can draw the ZeRO formula's prediction for it.
BASE_SPEC: dict[str, Any] = {
    "name": "nano",
    "model": {"preset": "gpt-nano"},
    "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 64},
    "train": {"steps": 200, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-4},
    "zero": {"stage": 2, "precision": "bf16"},
    "resources": {"num_workers": 2, "gpus_per_worker": 0, "cpus_per_worker": 1},
    "checkpoint": {"every_steps": 100, "keep_last": 2},
}
NANO_PHI = 1_057_152
# ZeRO-2 with two micro-steps per step (8 = 2 ranks x 2 micro-batches x 2): Φ reduce-scattered per
# micro-step, Φ all-gathered once, 2 bytes an element: 6Φ bytes per rank and step.
COMM_BYTES_PER_STEP_PER_PHI = 6


def spec(name: str, **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(BASE_SPEC)
    out["name"] = name
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = out
        for key in parents:
            node = node[key]
        node[leaf] = value
    return out


def training_records(steps: range, *, attempt: int = 0, world: int = 2, stage: int = 2,
                     phi: int = NANO_PHI) -> list[dict[str, Any]]:
    """What ZeRO-2 workers report for gpt-nano: decaying loss, steady throughput, the ZeRO formula's memory."""
    out = []
    for step in steps:
        for rank in range(world):
            wobble = 1 + 0.03 * math.sin(step / 7 + rank)
            out.append({
                "attempt": attempt, "rank": rank, "step": step, "time": 1.7e9 + step,
                "loss": 5.6 * math.exp(-step / 80) + 1.1 + 0.05 * math.sin(step + rank), "lr": 3e-4,
                "grad_norm": 1.0 / (1 + step / 50), "step_time_s": 0.21 * wobble,
                "tokens_per_s": 2400 * wobble, "samples_per_s": 37.5 * wobble, "tflops": 0.009 * wobble,
                "mem_params_bytes": 2 * phi, "mem_grads_bytes": 2 * phi / world + 64 * rank,
                "mem_optimizer_bytes": 12 * phi / world + 64 * rank, "mem_buffers_bytes": 3.1e6,
                "mem_peak_bytes": 2.4e7, "comm_bytes": COMM_BYTES_PER_STEP_PER_PHI * phi, "comm_exposed_s": 0.03 * wobble,
                "checkpoint_blocked_s": 0.0,
            })
    return out


@dataclass
class Worker:
    """The job's workers, played by the test through the real worker endpoints."""

    job_id: str
    http: httpx.Client
    handoff: Path

    def metrics(self, records: list[dict[str, Any]], batch: int = 10_000) -> None:
        for start in range(0, len(records), batch):
            chunk = records[start:start + batch]
            answer = self.http.post("/metrics", json={"records": chunk}).raise_for_status().json()
            assert answer["accepted"] + answer["duplicates"] == len(chunk)

    def checkpoint(self, step: int, world: int = 2, stage: int = 2, size_bytes: int = 12_686_848) -> str:
        uri = f"file:///var/lib/zerotrain/storage/{self.job_id}/checkpoints/step_{step:08d}"
        self.http.post("/worker/checkpoints", json={
            "step": step, "uri": uri, "world_size": world, "stage": stage, "size_bytes": size_bytes,
            "manifest_sha256": f"{step:064x}"}).raise_for_status()
        return uri

    def checkpoint_failed(self, step: int, error: str) -> None:
        self.http.post("/worker/checkpoints/failed", json={"step": step, "error": error}).raise_for_status()

    def memory(self, ranks: list[dict[str, float]], attempt: int = 0) -> None:
        """The end-of-run memory report (``workers.train.report_measured_memory``): one dict per rank."""
        self.http.post("/worker/memory", json={"attempt": attempt, "ranks": ranks}).raise_for_status()

    def step_time(self, report: dict[str, Any]) -> None:
        """The start-of-attempt report (``workers.step_time_start``): the measured rates and the
        step time predicted from them."""
        self.http.post("/worker/step-time", json=report).raise_for_status()

    def state(self, state: str, **extra: Any) -> None:
        self.http.post("/worker/state", json={"state": state, **extra}).raise_for_status()

    def say(self, text: str, timeout: float = 30) -> None:
        """The driver prints ``text`` to the job's log (returns once it has)."""
        path = self.handoff / f"{self.job_id}.say"
        path.with_suffix(".part").write_text(text)
        path.with_suffix(".part").rename(path)
        deadline = time.monotonic() + timeout
        while path.exists():
            assert time.monotonic() < deadline, f"the driver of {self.job_id} did not print what it was given"
            time.sleep(0.02)

    def finish(self, state: str = "SUCCEEDED", **extra: Any) -> None:
        """Let the driver report the final state and exit (as a finished worker group would)."""
        path = self.handoff / f"{self.job_id}.finish"
        path.with_suffix(".part").write_text(json.dumps({"state": state, **extra}))
        path.with_suffix(".part").rename(path)


@dataclass
class Dashboard:
    service: Any
    handoff: Path
    workers: list[Worker] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.service.url

    def api(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=f"{self.url}/api/v1", timeout=30,
                            headers={"Authorization": f"Bearer {token or self.service.admin_token}"})

    def submit(self, job_spec: dict[str, Any], token: str | None = None, timeout: float = 30) -> Worker:
        with self.api(token) as http:
            job = http.post("/jobs", json=job_spec).raise_for_status().json()
        token_file = self.handoff / f"{job['id']}.token"
        deadline = time.monotonic() + timeout
        while not token_file.exists():  # the driver writes it right after reporting RUNNING
            assert time.monotonic() < deadline, f"the driver of {job['id']} did not start"
            time.sleep(0.05)
        http = httpx.Client(base_url=f"{self.url}/api/v1/jobs/{job['id']}", timeout=30,
                            headers={"Authorization": f"Bearer {token_file.read_text()}"})
        worker = Worker(job["id"], http, self.handoff)
        self.workers.append(worker)
        return worker

    def wait_state(self, job_id: str, states: set[str], timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.api() as http:
            while True:
                job = http.get(f"/jobs/{job_id}").raise_for_status().json()
                if job["state"] in states:
                    return job
                assert time.monotonic() < deadline, f"{job_id} stayed {job['state']}, wanted {states}"
                time.sleep(0.05)


@pytest.fixture
def dashboard(make_live_service, tmp_path: Path) -> Iterator[Dashboard]:
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    # A driver gets an allow-listed environment, not ours: a script of this test hands it the folder.
    driver = tmp_path / "driver.py"
    driver.write_text(f"import os, runpy\nos.environ['ZT_DASHBOARD_TEST_DIR'] = {str(handoff)!r}\n"
                      f"runpy.run_path({DRIVER!r}, run_name='__main__')\n")
    board = Dashboard(make_live_service(local_entrypoint=str(driver), storage_uri="file:///var/lib/zerotrain/storage"),
                      handoff)
    yield board
    # Release every driver still waiting (also those of jobs the browser submitted) and let
    # them report before the server stops, so no driver outlives the test.
    started = [path.name.removesuffix(".token") for path in handoff.glob("*.token")]
    for job_id in started:
        if not (handoff / f"{job_id}.finish").exists():
            Worker(job_id, None, handoff).finish("FAILED", reason="test_ended")
    for job_id in started:
        try:
            board.wait_state(job_id, {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=10)
        except AssertionError:
            pass
    for worker in board.workers:
        worker.http.close()


@pytest.fixture(scope="session")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (scripts/ensure-services.sh)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def sign_in(page, url: str, token: str) -> None:
    """Through the login form, as a user would."""
    from playwright.sync_api import expect

    page.goto(url)
    page.get_by_label("API token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Jobs", level=1)).to_be_visible()


def with_token(page, token: str) -> None:
    """Skip the form: put the token where the login form keeps it (for timing a page load)."""
    page.context.add_init_script(f"sessionStorage.setItem('zerotrain.token', {json.dumps(token)})")
