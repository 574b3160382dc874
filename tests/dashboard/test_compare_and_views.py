"""Issue 33, Must show 6 in Chromium: two runs compared side by side (both loss curves on one
chart, the spec fields that differ; another user's job named as not visible, its data never
shown), hover values on a job's chart and on the comparison chart, the per-rank log view, and
the dark theme under an emulated `prefers-color-scheme: dark`."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import SCREENSHOTS, spec, training_records, with_token
from tests.dashboard.plots import compact_text, hover_step, legend_value

pytestmark = pytest.mark.browser


def records(steps: range, base: float, eval_every: int = 0) -> list[dict]:
    """Both ranks report loss ``base + step / 100`` (the rank mean on every step is that value),
    and every ``eval_every`` steps an eval loss 0.5 above it."""
    out = training_records(steps)
    for record in out:
        record["loss"] = base + record["step"] / 100
        if eval_every and record["step"] % eval_every == 0:
            record["eval_loss"] = record["loss"] + 0.5
    return out


def loss_text(value: float) -> str:
    """The dashboard's number format (format.js `number`) for values in [1, 1000): 3 significant digits."""
    return f"{float(f'{value:.3g}'):g}"


def test_two_runs_compared_with_hover_values_and_another_users_job_refused(dashboard, page):
    alice = dashboard.service.create_user("alice")
    bob = dashboard.service.create_user("bob")
    a = dashboard.submit(spec("run-a", train__lr=3e-4), token=alice)
    b = dashboard.submit(spec("run-b", train__lr=1e-3, train__steps=100, priority=-2), token=alice)
    hidden = dashboard.submit(spec("bobs-secret-run"), token=bob)
    a.metrics(records(range(1, 51), base=3.0, eval_every=10))
    b.metrics(records(range(1, 31), base=2.0))
    hidden.metrics(records(range(1, 11), base=9.0))

    with_token(page, alice)
    page.goto(dashboard.url)
    rows = page.locator("#jobs-table tbody tr[data-job-id]")
    expect(rows).to_have_count(2)  # alice sees her own jobs only
    expect(page.locator(f"tr[data-job-id='{b.job_id}'] td.priority")).to_have_text("-2")  # the queue's order
    expect(page.locator(f"tr[data-job-id='{a.job_id}'] td.priority")).to_have_text("0")
    compare = page.locator("#compare-selected")
    expect(compare).to_be_disabled()
    page.get_by_label("Compare run-a").check()
    page.get_by_label("Compare run-b").check()
    expect(compare).to_be_enabled()
    compare.click()
    page.wait_for_url(re.compile(r"/jobs/compare\?ids="))
    board = page.locator(".compare-page")
    expect(board).to_have_attribute("data-rendered", "true")
    chart = page.locator("#chart-compare-loss")
    assert chart.get_attribute("data-points") == "50"  # the union of both runs' steps
    legend = chart.locator(".u-legend")
    expect(legend).to_contain_text(f"run-a ({a.job_id}) loss")
    expect(legend).to_contain_text(f"run-b ({b.job_id}) loss")
    expect(legend).to_contain_text(f"run-a ({a.job_id}) eval loss")  # only run-a evaluated
    expect(legend.locator("tr.u-series")).to_have_count(4)  # step, a loss, a eval loss, b loss
    expect(chart.locator("canvas")).to_have_count(1)

    table = page.locator("#compare-diff")
    expect(table.locator("tr[data-field='train.lr'] td")).to_have_text(["0.0003", "0.001"])
    expect(table.locator("tr[data-field='train.steps'] td")).to_have_text(["200", "100"])
    expect(table.locator("tr[data-field='name'] td")).to_have_text(["run-a", "run-b"])
    expect(table.locator("tr[data-field='train.global_batch_size']")).to_have_count(0)  # the same in both

    # Hovering the overlay: the legend shows each run's value at the step under the pointer.
    over = chart.locator(".u-over")
    box = over.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.4, box["y"] + box["height"] / 2)
    values = legend.locator("tr.u-series td.u-value")
    expect(values.first).not_to_have_text("–")
    step = int(values.first.text_content())
    assert 1 <= step <= 30, step  # 40% along steps 1..50
    series_rows = legend.locator("tr.u-series")
    run_a = series_rows.filter(has_text=f"run-a ({a.job_id}) loss").filter(has_not_text="eval")
    run_b = series_rows.filter(has_text=f"run-b ({b.job_id}) loss").filter(has_not_text="eval")
    expect(run_a.locator("td.u-value")).to_have_text(loss_text(3.0 + step / 100))
    expect(run_b.locator("td.u-value")).to_have_text(loss_text(2.0 + step / 100))
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "compare-runs.png"), full_page=True)

    # Bob's job among the ids: named as not visible, and nothing of it reaches the page.
    page.goto(f"{dashboard.url}/jobs/compare?ids={a.job_id},{b.job_id},{hidden.job_id}")
    expect(board).to_have_attribute("data-rendered", "true")
    expect(page.locator(f"#compare-problems li[data-job-id='{hidden.job_id}']")).to_contain_text(
        "no such job, or not one you may see")
    expect(page.locator("#compare-diff thead th")).to_have_count(3)  # the field column and alice's two runs
    assert "bobs-secret-run" not in page.content()

    # One id only: a clear message instead of a chart.
    page.goto(f"{dashboard.url}/jobs/compare?ids={a.job_id}")
    expect(page.locator("#compare-status")).to_contain_text("Choose between 2 and 8 jobs")


def test_hovering_a_job_chart_shows_the_value_at_that_step(dashboard, page):
    job = dashboard.submit(spec("hover"))
    job.metrics(records(range(1, 51), base=3.0))
    with dashboard.api() as http:
        answer = http.get(f"/jobs/{job.job_id}/metrics/chart").raise_for_status().json()
    at = answer["series"]["step"].index(25)
    loss, speed = answer["series"]["loss"][at], answer["series"]["tokens_per_s"][at]
    assert loss == pytest.approx(3.25)  # the ranks' mean of what they reported
    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    chart = page.locator("#chart-loss")
    expect(chart).to_have_attribute("data-last-step", "50")
    expect(legend_value(chart, "loss")).to_have_text("–")  # nothing pointed at yet
    hover_step(page, chart, 25)
    expect(legend_value(chart, "step")).to_have_text("25")
    expect(legend_value(chart, "loss")).to_have_text(loss_text(loss))
    tput = page.locator("#chart-throughput")
    hover_step(page, tput, 25)
    expect(legend_value(tput, "step")).to_have_text("25")
    expect(legend_value(tput, "tokens/s (all ranks)")).to_have_text(compact_text(speed))
    expect(legend_value(chart, "loss")).to_have_text("–")  # the pointer left the loss chart


def test_the_per_rank_log_view_shows_only_that_ranks_lines(dashboard, page):
    job = dashboard.submit(spec("ranks"))
    job.say("(RayTrainWorker pid=1111) zerotrain: this process is rank 0 of 2\n"
            "(RayTrainWorker pid=2222) zerotrain: this process is rank 1 of 2\n"
            "(RayTrainWorker pid=1111) hello from the first rank\n"
            "(RayTrainWorker pid=2222) hello from the second rank\n")
    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    panel = page.locator("#log-tail")
    expect(panel).to_contain_text("hello from the first rank")
    expect(panel).to_contain_text("hello from the second rank")

    page.locator("#log-rank").select_option(label="Rank 1 only")
    expect(panel).to_contain_text("hello from the second rank")
    assert "first rank" not in panel.text_content()
    assert f"driver for {job.job_id}" not in panel.text_content()  # the driver's own lines are no rank's

    # while the job runs the view follows that rank only
    job.say("(RayTrainWorker pid=1111) later line of the first rank\n"
            "(RayTrainWorker pid=2222) later line of the second rank\n")
    expect(panel).to_contain_text("later line of the second rank")
    shown = panel.text_content()
    assert "first rank" not in shown and shown.count("hello from the second rank") == 1

    page.locator("#log-rank").select_option(label="All lines")
    expect(panel).to_contain_text("later line of the first rank")
    expect(panel).to_contain_text(f"driver for {job.job_id}")


def test_the_dark_theme_follows_prefers_color_scheme(dashboard, browser):
    colors = {}
    for scheme in ("light", "dark"):
        context = browser.new_context(color_scheme=scheme, viewport={"width": 1200, "height": 800})
        errors: list[str] = []
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(dashboard.url)
        expect(page.get_by_label("API token")).to_be_visible()
        colors[scheme] = page.evaluate(
            "() => [getComputedStyle(document.documentElement).backgroundColor,"
            " getComputedStyle(document.documentElement).color,"
            " getComputedStyle(document.getElementById('token')).backgroundColor]")
        context.close()
        assert not errors, errors
    assert colors["light"] == ["rgb(247, 248, 250)", "rgb(27, 31, 36)", "rgb(255, 255, 255)"]
    assert colors["dark"] == ["rgb(13, 17, 23)", "rgb(230, 237, 243)", "rgb(13, 17, 23)"]
