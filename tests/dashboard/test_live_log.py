"""The job page's log panel follows the log while the job runs: new lines are appended to what
it shows (however long the log grows past the first read's tail), the last lines after the job
ended are shown, and then it stops asking."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import spec, with_token

pytestmark = pytest.mark.browser


def test_the_log_panel_follows_a_running_job_and_stops_when_it_ends(dashboard, page):
    job = dashboard.submit(spec("log-follow"))
    with_token(page, dashboard.service.admin_token)
    log_reads: list[str] = []
    page.on("request", lambda request: "/logs" in request.url and log_reads.append(request.url))
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true")
    panel = page.locator("#log-tail")
    expect(panel).to_contain_text(f"driver for {job.job_id}")

    job.say("(RayTrainWorker pid=4242) step 10/200  loss 4.1000\n")
    expect(panel).to_contain_text("step 10/200  loss 4.1000")  # appended while the page is open
    # 2,500 lines (≈ 150 kB, past the 64 KiB the first read takes): the panel keeps what it had
    job.say("".join(f"(RayTrainWorker pid=4242) chatty line {n:05d} of the user's code\n" for n in range(2500)))
    expect(panel).to_contain_text("chatty line 02499")
    shown = panel.text_content()
    assert f"driver for {job.job_id}" in shown and "step 10/200" in shown
    assert shown.count("chatty line ") == 2500  # each line once: only what is new is added

    job.finish("SUCCEEDED")
    expect(page.locator("#job-state")).to_contain_text("SUCCEEDED")
    expect(panel).to_contain_text("training finished: SUCCEEDED")
    reads = len(log_reads)
    page.wait_for_timeout(5000)  # more than two poll periods: a finished job's log is not read again
    assert len(log_reads) == reads, log_reads[reads:]
