/**
 * Small SVG line charts, written here rather than vendored: the dashboard draws at most a
 * thousand points per series (the server downsamples), so a polyline per series is fast and
 * keeps the page free of a charting dependency. Each chart is a <figure> whose SVG carries an
 * aria-label with the latest values, so it reads without sight; series differ by dash pattern
 * as well as colour. Pointing at a chart marks the nearest step and shows every series' value
 * there in the readout under it. (The comparison page's overlay, which needs a live legend of
 * many runs, is drawn by the vendored uPlot instead: overlay_chart.js.)
 */

import { h, svg } from "./dom.js";
import { number } from "./format.js";

const WIDTH = 640;
const HEIGHT = 220;
const PAD = { left: 58, right: 58, top: 12, bottom: 34 };

/** Round numbers for axis ticks (the 1-2-5 ladder). */
export function niceTicks(lo, hi, count = 4) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [];
  if (lo === hi) {
    const pad = Math.abs(lo) * 0.1 || 1;
    lo -= pad;
    hi += pad;
  }
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.floor(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  if (ticks[0] > lo) ticks.unshift(ticks[0] - step);
  if (ticks[ticks.length - 1] < hi) ticks.push(ticks[ticks.length - 1] + step);
  return ticks;
}

export class LineChart {
  /**
   * @param {object} options
   * @param {string} options.id        stable id (tests and anchors use it)
   * @param {string} options.title     the figure caption
   * @param {Array<{key:string,label:string,axis?:"left"|"right",format?:Function,className?:string,sparse?:boolean}>} options.series
   *   a `sparse` series has values on some steps only (eval_loss): its points are marked and
   *   joined across the steps between, where a dense series breaks its line at a gap
   * @param {boolean} [options.zeroBased] the y axes start at 0
   */
  constructor({ id, title, series, xLabel = "step", description = "", zeroBased = false }) {
    this.id = id;
    this.zeroBased = zeroBased; // rates and sizes start at 0, so a 2% wobble does not look like a cliff
    this.title = title;
    this.series = series.map((s, i) => ({ axis: "left", format: number, className: `series-${i}`, ...s }));
    this.xLabel = xLabel;
    this.points = [];
    this.pending = false;
    this.svg = svg("svg", {
      viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
      role: "img",
      class: "chart-svg",
      preserveAspectRatio: "xMidYMid meet",
    });
    this.summary = h("p", { class: "chart-summary" });
    this.readout = h("p", { class: "chart-readout", "aria-hidden": "true" });
    this.view = null; // what the last render drew: the hover maps a pointer to a step with it
    this.guide = null;
    this.svg.addEventListener("pointermove", (event) => this.hoverAt(event));
    this.svg.addEventListener("pointerleave", () => this.clearHover());
    const legend = h(
      "ul",
      { class: "legend", "aria-hidden": "true" },
      this.series.map((s) =>
        h("li", {}, h("span", { class: `swatch ${s.className}` }), `${s.label}${s.axis === "right" ? " (right axis)" : ""}`),
      ),
    );
    this.element = h(
      "figure",
      { class: "chart", id, "data-points": "0" },
      h("figcaption", {}, h("h3", { text: title }), legend),
      this.svg,
      this.readout,
      this.summary,
      description ? h("p", { class: "muted small", text: description }) : null,
    );
    this.render();
  }

  /** Replace all points; each point is {step, <series key>: number|null}. */
  setData(points) {
    this.points = points;
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.render();
    });
  }

  visibleSeries() {
    return this.series.filter((s) => this.points.some((p) => Number.isFinite(p[s.key])));
  }

  render() {
    const points = this.points;
    const shown = this.visibleSeries();
    this.element.dataset.points = String(points.length);
    this.element.dataset.lastStep = points.length ? String(points[points.length - 1].step) : "";
    this.svg.replaceChildren();
    this.guide = null;
    this.view = null;
    if (!points.length || !shown.length) {
      this.svg.append(svg("text", { x: WIDTH / 2, y: HEIGHT / 2, "text-anchor": "middle", class: "chart-empty", text: "no data yet" }));
      this.svg.setAttribute("aria-label", `${this.title}: no data yet`);
      this.summary.textContent = "No data yet.";
      return;
    }
    const xs = points.map((p) => p.step);
    const x0 = Math.min(...xs);
    const x1 = Math.max(...xs);
    const xTicks = niceTicks(x0, x1 === x0 ? x0 + 1 : x1, 5).filter((t) => t >= x0 && t <= Math.max(x1, x0 + 1));
    const sx = (x) => PAD.left + ((x - x0) / (x1 - x0 || 1)) * (WIDTH - PAD.left - PAD.right);
    const axes = {};
    for (const side of ["left", "right"]) {
      const values = [];
      for (const s of shown.filter((s) => s.axis === side)) for (const p of points) if (Number.isFinite(p[s.key])) values.push(p[s.key]);
      if (!values.length) continue;
      let lo = Math.min(...values);
      let hi = Math.max(...values);
      if (lo > 0 && (this.zeroBased || lo / (hi || 1) < 0.5)) lo = 0;
      const floor = Math.abs(hi) * 0.02; // equal-looking values stay flat, not stretched to fill
      if (hi - lo < floor) {
        const mid = (hi + lo) / 2;
        lo = mid - floor / 2;
        hi = mid + floor / 2;
      }
      const ticks = niceTicks(lo, hi, 4);
      const t0 = ticks[0];
      const t1 = ticks[ticks.length - 1];
      axes[side] = { ticks, scale: (v) => HEIGHT - PAD.bottom - ((v - t0) / (t1 - t0 || 1)) * (HEIGHT - PAD.top - PAD.bottom) };
    }
    const grid = svg("g", { class: "grid" });
    const primary = axes.left || axes.right;
    for (const t of primary.ticks) {
      const y = primary.scale(t);
      grid.append(svg("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y, y2: y }));
    }
    this.svg.append(grid);
    for (const [side, axis] of Object.entries(axes)) {
      const fmt = shown.find((s) => s.axis === side).format;
      const g = svg("g", { class: `axis axis-${side}` });
      for (const t of axis.ticks) {
        const x = side === "left" ? PAD.left - 6 : WIDTH - PAD.right + 6;
        g.append(svg("text", { x, y: axis.scale(t) + 4, "text-anchor": side === "left" ? "end" : "start", text: fmt(t) }));
      }
      this.svg.append(g);
    }
    const xAxis = svg("g", { class: "axis axis-x" });
    for (const t of xTicks) xAxis.append(svg("text", { x: sx(t), y: HEIGHT - PAD.bottom + 16, "text-anchor": "middle", text: number(t, 6) }));
    xAxis.append(svg("text", { x: WIDTH / 2, y: HEIGHT - 4, "text-anchor": "middle", class: "axis-title", text: this.xLabel }));
    this.svg.append(xAxis);
    const labels = [];
    for (const s of shown) {
      const scale = axes[s.axis].scale;
      let d = "";
      let pen = "M";
      let last = null;
      const marks = s.sparse ? svg("g", { class: `markers ${s.className}`, "data-series": s.key }) : null;
      for (const p of points) {
        const v = p[s.key];
        if (!Number.isFinite(v)) {
          if (!s.sparse) pen = "M";
          continue;
        }
        d += `${pen}${sx(p.step).toFixed(1)} ${scale(v).toFixed(1)}`;
        if (marks) marks.append(svg("circle", { cx: sx(p.step).toFixed(1), cy: scale(v).toFixed(1), r: 2.5 }));
        pen = "L";
        last = p;
      }
      this.svg.append(svg("path", { d, class: `line ${s.className}`, "data-series": s.key }));
      if (marks) this.svg.append(marks);
      if (last) labels.push(`${s.label} ${s.format(last[s.key])} at step ${last.step}`);
    }
    this.view = { points, shown, x0, x1, sx };
    const text = `${this.title}, ${points.length} points up to step ${x1}: ${labels.join("; ")}.`;
    this.svg.setAttribute("aria-label", text);
    this.summary.textContent = `Latest: ${labels.join(" · ")}`;
  }

  /** The point nearest the pointer's step: a guide line at it and its values in the readout. */
  hoverAt(event) {
    const view = this.view;
    if (!view) return;
    const rect = this.svg.getBoundingClientRect();
    const x = ((event.clientX - rect.left) / (rect.width || 1)) * WIDTH;
    const step = view.x0 + ((x - PAD.left) / (WIDTH - PAD.left - PAD.right)) * (view.x1 - view.x0);
    let best = view.points[0];
    for (const p of view.points) if (Math.abs(p.step - step) < Math.abs(best.step - step)) best = p;
    const values = view.shown.filter((s) => Number.isFinite(best[s.key])).map((s) => `${s.label} ${s.format(best[s.key])}`);
    this.readout.textContent = `Step ${best.step}: ${values.join(" · ") || "no value"}`;
    this.element.dataset.hoverStep = String(best.step);
    if (!this.guide) {
      this.guide = svg("line", { class: "guide", y1: PAD.top, y2: HEIGHT - PAD.bottom });
      this.svg.append(this.guide);
    }
    const gx = view.sx(best.step).toFixed(1);
    this.guide.setAttribute("x1", gx);
    this.guide.setAttribute("x2", gx);
  }

  clearHover() {
    this.readout.textContent = "";
    delete this.element.dataset.hoverStep;
    if (this.guide) this.guide.remove();
    this.guide = null;
  }
}
