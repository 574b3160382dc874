/**
 * Line charts over the step axis, drawn by uPlot (vendored: static/vendor/uplot/, loaded by the
 * page shell as the global `uPlot`): every chart of the job page, one series per metric, and
 * the comparison page's overlay, one series per run. uPlot's legend is live: pointing at the
 * plot shows each series' value at the step under the pointer. Series differ by dash pattern as
 * well as colour, and the plot carries an aria-label with the latest values, so a chart reads
 * without sight. The figure's `plot` property is the uPlot instance (the browser tests read it).
 *
 * [Note: envelopes] A point of a long job stands for a bucket of steps (service/chart_series.py):
 * its value is the bucket's mean, and the API sends the bucket's lowest and highest step value
 * beside it. A series with `envelope: {min, max}` (the points' keys of those) draws that range
 * as a faint band around its line -- two invisible uPlot series with a band between them -- so
 * a spike of one step shows however many steps a point holds, and the legend shows the range
 * after the value. Where every point holds one step the band has no width and is left out.
 */

import { h, replaceChildren } from "./dom.js";
import { number } from "./format.js";

const COLORS = 4; // --c0 … --c3 in dashboard.css
const DASHES = [undefined, [6, 4], [2, 3], [8, 2, 2, 2]];
const BAND_ALPHA = 0.2;
const FAINT_ALPHA = 0.45;
const DARK = window.matchMedia("(prefers-color-scheme: dark)");

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

/** `#rrggbb` at opacity `alpha` (any other colour is returned as it is). */
function translucent(color, alpha) {
  const m = /^#([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})$/i.exec(color);
  return m ? `rgba(${parseInt(m[1], 16)}, ${parseInt(m[2], 16)}, ${parseInt(m[3], 16)}, ${alpha})` : color;
}

const column = (points, key) => points.map((p) => (Number.isFinite(p[key]) ? p[key] : null));

/** A y range from the data's: from 0 for rates and sizes (or values far from 0 but spread
 * over more than half of it), and nearly equal values kept flat, not stretched to fill. */
function yRange(zeroBased) {
  return (u, lo, hi) => {
    if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [0, 1];
    if (lo > 0 && (zeroBased || lo / hi < 0.5)) lo = 0;
    const floor = Math.abs(hi) * 0.02 || 1;
    if (hi - lo < floor) {
      const mid = (hi + lo) / 2;
      [lo, hi] = [mid - floor / 2, mid + floor / 2];
    }
    const pad = (hi - lo) * 0.05;
    return [lo === 0 ? 0 : lo - pad, hi + pad];
  };
}

export class StepChart {
  /**
   * @param {object} options
   * @param {string} options.id        stable id (tests and anchors use it)
   * @param {string} options.title     the figure caption
   * @param {Array<{key:string, label:string, format?:Function, axis?:"left"|"right", color?:number,
   *   dash?:number[], sparse?:boolean, join?:boolean, width?:number, faint?:boolean, envelope?:{min:string, max:string}}>} options.series
   *   `color` indexes --c0 … --c3 and `dash` is the line's pattern (both by the series' place
   *   unless given); a `sparse` series has values on some steps only (eval_loss): its points
   *   are marked and joined across the steps between, where a dense series breaks at a gap
   *   (`join` joins one without marks); a `faint` one is drawn thin and light
   * @param {boolean} [options.zeroBased] the y axes start at 0
   */
  constructor({ id, title, series, description = "", zeroBased = false, height = 240 }) {
    this.title = title;
    this.zeroBased = zeroBased;
    this.height = height;
    this.series = series.map((s, i) => ({ format: number, axis: "left", color: i, dash: DASHES[i % DASHES.length], width: 2, ...s }));
    this.points = [];
    this.pending = false;
    this.plot = null;
    this.layout = null; // which series and bands the plot was built with
    this.plotSlot = h("div", { class: "uplot-slot" });
    this.summary = h("p", { class: "chart-summary" });
    this.element = h("figure", { class: "chart", id, "data-points": "0" },
      h("figcaption", {}, h("h3", { text: title })), this.plotSlot, this.summary,
      description ? h("p", { class: "muted small", text: description }) : null);
    this.resize = new ResizeObserver(() => this.fit());
    this.resize.observe(this.plotSlot);
    this.render();
  }

  /** Replace all points; each point is {step, <series or envelope key>: number|null}. */
  setData(points) {
    this.points = points;
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      if (!this.ended) this.render();
    });
  }

  render() {
    const points = this.points;
    const shown = this.series.filter((s) => points.some((p) => Number.isFinite(p[s.key])));
    const banded = shown.filter((s) => s.envelope && points.some((p) => p[s.envelope.min] < p[s.envelope.max]));
    this.element.dataset.points = String(points.length);
    this.element.dataset.lastStep = points.length ? String(points[points.length - 1].step) : "";
    if (!shown.length) {
      this.drop();
      replaceChildren(this.plotSlot, h("p", { class: "chart-empty muted", text: "No data yet." }));
      this.plotSlot.setAttribute("aria-label", `${this.title}: no data yet`);
      this.summary.textContent = "No data yet.";
      return;
    }
    const data = [points.map((p) => p.step), ...shown.map((s) => column(points, s.key)),
      ...banded.flatMap((s) => [column(points, s.envelope.max), column(points, s.envelope.min)])];
    const layout = [DARK.matches, ...shown.map((s) => s.key), "|", ...banded.map((s) => s.key)].join("\n");
    if (this.plot && layout === this.layout) this.plot.setData(data);
    else this.build(shown, banded, data, layout);
    const latest = shown.map((s) => {
      for (let i = points.length - 1; i >= 0; i -= 1) if (Number.isFinite(points[i][s.key])) return `${s.label} ${s.format(points[i][s.key])} at step ${points[i].step}`;
      return `${s.label}: no data`;
    });
    this.summary.textContent = `Latest: ${latest.join(" · ")}`;
    this.plotSlot.setAttribute("aria-label", `${this.title}, ${points.length} points: ${latest.join("; ")}.`);
  }

  /** A new uPlot for these series: the theme's colours, one y scale per side in use, the bands. */
  build(shown, banded, data, layout) {
    this.drop();
    const text = (fmt) => (u, v) => (v === null || v === undefined ? "–" : fmt(v));
    const axis = { stroke: cssVar("--muted"), grid: { stroke: cssVar("--grid"), width: 1 }, ticks: { stroke: cssVar("--line") }, font: "11px system-ui, sans-serif" };
    const sides = ["left", "right"].filter((side) => shown.some((s) => s.axis === side));
    const scale = (s) => (s.axis === "right" && sides.length === 2 ? "y2" : "y");
    const scales = { x: { time: false } };
    for (const key of sides.map((side, k) => (k ? "y2" : "y"))) scales[key] = { range: yRange(this.zeroBased) };
    const axes = [{ ...axis, label: "step" }, ...sides.map((side, k) => {
      const fmt = shown.find((s) => s.axis === side).format;
      return { ...axis, scale: k ? "y2" : "y", side: k ? 1 : 3, size: 60, grid: { ...axis.grid, show: k === 0 }, values: (u, ticks) => ticks.map((t) => fmt(t)) };
    })];
    const first = shown.length + 1; // uPlot's index of the first envelope series
    const pairOf = new Map(banded.map((s, b) => [shown.indexOf(s) + 1, [first + 2 * b, first + 2 * b + 1]]));
    const lines = shown.map((s, k) => {
      const color = cssVar(`--c${s.color % COLORS}`);
      const pair = pairOf.get(k + 1);
      return {
        label: scale(s) === "y2" ? `${s.label} (right axis)` : s.label,
        scale: scale(s),
        stroke: s.faint ? translucent(color, FAINT_ALPHA) : color,
        width: s.faint ? 1 : s.width,
        dash: s.dash,
        spanGaps: Boolean(s.sparse || s.join),
        points: { show: Boolean(s.sparse), size: 5, fill: color },
        value: (u, v, si, i) => {
          if (v === null || v === undefined) return "–";
          const [hi, lo] = pair ? [u.data[pair[0]][i], u.data[pair[1]][i]] : [];
          return lo < hi ? `${s.format(v)} (${s.format(lo)}–${s.format(hi)})` : s.format(v);
        },
      };
    });
    const envelopes = banded.flatMap((s) => ["highest", "lowest"].map((which) => ({
      label: `${s.label}, ${which} step`, scale: scale(s), class: "u-envelope", stroke: "rgba(0, 0, 0, 0)", width: 0,
      points: { show: false }, value: text(s.format),
    })));
    const bands = banded.map((s, b) => ({ series: [first + 2 * b, first + 2 * b + 1], fill: translucent(cssVar(`--c${s.color % COLORS}`), BAND_ALPHA) }));
    const options = {
      width: this.width(),
      height: this.height,
      scales,
      axes,
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      series: [{ label: "step", value: text(String) }, ...lines, ...envelopes],
      bands,
      hooks: {
        // hiding a line in the legend hides its band too
        setSeries: [(u, i, opts) => {
          if (pairOf.has(i) && opts && "show" in opts) for (const k of pairOf.get(i)) u.setSeries(k, { show: opts.show }, false);
        }],
      },
    };
    replaceChildren(this.plotSlot);
    this.plot = new window.uPlot(options, data, this.plotSlot);
    this.element.plot = this.plot;
    this.layout = layout;
    this.element.dataset.series = String(shown.length);
    this.element.dataset.bands = String(banded.length);
    this.plotSlot.setAttribute("role", "img");
  }

  /** Ends the chart: uPlot's listeners on the window go with it (a page left for another). */
  destroy() {
    this.ended = true;
    this.resize.disconnect();
    this.drop();
  }

  drop() {
    if (this.plot) this.plot.destroy();
    this.plot = null;
    this.layout = null;
    this.element.plot = null;
    this.element.dataset.bands = "0";
  }

  width() {
    return Math.max(320, Math.floor(this.plotSlot.clientWidth));
  }

  fit() {
    if (this.plot && this.width() !== this.plot.width) this.plot.setSize({ width: this.width(), height: this.height });
  }
}
