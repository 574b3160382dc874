"""The throughput chart draws a smoothed line over the raw, spiky points, and says what it is."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import spec, training_records, with_token

pytestmark = pytest.mark.browser


def path_values(d: str) -> list[float]:
    """The y coordinates of an SVG path "M x y L x y …" (smaller is higher on the chart)."""
    numbers = [float(part) for part in d.replace("M", " ").replace("L", " ").split()]
    return numbers[1::2]


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
    expect(chart.locator(".legend")).to_contain_text("tokens/s (all ranks), median of 9 points")
    expect(chart).to_contain_text("median over 9 neighbouring points")

    raw = path_values(chart.locator("path[data-series='tokens_per_s']").get_attribute("d"))
    smooth = path_values(chart.locator("path[data-series='smoothed:tokens_per_s']").get_attribute("d"))
    assert len(raw) == len(smooth) == 60
    # the stalled steps dip the raw line far down; the median line stays with the other steps
    assert max(raw) - min(raw) > 10 * (max(smooth) - min(smooth)), (raw, smooth)
    steady = sorted(raw)[len(raw) // 2]
    assert all(abs(y - steady) < 0.1 * abs(max(raw) - min(raw)) for y in smooth)
