/**
 * The comparison page, `/jobs/compare?ids=A,B,…`: the jobs' loss (and eval loss) curves
 * overlaid on one chart, one series per job named by the job, and a table of the spec fields
 * whose values differ between them (dotted paths, e.g. `train.lr`). Everything comes from the
 * API the job page uses (`GET /jobs/{id}`, `GET /jobs/{id}/metrics/chart`) with the user's own
 * token, so a job the user may not see answers 404 and is named as such: its data never
 * reaches the page.
 */

import { request, ApiError } from "./api.js";
import { h, replaceChildren } from "./dom.js";
import { StepChart } from "./step_chart.js";

export const MAX_COMPARED = 8;

/** The ids of `?ids=A,B,…`: trimmed, without empties or repeats. */
export function compareIds(search) {
  const raw = new URLSearchParams(search).get("ids") || "";
  return [...new Set(raw.split(",").map((s) => s.trim()).filter(Boolean))];
}

/** `{a: {b: 1}, c: [1, 2]}` → `{"a.b": 1, "c": [1, 2]}`: lists are leaves (compared whole). */
export function flatten(value, prefix = "", out = {}) {
  if (value && typeof value === "object" && !Array.isArray(value)) {
    const keys = Object.keys(value);
    if (!keys.length && prefix) out[prefix] = value;
    for (const key of keys) flatten(value[key], prefix ? `${prefix}.${key}` : key, out);
  } else if (prefix) {
    out[prefix] = value;
  }
  return out;
}

/** The dotted paths whose values are not the same in every spec (a path one spec lacks differs). */
export function differingFields(specs) {
  const flat = specs.map((s) => flatten(s || {}));
  const paths = [...new Set(flat.flatMap((f) => Object.keys(f)))].sort();
  return paths
    .filter((p) => new Set(flat.map((f) => JSON.stringify(f[p] === undefined ? null : f[p]))).size > 1)
    .map((p) => ({ path: p, values: flat.map((f) => f[p]) }));
}

/**
 * One point per step of any run, `{step, "<job>/<field>": value}`: the union of the runs' steps,
 * a run's key absent on a step it lacks.
 *
 * [Note: runs log different steps (another length, another eval interval). A run's value is
 * missing on another run's steps, and its line is joined across them (`join`), so one run's
 * steps never break another's line.]
 */
export function overlayPoints(runs, fields) {
  const byStep = new Map();
  for (const run of runs) {
    const steps = run.series.step || [];
    for (const field of fields) {
      const values = run.series[field] || [];
      steps.forEach((step, i) => {
        if (!Number.isFinite(values[i])) return;
        if (!byStep.has(step)) byStep.set(step, { step });
        byStep.get(step)[`${run.job}/${field}`] = values[i];
      });
    }
  }
  return [...byStep.values()].sort((a, b) => a.step - b.step);
}

function cellText(value) {
  if (value === undefined) return "–";
  return typeof value === "object" && value !== null ? JSON.stringify(value) : String(value);
}

async function load(id, signal) {
  const path = `/jobs/${encodeURIComponent(id)}`;
  try {
    const [job, chart] = await Promise.all([
      request(path, { signal }),
      request(`${path}/metrics/chart?max_points=1000`, { signal }),
    ]);
    return { id, job, chart };
  } catch (error) {
    if (error.name === "AbortError") throw error;
    const why = error instanceof ApiError && (error.status === 404 || error.status === 403)
      ? "no such job, or not one you may see"
      : `could not be loaded: ${error.message}`;
    return { id, error: why };
  }
}

export function comparePage({ signal }) {
  const ids = compareIds(location.search);
  const status = h("p", { id: "compare-status", class: "muted", role: "status", text: "Loading…" });
  const problems = h("ul", { id: "compare-problems", class: "field-error-list" });
  const chartSlot = h("div", { class: "charts" });
  const diffSlot = h("div", { class: "table-wrap" });
  const element = h(
    "div",
    { class: "page compare-page" },
    h("p", {}, h("a", { href: "/", "data-nav": true, text: "← All jobs" })),
    h("h1", { text: "Compare runs" }),
    status,
    problems,
    h("section", { "aria-labelledby": "h-compare-loss" }, h("h2", { id: "h-compare-loss", text: "Loss" }), chartSlot),
    h("section", { "aria-labelledby": "h-compare-spec" }, h("h2", { id: "h-compare-spec", text: "Spec fields that differ" }), diffSlot),
  );

  if (ids.length < 2 || ids.length > MAX_COMPARED) {
    status.textContent = `Choose between 2 and ${MAX_COMPARED} jobs to compare (ticked in the jobs list); this link names ${ids.length}.`;
    status.className = "field-error";
    return { element, title: "Compare runs" };
  }

  Promise.all(ids.map((id) => load(id, signal))).then((runs) => {
    if (signal.aborted) return;
    const shown = runs.filter((r) => !r.error);
    replaceChildren(problems, runs.filter((r) => r.error).map((r) => h("li", { class: "field-error", "data-job-id": r.id, text: `Job ${r.id}: ${r.error}.` })));
    status.textContent = shown.length ? `Comparing ${shown.length} jobs.` : "None of these jobs can be shown.";
    if (!shown.length) return;
    const names = shown.map((r) => `${r.job.name} (${r.id})`);
    const series = [];
    shown.forEach((r, i) => {
      series.push({ label: `${names[i]} loss`, key: `${r.id}/loss`, color: i, dash: undefined, join: true });
      series.push({ label: `${names[i]} eval loss`, key: `${r.id}/eval_loss`, color: i, dash: [6, 4], width: 1.5, sparse: true });
    });
    const chart = new StepChart({ id: "chart-compare-loss", title: "Loss per step", series, height: 280,
      description: "Point at the chart to read each run's value at that step in the legend." });
    chart.setData(overlayPoints(shown.map((r) => ({ job: r.id, series: r.chart.series })), ["loss", "eval_loss"]));
    replaceChildren(chartSlot, chart.element);
    signal.addEventListener("abort", () => chart.destroy());

    const diffs = differingFields(shown.map((r) => r.job.spec));
    replaceChildren(
      diffSlot,
      h(
        "table",
        { class: "data", id: "compare-diff" },
        h("caption", { class: "visually-hidden", text: "Spec fields whose values differ between the jobs" }),
        h("thead", {}, h("tr", {}, h("th", { scope: "col", text: "Field" }), names.map((n) => h("th", { scope: "col", text: n })))),
        h(
          "tbody",
          {},
          diffs.length
            ? diffs.map((d) => h("tr", { "data-field": d.path }, h("th", { scope: "row", class: "mono", text: d.path }), d.values.map((v) => h("td", { class: "mono", text: cellText(v) }))))
            : h("tr", {}, h("td", { colspan: names.length + 1, class: "muted", text: "The specs are the same." })),
        ),
      ),
    );
    element.dataset.rendered = "true";
  }, (error) => {
    if (error.name !== "AbortError") status.textContent = `Could not load the jobs: ${error.message}`;
  });
  return { element, title: "Compare runs" };
}
