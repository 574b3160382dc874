"""Issue 17, Must show 2 on the job page: eval_loss drawn on the loss chart across the steps
without an evaluation, and "Your metrics" with one line per name the job's code reported --
from the first render and live -- its names shown as text, whatever they contain."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import spec, training_records, with_token

pytestmark = pytest.mark.browser

MARKUP = '<img src=x onerror="window.__xss = 1">'


def with_evaluation(records: list[dict], every: int) -> list[dict]:
    for record in records:
        record["user"] = {"accuracy": 0.5 + record["step"] / 1000, MARKUP: 1.0, "__proto__": 2.0}
        if record["step"] % every == 0:
            record["eval_loss"] = record["loss"] + 0.2
    return records


def test_eval_loss_and_the_users_metrics_are_drawn_and_names_stay_text(dashboard, page):
    job = dashboard.submit(spec("evaluated", train__steps=60))
    job.metrics(with_evaluation(training_records(range(1, 41)), every=10))
    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true")

    loss = page.locator("#chart-loss")
    expect(loss.locator("path[data-series='eval_loss']")).to_have_count(1)
    # one marker per evaluated step, joined into one line (no gap restarts it: a single "M")
    expect(loss.locator("g.markers[data-series='eval_loss'] circle")).to_have_count(4)
    assert loss.locator("path[data-series='eval_loss']").get_attribute("d").count("M") == 1
    expect(loss.locator(".legend")).to_contain_text("eval loss")

    mine = page.locator("#chart-user")
    expect(mine.locator("h3")).to_have_text("Your metrics")
    expect(mine.locator(".legend li")).to_have_count(3)
    for name in ("accuracy", MARKUP, "__proto__"):
        expect(mine.locator(".legend")).to_contain_text(name)
    expect(mine.locator("path.line")).to_have_count(3)
    expect(mine).to_have_attribute("data-last-step", "40")

    # live: a name that arrives later gets its line; a later step moves the chart
    later = training_records(range(41, 81))
    for record in later:
        record["user"] = {"accuracy": 0.6, "eval/accuracy": 0.55}
    job.metrics(later)
    expect(mine.locator(".legend li")).to_have_count(4, timeout=15_000)
    expect(mine.locator(".legend")).to_contain_text("eval/accuracy")
    expect(mine).to_have_attribute("data-last-step", "80")

    # nothing a name holds became markup, and no handler ran
    assert page.locator("#chart-user img").count() == 0 and page.locator(".job-page img").count() == 0
    assert page.evaluate("window.__xss") is None
    job.finish("SUCCEEDED")
