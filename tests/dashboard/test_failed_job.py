"""Issue 17, Must show 4: a failed job's page shows the summary line with the user's frames
under it and the full traceback folded behind a <details>, as text whatever it holds; its
memory and communication panels speak without "§"."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import SCREENSHOTS, spec, training_records, with_token

pytestmark = pytest.mark.browser

MESSAGE = ("building the model failed: ValueError: layers must be at least 1, got 0\n"
           '  File "/tmp/ray/session/runtime_resources/working_dir_files/pkg/my_project/model.py", line 71, in build\n'
           '    raise ValueError(f"layers must be at least 1, got {layers}")')
MARKUP = '<img src=x onerror="window.__xss = 1">'
DETAILS = "\n".join([
    "Traceback (most recent call last):",
    '  File "/srv/zerotrain/workers/launch.py", line 79, in run',
    "    runtime.fit(spec, loop_config)",
    *(f'  File "/srv/ray/train/frame_{i}.py", line {i}, in call_{i}' for i in range(40)),
    f"ray.train.WorkerGroupError: Training failed on rank 0: {MARKUP}",
    "ValueError: layers must be at least 1, got 0",
])


def test_a_failed_jobs_page_folds_the_traceback_behind_its_summary(dashboard, page):
    job = dashboard.submit(spec("broken-factory"))
    job.metrics(training_records(range(1, 3)))
    job.finish("FAILED", reason="user_code_error", message=MESSAGE, details=DETAILS)
    stored = dashboard.wait_state(job.job_id, {"FAILED"})
    assert stored["details"] == DETAILS and stored["message"] == MESSAGE

    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true")
    expect(page.locator("#job-state")).to_contain_text("FAILED")

    # the summary: one line, then the user's innermost frame on lines of their own
    expect(page.locator("#job-reason")).to_have_text(
        "Reason: user_code_error — building the model failed: ValueError: layers must be at least 1, got 0")
    frames = page.locator("#job-reason-frames")
    expect(frames).to_be_visible()
    assert frames.inner_text().splitlines()[0].strip().startswith('File "/tmp/ray/session/')
    assert "in build" in frames.inner_text() and "raise ValueError" in frames.inner_text().splitlines()[1]

    # the whole traceback: folded until asked for, then shown line by line, as text
    fold = page.locator("details#job-details")
    expect(fold).to_be_visible()
    expect(fold).not_to_have_attribute("open", "")
    traceback = fold.locator("pre#job-traceback")
    expect(traceback).to_be_hidden()
    fold.locator("summary").click()
    expect(traceback).to_be_visible()
    assert traceback.inner_text() == DETAILS
    assert fold.locator("img").count() == 0 and page.evaluate("window.__xss") is None

    # plain words in the memory and communication panels
    memory = page.locator("section[aria-labelledby='h-memory']")
    communication = page.locator("section[aria-labelledby='h-comm']")
    expect(memory.locator("#memory-bars .mem-row")).to_have_count(2)
    expect(communication.locator("#comm-summary")).not_to_be_empty()
    for panel in (memory, communication):
        assert "§" not in panel.inner_text() and "§" not in panel.inner_html()

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "failed-job.png"), full_page=True)


def test_a_job_that_succeeded_has_no_fold(dashboard, page):
    job = dashboard.submit(spec("fine"))
    job.metrics(training_records(range(1, 3)))
    job.finish("SUCCEEDED")
    dashboard.wait_state(job.job_id, {"SUCCEEDED"})
    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true")
    expect(page.locator("#job-reason")).to_have_text("Reason: driver_reported")
    expect(page.locator("details#job-details")).to_be_hidden()
    expect(page.locator("#job-reason-frames")).to_be_hidden()
