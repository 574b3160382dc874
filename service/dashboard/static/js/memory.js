/**
 * Per-rank memory as stacked bars (params / grads / optimizer / buffers) with the predicted
 * model-state bytes drawn as a marker on the same scale, plus the same numbers as a table so
 * that nothing depends on colour. Segments also differ by fill pattern.
 */

import { h, replaceChildren } from "./dom.js";
import { bytes } from "./format.js";

export const MEMORY_PARTS = [
  { key: "mem_params_bytes", label: "params", className: "mem-params" },
  { key: "mem_grads_bytes", label: "grads", className: "mem-grads" },
  { key: "mem_optimizer_bytes", label: "optimizer", className: "mem-optimizer" },
  { key: "mem_buffers_bytes", label: "buffers", className: "mem-buffers" },
];

export class MemoryBars {
  constructor() {
    this.bars = h("div", { class: "mem-bars", id: "memory-bars" });
    this.note = h("p", { class: "muted small", id: "memory-prediction-note" });
    this.table = h("table", { class: "data mem-table" });
    this.parts = h("table", { class: "data mem-parts", id: "memory-peak-parts" });
    this.element = h(
      "div",
      { class: "memory" },
      h(
        "ul",
        { class: "legend", "aria-hidden": "true" },
        MEMORY_PARTS.map((p) => h("li", {}, h("span", { class: `swatch ${p.className}` }), p.label)),
        h("li", {}, h("span", { class: "swatch mem-predicted" }), "predicted model states"),
      ),
      this.bars,
      this.note,
      h("details", {}, h("summary", { text: "Memory per rank as a table" }), this.table),
      h("details", { id: "memory-peak-details" }, h("summary", { text: "Predicted peak by part of the job" }), this.parts),
    );
    this.update([], null);
  }

  /**
   * `ranks`: latest record per rank; `prediction`: {total, stage, source, phi} or null, and
   * then `missing` says why there is none.
   */
  update(ranks, prediction, missing = null) {
    const sorted = [...ranks].sort((a, b) => a.rank - b.rank);
    const totals = sorted.map((r) => MEMORY_PARTS.reduce((sum, p) => sum + (Number(r[p.key]) || 0), 0));
    const scale = Math.max(1, ...totals, prediction ? prediction.total : 0) * 1.05;
    const pct = (v) => `${((100 * v) / scale).toFixed(3)}%`;
    if (!sorted.length) {
      replaceChildren(this.bars, h("p", { class: "muted", text: "No memory reported yet." }));
    } else {
      replaceChildren(
        this.bars,
        sorted.map((r, i) => {
          const modelState = (Number(r.mem_params_bytes) || 0) + (Number(r.mem_grads_bytes) || 0) + (Number(r.mem_optimizer_bytes) || 0);
          const label = `Rank ${r.rank}: ${MEMORY_PARTS.map((p) => `${p.label} ${bytes(r[p.key])}`).join(", ")}; total ${bytes(totals[i])}`
            + (prediction ? `; predicted model states ${bytes(prediction.total)}, measured ${bytes(modelState)}` : "");
          return h(
            "div",
            { class: "mem-row", "data-rank": r.rank },
            h("span", { class: "mem-label", text: `rank ${r.rank}` }),
            h(
              "div",
              { class: "mem-track", role: "img", "aria-label": label },
              MEMORY_PARTS.map((p) =>
                h("span", {
                  class: `mem-seg ${p.className}`,
                  "data-part": p.label,
                  style: `width:${pct(Number(r[p.key]) || 0)}`,
                  title: `${p.label}: ${bytes(r[p.key])}`,
                }),
              ),
              prediction ? h("span", { class: "mem-marker", style: `left:${pct(prediction.total)}`, title: `predicted ${bytes(prediction.total)}` }) : null,
            ),
            h("span", { class: "mem-total", text: bytes(totals[i]) }),
          );
        }),
      );
    }
    if (prediction) {
      const how = prediction.source === "planner"
        ? "the planner's prediction"
        : `the ZeRO model-state formula with Φ = ${Number(prediction.phi).toLocaleString("en-US")}, N = ${prediction.world}, ${prediction.precision}`;
      const where = (prediction.offload === "nvme" ? " with the optimizer state on NVMe" : prediction.offload ? " with the optimizer state in host memory" : "")
        + (prediction.offload_params === "nvme" ? ", the parameters on NVMe" : "");
      let text = `Marker: predicted params + grads + optimizer per rank at stage ${prediction.stage ?? "?"}${where}: ${bytes(prediction.total)} (${how}). Buffers are extra.`;
      if (prediction.source === "planner") {
        if (Number.isFinite(prediction.peak)) {
          text += ` Predicted peak per rank: ${bytes(prediction.peak)} (worst part: ${prediction.peak_where})`;
          if (Number.isFinite(prediction.peak_measured)) text += ` (measured on rank 0: ${bytes(prediction.peak_measured)})`;
          text += `; with the allocator's reserve the planner budgeted ${bytes(prediction.peak_total)}.`;
        } else {
          text += ` Predicted peak with activations and buffers: ${bytes(prediction.peak_total)}.`;
        }
        if (prediction.check) {
          // rel_error = (predicted - measured) / measured (workers/zero/planner/check.py)
          const errors = Object.entries(prediction.check)
            .filter(([, e]) => Number.isFinite(e))
            .map(([term, e]) => `${term} ${Math.abs(e * 100).toFixed(1)}% ${e >= 0 ? "above" : "below"} measured`);
          text += ` Measured on rank 0 at the end of the run, the prediction was: ${errors.join(", ")}.`;
        }
      }
      this.note.textContent = text;
    } else {
      this.note.textContent = `No prediction: ${missing || "not known for this job"}.`;
    }
    this.updateParts(prediction);
    replaceChildren(
      this.table,
      h("caption", { text: "Latest memory per rank (bytes)" }),
      h("thead", {}, h("tr", {}, ["rank", "step", ...MEMORY_PARTS.map((p) => p.label), "total", "predicted", "peak", "predicted peak"].map((c) => h("th", { scope: "col", text: c })))),
      h(
        "tbody",
        {},
        sorted.map((r, i) =>
          h(
            "tr",
            {},
            h("th", { scope: "row", text: String(r.rank) }),
            h("td", { text: String(r.step ?? "–") }),
            MEMORY_PARTS.map((p) => h("td", { text: bytes(r[p.key]) })),
            h("td", { text: bytes(totals[i]) }),
            h("td", { text: prediction ? bytes(prediction.total) : "–" }),
            h("td", { text: bytes(r.mem_peak_bytes) }),
            h("td", { text: prediction && Number.isFinite(prediction.peak) ? bytes(prediction.peak) : "–" }),
          ),
        ),
      ),
    );
  }

  /** The planner's peak per part of the job, with rank 0's measurement once the job has ended. */
  updateParts(prediction) {
    const parts = (prediction && prediction.peak_parts) || [];
    if (!parts.length) {
      replaceChildren(this.parts, h("caption", { text: "No prediction by part for this job." }));
      return;
    }
    const error = (p) => (Number.isFinite(p.rel_error) ? `${p.rel_error >= 0 ? "+" : ""}${(p.rel_error * 100).toFixed(1)}%` : "–");
    replaceChildren(
      this.parts,
      h("caption", { text: "Peak per rank in each part of the job: predicted, and measured on rank 0 (bytes above what the process held before the model)" }),
      h("thead", {}, h("tr", {}, ["part of the job", "predicted peak", "measured (rank 0)", "error"].map((c) => h("th", { scope: "col", text: c })))),
      h(
        "tbody",
        {},
        parts.map((p) =>
          h(
            "tr",
            { "data-part": p.part, class: p.words === prediction.peak_where ? "peak-worst" : "" },
            h("th", { scope: "row", text: p.words }),
            h("td", { text: bytes(p.predicted) }),
            h("td", { text: Number.isFinite(p.measured) ? bytes(p.measured) : "–" }),
            h("td", { text: error(p) }),
          ),
        ),
      ),
    );
  }
}
