/**
 * A chart of several runs on one step axis, drawn by uPlot (vendored: static/vendor/uplot/,
 * loaded by the page shell as the global `uPlot`). uPlot's legend is live: moving the pointer
 * over the plot shows, per series, its value at the step under the pointer, so each run's
 * number reads off without guessing from the axis.
 *
 * [Note: runs log different steps (another length, another eval interval). The x values are
 * the union of every run's steps; a run's value is null on a step it lacks, and `spanGaps`
 * joins its line across those, so one run's steps never break another's line.]
 */

import { h } from "./dom.js";
import { number } from "./format.js";

const COLORS = 4; // --c0 … --c3 in dashboard.css
const HEIGHT = 280;

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

/** [steps, ...one column per series]: the union of the runs' steps, null where a run has none. */
export function alignRuns(runs, series) {
  const steps = [...new Set(runs.flatMap((r) => r.series.step || []))].sort((a, b) => a - b);
  const at = new Map(steps.map((s, i) => [s, i]));
  const columns = series.map((s) => {
    const run = runs.find((r) => r.job === s.job);
    const column = new Array(steps.length).fill(null);
    const xs = (run && run.series.step) || [];
    const ys = (run && run.series[s.field]) || [];
    xs.forEach((step, i) => {
      if (Number.isFinite(ys[i])) column[at.get(step)] = ys[i];
    });
    return column;
  });
  return [steps, ...columns];
}

export class OverlayChart {
  /**
   * @param {object} options
   * @param {string} options.id      stable id (tests and anchors use it)
   * @param {string} options.title   the figure caption
   * @param {Array<{label:string, job:string, field:string, color:number, sparse?:boolean}>} options.series
   */
  constructor({ id, title, series, format = number }) {
    this.title = title;
    this.series = series;
    this.format = format;
    this.plotSlot = h("div", { class: "uplot-slot" });
    this.summary = h("p", { class: "chart-summary" });
    this.element = h("figure", { class: "chart overlay-chart", id, "data-points": "0" }, h("figcaption", {}, h("h3", { text: title })), this.plotSlot, this.summary,
      h("p", { class: "muted small", text: "Point at the chart to read each run's value at that step in the legend." }));
    this.plot = null;
  }

  setRuns(runs) {
    const data = alignRuns(runs, this.series);
    const fmt = (u, v) => (v === null || v === undefined ? "–" : this.format(v));
    const axis = { stroke: cssVar("--muted"), grid: { stroke: cssVar("--line"), width: 1 }, ticks: { stroke: cssVar("--line") } };
    const options = {
      width: 640,
      height: HEIGHT,
      scales: { x: { time: false } },
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      axes: [{ ...axis, label: "step" }, { ...axis }],
      series: [
        { label: "step", value: (u, v) => (v === null || v === undefined ? "–" : String(v)) },
        ...this.series.map((s) => ({
          label: s.label,
          stroke: cssVar(`--c${s.color % COLORS}`),
          width: s.sparse ? 1.5 : 2,
          dash: s.sparse ? [6, 4] : undefined,
          spanGaps: true,
          points: { show: Boolean(s.sparse) },
          value: fmt,
        })),
      ],
    };
    if (this.plot) this.plot.destroy();
    this.plot = new window.uPlot(options, data, this.plotSlot);
    this.fit();
    if (!this.resize) {
      this.resize = new ResizeObserver(() => this.fit());
      this.resize.observe(this.plotSlot);
    }
    const steps = data[0];
    this.element.dataset.points = String(steps.length);
    this.element.dataset.series = String(this.series.length);
    const latest = this.series.map((s, k) => {
      const col = data[k + 1];
      for (let i = col.length - 1; i >= 0; i -= 1) if (col[i] !== null) return `${s.label} ${this.format(col[i])} at step ${steps[i]}`;
      return `${s.label}: no data`;
    });
    this.summary.textContent = `Latest: ${latest.join(" · ")}`;
    this.plotSlot.setAttribute("role", "img");
    this.plotSlot.setAttribute("aria-label", `${this.title}: ${latest.join("; ")}.`);
  }

  fit() {
    const width = Math.max(320, Math.floor(this.plotSlot.clientWidth));
    if (this.plot && width !== this.plot.width) this.plot.setSize({ width, height: HEIGHT });
  }
}
