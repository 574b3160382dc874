"""The job page's charts are uPlot charts of the API's points: every chart of a job with metrics,
the envelope band of a long job's points (the API's ``series_min``/``series_max``) with its
range in the legend, and the theme's colours in light and dark."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import spec, training_records, with_token
from tests.dashboard.plots import canvas_pixels, hover_step, legend_value, number_text, plot_state

pytestmark = pytest.mark.browser

CHARTS = {"chart-loss", "chart-throughput", "chart-compute", "chart-comm", "chart-exposed"}


def chart_answer(dashboard, job_id: str) -> dict:
    with dashboard.api() as http:
        return http.get(f"/jobs/{job_id}/metrics/chart").raise_for_status().json()


def test_every_chart_of_a_job_is_drawn_by_uplot_from_the_apis_points(dashboard, page):
    job = dashboard.submit(spec("uplot"))
    records = training_records(range(1, 41))
    for record in records:
        record["mfu"] = 0.25 + record["step"] / 1000  # as a GPU with a known peak reports
    job.metrics(records)
    answer = chart_answer(dashboard, job.job_id)
    assert answer["bucket_steps"] == 1 and answer["series"]["step"] == list(range(1, 41))
    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true")

    figures = page.locator(".job-page figure.chart")
    expect(figures).to_have_count(len(CHARTS))
    assert {figures.nth(i).get_attribute("id") for i in range(len(CHARTS))} == CHARTS
    for chart_id in CHARTS:
        chart = page.locator(f"#{chart_id}")
        expect(chart.locator(".uplot canvas")).to_have_count(1)
        expect(chart.locator("svg")).to_have_count(0)
        assert plot_state(chart)["data"][0] == answer["series"]["step"], chart_id

    series = answer["series"]
    loss = plot_state(page.locator("#chart-loss"))
    assert loss["labels"] == ["step", "loss"] and loss["data"][1] == series["loss"]
    assert loss["bands"] == []  # a point per step: no envelope to draw
    expect(page.locator("#chart-loss")).to_have_attribute("data-bands", "0")
    exposed = plot_state(page.locator("#chart-exposed"))
    assert exposed["labels"] == ["step", "exposed communication", "step time"]
    assert exposed["data"][1:] == [series["comm_exposed_s"], series["step_time_s"]]
    compute = plot_state(page.locator("#chart-compute"))
    assert compute["labels"] == ["step", "TFLOPs (all ranks)", "MFU (right axis)"]
    assert compute["scales"][1:] == ["y", "y2"]  # a fraction beside TFLOP/s: an axis of its own
    assert compute["data"][1:] == [series["tflops"], series["mfu"]]
    chart = page.locator("#chart-compute")
    hover_step(page, chart, 30)
    expect(legend_value(chart, "step")).to_have_text("30")
    expect(legend_value(chart, "MFU (right axis)")).to_have_text(f"{100 * series['mfu'][29]:.1f}%")


def test_the_envelope_of_a_long_jobs_points_is_drawn_as_a_band(dashboard, page):
    # 2,000 steps: each of the page's 1,000 points holds 2 steps (the first 3), and every even step spikes
    job = dashboard.submit(spec("long", train__steps=2000))
    records = training_records(range(0, 300))
    for record in records:
        record["loss"] = 3.0 + record["step"] / 1000 + (2.0 if record["step"] % 2 == 0 else 0.0)
    job.metrics(records)
    answer = chart_answer(dashboard, job.job_id)
    assert answer["bucket_steps"] == 3 and answer["series"]["step"][:3] == [2, 4, 6]
    at = answer["series"]["step"].index(152)  # steps 151 and 152 (the spike)
    mean, low, high = (answer[key]["loss"][at] for key in ("series", "series_min", "series_max"))
    assert (low, high) == pytest.approx((3.151, 5.152)) and mean == pytest.approx((3.151 + 5.152) / 2)

    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    chart = page.locator("#chart-loss")
    expect(chart).to_have_attribute("data-bands", "1")
    state = plot_state(chart)
    assert state["labels"] == ["step", "loss", "loss, highest step", "loss, lowest step"]
    assert state["bands"] == [[2, 3]]
    assert state["data"][1:] == [answer["series"]["loss"], answer["series_max"]["loss"], answer["series_min"]["loss"]]

    # the band is painted between the point's lowest and highest step, and nothing beyond them
    inside = canvas_pixels(chart, 152, [(mean + high) / 2, (low + mean) / 2])
    outside = canvas_pixels(chart, 152, [high + 0.1, low - 0.1])
    assert all(pixel[3] > 0 for area in inside for pixel in area), inside
    assert all(any(pixel[3] == 0 for pixel in area) for area in outside), outside
    expect(legend_value(chart, "loss, highest step")).to_be_hidden()  # shown beside the line's value

    hover_step(page, chart, 152)
    expect(legend_value(chart, "step")).to_have_text("152")
    expect(legend_value(chart, "loss")).to_have_text(f"{number_text(mean)} ({number_text(low)}–{number_text(high)})")

    # live steps go on the same chart: one step each, so no width to their envelope
    job.metrics(training_records(range(300, 340)))
    expect(chart).to_have_attribute("data-last-step", "339")
    expect(chart).to_have_attribute("data-bands", "1")


@pytest.mark.parametrize("scheme, colours", [("light", ["#57606a", "#0b57d0"]), ("dark", ["#9da7b3", "#6ea8fe"])])
def test_the_charts_take_the_themes_colours(dashboard, browser, scheme, colours):
    job = dashboard.submit(spec("themed"))
    job.metrics(training_records(range(1, 11)))
    context = browser.new_context(color_scheme=scheme, viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    chart = page.locator("#chart-loss")
    expect(chart.locator(".uplot canvas")).to_have_count(1)
    # the y axis's text in --muted, the first line in --c0
    assert chart.evaluate("f => [f.plot.axes[1].stroke(f.plot, 1), f.plot.series[1].stroke(f.plot, 1)]") == colours
    context.close()
    assert not errors, errors
