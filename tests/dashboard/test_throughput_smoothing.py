"""The throughput chart draws a smoothed line over the raw, spiky points, and says what it is."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import spec, training_records, with_token
from tests.dashboard.plots import compact_text, hover_step, legend_value, plot_state

pytestmark = pytest.mark.browser


def test_the_throughput_chart_has_a_moving_median_over_the_raw_points(dashboard, page):
    job = dashboard.submit(spec("spiky"))
    records = training_records(range(1, 61))
    for record in records:
        if record["step"] % 10 == 5:  # one stalled step in ten: a tenth of the speed
            record["tokens_per_s"] /= 10
    job.metrics(records[:80])  # steps 1-40 before the page opens, the rest live
    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true")
    job.metrics(records[80:])
    chart = page.locator("#chart-throughput")
    expect(chart).to_have_attribute("data-last-step", "60")
    expect(chart).to_contain_text("median over 9 neighbouring points")

    state = plot_state(chart)
    assert state["labels"] == ["step", "tokens/s (all ranks)", "tokens/s (all ranks), median of 9 points"]
    steps, raw, smooth = state["data"]
    assert steps == list(range(1, 61))
    # the stalled steps dip the raw line far down; the median line stays with the other steps
    assert max(raw) - min(raw) > 10 * (max(smooth) - min(smooth)), (raw, smooth)
    steady = sorted(raw)[len(raw) // 2]
    assert all(abs(v - steady) < 0.1 * (max(raw) - min(raw)) for v in smooth)
    # pointing at a stalled step: its own speed, and the median that ignores it
    hover_step(page, chart, 45)
    expect(legend_value(chart, "step")).to_have_text("45")
    assert raw[44] < steady / 5
    expect(legend_value(chart, "tokens/s (all ranks)")).to_have_text(compact_text(raw[44]))
    expect(legend_value(chart, "tokens/s (all ranks), median of 9 points")).to_have_text(compact_text(smooth[44]))
