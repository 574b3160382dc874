"""Reading the dashboard's uPlot charts (static/js/step_chart.js) from a browser test: what a
chart drew (its uPlot instance, the figure's ``plot``), the pixels of its canvas, and its live
legend after pointing at a step."""

from __future__ import annotations

from typing import Any


def number_text(value: float) -> str:
    """format.js ``number`` for values in [1e-3, 1000): three significant digits."""
    assert 1e-3 <= abs(value) < 1000, value
    return f"{float(f'{value:.3g}'):g}"


def compact_text(value: float) -> str:
    """format.js ``compact``: 4.80k, 1.23M, ..."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.{2 if abs(value) / scale < 10 else 1}f}{suffix}"
    return number_text(value)


def plot_state(chart) -> dict[str, Any]:
    """The series labels, data columns (x first), scales and bands of the chart's uPlot."""
    return chart.evaluate("""figure => {
        const u = figure.plot;
        if (!u) return null;
        return {labels: u.series.map((s) => s.label), data: u.data.map((c) => Array.from(c)),
                bands: (u.bands || []).map((b) => b.series), scales: u.series.map((s) => s.scale),
                spanGaps: u.series.map((s) => Boolean(s.spanGaps))};
    }""")


def point_at(chart, step: float, value: float, series: int = 1) -> tuple[float, float]:
    """Where (step, value) of uPlot series ``series`` is on the page, in CSS pixels."""
    return tuple(chart.evaluate("""(figure, [step, value, series]) => {
        const u = figure.plot;
        const box = u.over.getBoundingClientRect();
        return [box.left + u.valToPos(step, "x"), box.top + u.valToPos(value, u.series[series].scale)];
    }""", [step, value, series]))


def hover_step(page, chart, step: float) -> None:
    """Point at ``step``, half-way up the plot (scrolled into view first)."""
    chart.locator(".u-over").scroll_into_view_if_needed()
    x, _ = point_at(chart, step, 0)
    box = chart.locator(".u-over").bounding_box()
    page.mouse.move(x, box["y"] + box["height"] / 2)


def legend_value(chart, label: str):
    """The live legend's value cell of the series labelled ``label`` exactly."""
    return chart.locator(".u-legend tr.u-series").filter(
        has=chart.page.get_by_text(label, exact=True)).locator(".u-value")


def canvas_pixels(chart, step: float, values: list[float], series: int = 1) -> list[list[list[int]]]:
    """The canvas's RGBA at ``step`` and each of ``values`` on series ``series``' scale: the 3×3
    device pixels around each point (a line, or a grid line, is a pixel or two wide)."""
    return chart.evaluate("""(figure, [step, values, series]) => {
        const u = figure.plot;
        const x = Math.round(u.valToPos(step, "x", true));
        return values.map((v) => {
            const y = Math.round(u.valToPos(v, u.series[series].scale, true));
            const rgba = Array.from(u.ctx.getImageData(x - 1, y - 1, 3, 3).data);
            return Array.from({length: 9}, (_, i) => rgba.slice(4 * i, 4 * i + 4));
        });
    }""", [step, values, series])


def series_color(chart, series: int) -> list[int]:
    """The RGB of uPlot series ``series``' line."""
    return chart.evaluate("""(figure, series) => {
        const u = figure.plot;
        const probe = document.createElement("canvas").getContext("2d");
        probe.fillStyle = u.series[series].stroke(u, series);
        probe.fillRect(0, 0, 1, 1);
        return Array.from(probe.getImageData(0, 0, 1, 1).data.slice(0, 3));
    }""", series)
