"""The dashboard's job page opened cold in Chromium, timed to its first rendered chart.

Used by ``benchmarks.metrics_scale`` (issue 36, must show 3): each load is a fresh browser
context (no cache, no session: the shell, the modules and every request fetched anew), the page
opened by URL, timed until the page marks itself rendered (``data-rendered``: the charts'
frame drawn, ``service/dashboard/static/js/job_page.js``) -- the measure of
``tests/dashboard/test_scale.py``'s ``_cold_load``, on Debian's Chromium under Playwright.
"""

from __future__ import annotations

import json
import statistics
import time

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def cold_loads(base: str, token: str, job_id: str, loads: int) -> dict:
    """``loads`` cold loads of ``base``'s page of ``job_id`` (after one unmeasured warm-up of
    the browser and the server): each load's wall time, the page's own navigation-to-render
    time, when the chart answer arrived and what the page took from then to its first render
    (the browser's share), and its three slowest requests; the median and min–max of the wall
    times."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            warm = browser.new_context()
            warm.new_page().goto(base)
            warm.close()
            each = [_cold_load(browser, expect, base, token, job_id) for _ in range(loads)]
        finally:
            browser.close()
    walls = [load["wall_ms"] for load in each]
    return {"loads": each, "median_wall_ms": statistics.median(walls), "min_wall_ms": min(walls),
            "max_wall_ms": max(walls), "points_drawn": each[-1]["points_drawn"]}


def _cold_load(browser, expect, base: str, token: str, job_id: str) -> dict:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        context.add_init_script(f"sessionStorage.setItem('zerotrain.token', {json.dumps(token)})")
        page = context.new_page()
        started = time.perf_counter()
        page.goto(f"{base}/jobs/{job_id}")
        expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true", timeout=60_000)
        wall_ms = (time.perf_counter() - started) * 1000
        slowest = page.evaluate("""performance.getEntriesByType('resource')
            .map((r) => [r.name.replace(location.origin, ''), Math.round(r.responseEnd - r.startTime)])
            .sort((a, b) => b[1] - a[1]).slice(0, 3)""")
        chart_end = page.evaluate("""performance.getEntriesByType('resource')
            .filter((r) => r.name.includes('/metrics/chart')).map((r) => r.responseEnd)[0] ?? null""")
        rendered_at = float(page.locator(".job-page").get_attribute("data-rendered-at-ms"))
        return {"wall_ms": round(wall_ms, 1), "navigation_to_render_ms": rendered_at,
                "chart_answered_at_ms": None if chart_end is None else round(chart_end, 1),
                "render_after_chart_ms": None if chart_end is None else round(rendered_at - chart_end, 1),
                "points_drawn": int(page.locator("#chart-loss").get_attribute("data-points")),
                "slowest_requests_ms": slowest}
    finally:
        context.close()
