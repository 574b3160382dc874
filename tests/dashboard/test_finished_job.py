"""Must-show 2: the job page of a real finished job — one that restarted once from its
checkpoint — rendered and saved as a screenshot into build/screenshots/ (not committed)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import SCREENSHOTS, spec, training_records, with_token

pytestmark = pytest.mark.browser


def test_finished_job_page_screenshot(dashboard, page):
    job = dashboard.submit(spec("gpt-nano-zero2"))
    job.metrics(training_records(range(1, 131)))
    job.checkpoint_failed(50, "rank 1 could not write …/shard_00001_of_00002.safetensors: gave up after 3 attempts")
    first_uri = job.checkpoint(100)
    job.state("RESTARTING", reason="worker_failed", attempt=1,
              message="rank 1 exited with SIGKILL; restarting the worker group from step 100")
    job.state("RUNNING", attempt=1)
    job.step_time({"attempt": 1, "stage": 2, "offload": False, "step_time_s": 0.5, "compute_time_s": 0.4,
                   "comm_time_s": 0.06, "optimizer_time_s": 0.04, "disk_time_s": None,
                   "calibration": {"compute_flops_per_s": 2e10, "allgather_bytes_per_s": 1e9,
                                   "reduce_scatter_bytes_per_s": 8e8}})
    job.metrics(training_records(range(101, 201), attempt=1))
    job.checkpoint(200)
    measured = {"params": 2.1e6, "grads": 1.06e6, "optimizer": 6.3e6, "buffers": 0.0, "total": 9.5e6,
                "peak": 2.0e7, "peak_construction": 8e6, "peak_forward": 1.9e7, "peak_backward": 2.0e7,
                "peak_step": 1.1e7, "peak_checkpoint": 1.2e7, "peak_resume": 1.0e7}
    job.memory([measured, measured], attempt=1)
    job.finish("SUCCEEDED")
    dashboard.wait_state(job.job_id, {"SUCCEEDED"})

    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true")
    expect(page.locator("#job-state")).to_contain_text("SUCCEEDED")
    expect(page.locator("#chart-loss")).to_have_attribute("data-last-step", "200")
    # the restart replaced steps 101–130 of attempt 0: one point per step, 200 in all
    assert page.locator("#chart-loss").get_attribute("data-points") == "200"
    expect(page.locator("#memory-bars .mem-row")).to_have_count(2)
    # the planner's peak by part of the job, in words, beside rank 0's measurement
    note = page.locator("#memory-prediction-note")
    expect(note).to_contain_text("Predicted peak per rank")
    expect(note).to_contain_text("worst part: ")
    expect(note).to_contain_text("measured on rank 0: 20.0 MB")
    parts = page.locator("#memory-peak-parts")
    expect(parts.locator("tbody tr[data-part='backward'] th")).to_have_text("backward pass")
    expect(parts.locator("tbody tr[data-part='backward'] td").nth(1)).to_have_text("20.0 MB")
    expect(parts.locator("tbody tr[data-part='construction'] th")).to_have_text("model and engine construction")
    timeline = page.locator("#events")
    expect(timeline.locator("[data-to-state='RESTARTING']")).to_contain_text("worker_failed")
    expect(timeline.locator("[data-to-state='RESTARTING']")).to_contain_text("attempt 1")
    expect(timeline.locator("[data-to-state='SUCCEEDED']")).to_have_count(1)
    failed_save = timeline.locator("[data-reason='checkpoint_failed']")
    expect(failed_save).to_have_class("event warning")
    expect(failed_save).to_contain_text("checkpoint of step 50 not committed")
    expect(page.locator("#checkpoints tbody tr")).to_have_count(2)
    expect(page.locator("#log-tail")).to_contain_text("training finished: SUCCEEDED")
    expect(page.locator("#comm-summary")).to_contain_text("efficiency")
    # predicted (at the start of attempt 1, from the ranks' measured rates) against the measured step
    step_time = page.locator("#step-time-summary")
    expect(step_time).to_contain_text("Predicted step time 0.5 s (compute 0.4 s, communication 0.06 s, optimizer 0.04 s")
    expect(step_time).to_contain_text("start of attempt 1")
    expect(step_time).to_contain_text("measured ")

    page.locator("#checkpoints tr[data-step='100']").get_by_role("button", name="Copy URI").click()
    expect(page.locator("#checkpoints tr[data-step='100']").get_by_role("button")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == first_uri

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / "finished-job.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 20_000
