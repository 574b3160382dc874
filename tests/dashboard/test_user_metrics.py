"""Issue 17, Must show 2 on the job page: eval_loss drawn on the loss chart across the steps
without an evaluation, and "Your metrics" with one line per name the job's code reported --
from the first render and live -- its names shown as text, whatever they contain."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import spec, training_records, with_token
from tests.dashboard.plots import canvas_pixels, legend_value, plot_state, series_color

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
    expect(loss.locator(".uplot canvas")).to_have_count(1)
    state = plot_state(loss)
    assert state["labels"] == ["step", "loss", "eval loss"]
    evaluated = [(step, v) for step, v in zip(state["data"][0], state["data"][2]) if v is not None]
    assert [step for step, _ in evaluated] == [10, 20, 30, 40]  # a point per evaluated step
    # joined across the steps between: the eval line's colour half-way from step 10 to 20
    # (sampled at every step between, as the line is dashed)
    (_, at10), (_, at20) = evaluated[:2]
    colour = series_color(loss, 2)
    hits = sum(
        any(pixel[3] > 128 and all(abs(a - b) < 40 for a, b in zip(pixel, colour)) for pixel in area)
        for step in range(11, 20)
        for area in canvas_pixels(loss, step, [at10 + (at20 - at10) * (step - 10) / 10], series=2))
    assert hits >= 3, hits

    mine = page.locator("#chart-user")
    expect(mine.locator("h3")).to_have_text("Your metrics")
    expect(mine.locator(".u-legend tr.u-series")).to_have_count(4)  # the step and a line per name
    for name in ("accuracy", MARKUP, "__proto__"):
        expect(legend_value(mine, name)).to_have_count(1)
    assert sorted(plot_state(mine)["labels"]) == sorted(["step", "accuracy", MARKUP, "__proto__"])
    expect(mine).to_have_attribute("data-last-step", "40")

    # live: a name that arrives later gets its line; a later step moves the chart
    later = training_records(range(41, 81))
    for record in later:
        record["user"] = {"accuracy": 0.6, "eval/accuracy": 0.55}
    job.metrics(later)
    expect(mine.locator(".u-legend tr.u-series")).to_have_count(5, timeout=15_000)
    expect(legend_value(mine, "eval/accuracy")).to_have_count(1)
    expect(mine).to_have_attribute("data-last-step", "80")

    # nothing a name holds became markup, and no handler ran
    assert page.locator("#chart-user img").count() == 0 and page.locator(".job-page img").count() == 0
    assert page.evaluate("window.__xss") is None
    job.finish("SUCCEEDED")
