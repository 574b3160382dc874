/**
 * The jobs page: one page of jobs at a time (cursor pagination, 50 per page, so 1,000 jobs
 * cost the same as 50), filtered by state, refreshed every few seconds, with a submit form
 * and a cancel button per active job. Progress and tokens/s come from one extra request per
 * page (`/dashboard/progress`), since a job row holds neither. Ticking jobs' boxes and
 * "Compare" opens `/jobs/compare?ids=…` (compare_page.js); the ticks outlive a refresh.
 */

import { request } from "./api.js";
import { h, replaceChildren, replaceKeepingFocus, announce } from "./dom.js";
import { ALL_STATES, TERMINAL_STATES, age, compact } from "./format.js";
import { SpecForm } from "./spec_form.js";
import { stateBadge } from "./state_badge.js";
import { MAX_COMPARED } from "./compare_page.js";
import { reasonCell } from "./queue.js";

const PAGE_SIZE = 50;
const REFRESH_MS = 3000;

function modelName(spec) {
  const model = (spec && spec.model) || {};
  return model.preset || model.factory || "–";
}

export function jobsPage({ navigate, signal }) {
  const params = new URLSearchParams(location.search);
  const state = { filter: params.get("state") || "", cursors: [null], page: 0, timer: null };
  const selected = new Set(); // job ids ticked for comparison

  const filter = h(
    "select",
    { id: "state-filter", name: "state" },
    h("option", { value: "", text: "All states" }),
    ALL_STATES.map((s) => h("option", { value: s, text: s, selected: s === state.filter })),
  );
  const autoRefresh = h("input", { type: "checkbox", id: "auto-refresh", checked: true });
  const status = h("p", { class: "muted small", id: "jobs-status", "aria-live": "off" });
  const compareButton = h("button", { type: "button", id: "compare-selected", disabled: true, text: "Compare selected" });
  compareButton.addEventListener("click", () => navigate(`/jobs/compare?ids=${[...selected].map(encodeURIComponent).join(",")}`));
  function updateCompare() {
    const n = selected.size;
    compareButton.disabled = n < 2 || n > MAX_COMPARED;
    compareButton.textContent = n ? `Compare selected (${n})` : "Compare selected";
    compareButton.title = n > MAX_COMPARED ? `At most ${MAX_COMPARED} jobs at once` : "Tick two or more jobs to compare";
  }
  const tbody = h("tbody");
  const pager = h("nav", { class: "pager", "aria-label": "Pages of jobs" });
  const form = new SpecForm({ onSubmitted: (job) => navigate(`/jobs/${encodeURIComponent(job.id)}`) });
  const submitToggle = h("button", { type: "button", "aria-expanded": "false", "aria-controls": "submit-panel", text: "Submit a job…" });
  const submitPanel = h("section", { id: "submit-panel", "aria-labelledby": "submit-heading", hidden: true }, h("h2", { id: "submit-heading", text: "Submit a job" }), form.element);
  submitToggle.addEventListener("click", () => {
    const open = submitPanel.hidden;
    submitPanel.hidden = !open;
    submitToggle.setAttribute("aria-expanded", String(open));
    if (open) form.textarea.focus();
  });

  const element = h(
    "div",
    { class: "page jobs-page" },
    h("div", { class: "page-head" }, h("h1", { text: "Jobs" }), submitToggle),
    submitPanel,
    h(
      "div",
      { class: "toolbar", role: "group", "aria-label": "Job list options" },
      h("label", { for: "state-filter", text: "State" }),
      filter,
      h("label", { class: "check" }, autoRefresh, " Auto-refresh"),
      h("button", { type: "button", text: "Refresh now", onclick: () => load() }),
      compareButton,
      status,
    ),
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { class: "data jobs", id: "jobs-table" },
        h("caption", { class: "visually-hidden", text: "Jobs, newest first" }),
        h(
          "thead",
          {},
          h("tr", {}, ["Compare", "Job", "State", "Reason", "Owner", "Team", "Priority", "Model", "ZeRO stage", "Workers", "Progress", "Tokens/s", "Age", "Actions"].map((c) => h("th", { scope: "col", text: c }))),
        ),
        tbody,
      ),
    ),
    pager,
  );

  async function cancel(job, button) {
    button.disabled = true;
    try {
      const updated = await request(`/jobs/${encodeURIComponent(job.id)}/cancel`, { method: "POST" });
      announce(`Job ${job.name} is ${updated.state}.`);
    } catch (error) {
      announce(`Could not cancel ${job.name}: ${error.message}`);
      status.textContent = `Could not cancel ${job.name}: ${error.message}`;
    }
    await load();
  }

  function row(job, progress, speedField, preemption) {
    const spec = job.spec || {};
    const steps = spec.train && spec.train.steps;
    const done = progress ? progress.step : null;
    const link = h("a", { href: `/jobs/${encodeURIComponent(job.id)}`, "data-nav": true, "data-focus-key": `open:${job.id}`, text: job.name });
    const cancelButton = TERMINAL_STATES.has(job.state) || job.state === "CANCELLING"
      ? null
      : h("button", { type: "button", class: "danger small", "aria-label": `Cancel job ${job.name}`, "data-focus-key": `cancel:${job.id}`, text: "Cancel" });
    if (cancelButton) cancelButton.addEventListener("click", () => cancel(job, cancelButton));
    const pick = h("input", { type: "checkbox", class: "compare-pick", "aria-label": `Compare ${job.name}`, "data-focus-key": `pick:${job.id}`, checked: selected.has(job.id) });
    pick.addEventListener("change", () => {
      if (pick.checked) selected.add(job.id);
      else selected.delete(job.id);
      updateCompare();
    });
    return h(
      "tr",
      { "data-job-id": job.id, "data-state": job.state },
      h("td", {}, pick),
      h("th", { scope: "row" }, link, h("div", { class: "muted small mono", text: job.id })),
      h("td", {}, stateBadge(job.state)),
      reasonCell(job, preemption),
      h("td", { text: job.owner }),
      h("td", { class: "team", text: job.team || "–" }),
      h("td", { class: "num priority", text: String(job.priority ?? 0) }),
      h("td", { text: modelName(spec) }),
      h("td", { text: String((spec.zero && spec.zero.stage) ?? "auto") }),
      h("td", { text: workerRange(spec.resources) }),
      h(
        "td",
        { class: "progress-cell" },
        steps ? h("progress", { max: steps, value: Math.min(done ?? 0, steps), "aria-label": `${job.name} progress` }) : null,
        h("span", { text: ` ${done ?? 0} / ${steps ?? "?"}` }),
      ),
      h("td", { class: "num", text: progress && Number.isFinite(progress[speedField]) ? compact(progress[speedField]) : "–" }),
      h("td", { text: age(job.created_at) }),
      h("td", {}, cancelButton),
    );
  }

  function renderPager(nextCursor, count) {
    const first = state.page * PAGE_SIZE + 1;
    const prev = h("button", { type: "button", text: "← Newer", disabled: state.page === 0 });
    const next = h("button", { type: "button", text: "Older →", disabled: !nextCursor });
    prev.addEventListener("click", () => {
      state.page -= 1;
      load(true);
    });
    next.addEventListener("click", () => {
      state.cursors[state.page + 1] = nextCursor;
      state.page += 1;
      load(true);
    });
    replaceChildren(pager, prev, h("span", { class: "muted", id: "page-range", text: count ? `Jobs ${first}–${first + count - 1}` : "No jobs" }), next);
  }

  let inFlight = null;
  async function load(focusTable = false) {
    if (inFlight) inFlight.abort();
    const controller = new AbortController();
    inFlight = controller;
    const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (state.filter) query.set("state", state.filter);
    const cursor = state.cursors[state.page];
    if (cursor) query.set("cursor", cursor);
    try {
      const page = await request(`/jobs?${query}`, { signal: controller.signal });
      const idsOf = (jobs) => jobs.map((j) => `job_id=${encodeURIComponent(j.id)}`).join("&");
      const ids = idsOf(page.items);
      const queued = idsOf(page.items.filter((j) => j.state === "QUEUED")); // why they wait: what they preempt, or for whom they were
      const [answer, preemption] = await Promise.all([
        ids ? request(`/dashboard/progress?${ids}`, { signal: controller.signal }) : { items: {} },
        queued ? request(`/dashboard/preemption?${queued}`, { signal: controller.signal })
          .catch((error) => (error.name === "AbortError" ? Promise.reject(error) : { items: {} })) : { items: {} }, // the list without it
      ]);
      const progress = answer.items; // the field holding the speed is named by the answer (the metric table's)
      replaceKeepingFocus(
        tbody,
        page.items.length
          ? page.items.map((job) => row(job, progress[job.id], answer.throughput_field, preemption.items[job.id]))
          : h("tr", {}, h("td", { colspan: 14, class: "muted", text: state.filter ? `No ${state.filter} jobs.` : "No jobs yet. Submit one above." })),
      );
      renderPager(page.next_cursor, page.items.length);
      status.textContent = `Updated ${new Date().toLocaleTimeString()}`;
      element.dataset.loaded = "true";
      if (focusTable) document.getElementById("jobs-table").focus?.();
    } catch (error) {
      if (error.name === "AbortError") return;
      status.textContent = `Could not load jobs: ${error.message}`;
    } finally {
      if (inFlight === controller) inFlight = null;
    }
  }

  filter.addEventListener("change", () => {
    state.filter = filter.value;
    state.cursors = [null];
    state.page = 0;
    const url = state.filter ? `/?state=${encodeURIComponent(state.filter)}` : "/";
    history.replaceState(null, "", url);
    load();
  });

  function tick() {
    if (autoRefresh.checked && !document.hidden && !inFlight) load();
  }
  state.timer = setInterval(tick, REFRESH_MS);
  signal.addEventListener("abort", () => {
    clearInterval(state.timer);
    if (inFlight) inFlight.abort();
  });
  load();
  return { element, title: "Jobs" };
}

/** The jobs list's workers column: "2", or "1–2" for an elastic job. */
function workerRange(resources) {
  if (!resources || resources.num_workers === undefined) return "–";
  const least = resources.min_workers ?? resources.num_workers;
  return least < resources.num_workers ? `${least}–${resources.num_workers}` : String(resources.num_workers);
}
