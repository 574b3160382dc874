"""Must-show 1: sign in, a running job's charts update without a reload, per-rank memory bars
beside the prediction, cancel from the page → CANCELLED; a user sees only their own jobs."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import sign_in, spec, training_records

pytestmark = pytest.mark.browser


def test_running_job_updates_live_and_cancels(dashboard, page):
    alice = dashboard.service.create_user("alice")
    mine = dashboard.submit(spec("alice-nano"), token=alice)
    theirs = dashboard.submit(spec("admins-nano"))  # the admin's: alice must not see it

    page.goto(dashboard.url)
    page.get_by_label("API token").fill("zt_not-a-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#token-error")).to_contain_text("not accepted")
    sign_in(page, dashboard.url, alice)
    expect(page.locator("#whoami")).to_have_text("Signed in as alice")

    row = page.locator(f"tr[data-job-id='{mine.job_id}']")
    expect(row).to_contain_text("RUNNING")
    expect(page.locator(f"tr[data-job-id='{theirs.job_id}']")).to_have_count(0)

    mine.metrics(training_records(range(0, 10)))
    expect(row).to_contain_text("9 / 200")  # the list refreshes itself
    row.get_by_role("link", name="alice-nano").click()
    expect(page.get_by_role("heading", name="alice-nano", level=1)).to_be_visible()
    job_page = page.locator(".job-page")
    expect(job_page).to_have_attribute("data-rendered", "true")
    expect(page.locator("#chart-loss")).to_have_attribute("data-last-step", "9")
    page.evaluate("window.__sameDocument = true")  # gone if anything reloads the page

    mine.metrics(training_records(range(10, 40)))  # the workers report while the page is open
    expect(page.locator("#chart-loss")).to_have_attribute("data-last-step", "39")
    expect(page.locator("#chart-throughput")).to_have_attribute("data-last-step", "39")
    expect(page.locator("#job-progress")).to_contain_text("Step 39 of 200")
    assert page.evaluate("window.__sameDocument") is True
    assert int(page.locator("#chart-loss").get_attribute("data-points")) == 40

    bars = page.locator("#memory-bars .mem-row")
    expect(bars).to_have_count(2)
    for rank in (0, 1):
        segments = page.locator(f".mem-row[data-rank='{rank}'] .mem-seg")
        expect(segments).to_have_count(4)
        assert [segments.nth(i).get_attribute("data-part") for i in range(4)] == ["params", "grads", "optimizer", "buffers"]
    expect(page.locator(".mem-row[data-rank='0'] .mem-marker")).to_have_count(1)
    # the ZeRO formula at stage 2, N = 2, bf16: 2Φ + 14Φ/2 = 9Φ = 9,514,368 bytes = 9.51 MB (decimal, as the CLI)
    expect(page.locator("#memory-prediction-note")).to_contain_text("9.51 MB")
    expect(page.locator("#memory-prediction-note")).to_contain_text("stage 2")
    expect(page.locator("#chart-comm")).to_contain_text("ZeRO formula")
    # the whole step's bytes, both micro-steps' reduce-scatters included: 6Φ = 6,342,912 B
    expect(page.locator("#comm-summary")).to_contain_text("expects 6.34 MB per rank per step")
    expect(job_page).not_to_contain_text("§")  # plain words: no section signs of a design document
    expect(job_page).not_to_contain_text("MiB")

    page.get_by_role("button", name="Cancel job").focus()  # keyboard, not the mouse
    page.keyboard.press("Enter")
    expect(page.locator("#job-state")).to_contain_text("CANCELLED", timeout=20_000)
    expect(page.locator("#events")).to_contain_text("cancelled_by_user")
    expect(page.get_by_role("button", name="Cancel job")).to_be_hidden()
    assert dashboard.wait_state(mine.job_id, {"CANCELLED"})["state"] == "CANCELLED"

    page.goto(f"{dashboard.url}/jobs/{theirs.job_id}")  # another user's job, by URL
    expect(page.get_by_role("heading", name="Job not available")).to_be_visible()
    expect(page.get_by_role("alert")).to_contain_text("not found")
