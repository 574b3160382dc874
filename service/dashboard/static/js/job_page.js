/**
 * The job page. First render: the job, its chart data (downsampled server-side to ≤ 1,000
 * points per series, with every rank's latest memory and the predicted bytes), events,
 * checkpoints and the log's tail, fetched in parallel. Then, while the job is not terminal,
 * metrics arrive over server-sent events (continuing after the newest record the first
 * render saw) and the rest is polled every two seconds, the log by what came after what the
 * panel shows (log_follower.js). Nothing reloads the page.
 */

import { request, followEvents } from "./api.js";
import { LogFollower } from "./log_follower.js";
import { h, replaceChildren, replaceKeepingFocus, announce } from "./dom.js";
import { StepChart } from "./step_chart.js";
import { MemoryBars } from "./memory.js";
import { stepTimeText } from "./step_time.js";
import { SeriesStore, envelopeKeys, userKey } from "./series_store.js";
import { SMOOTH_WINDOW, addMovingMedian, smoothedSeries } from "./smoothing.js";
import { TERMINAL_STATES, bytes, compact, duration, number, timestamp } from "./format.js";
import { stateBadge } from "./state_badge.js";
import { NAMES_JOBS, preemptionLines } from "./queue.js";

const MAX_POINTS = 1000;
const POLL_MS = 2000;

const percent = (v) => (Number.isFinite(v) ? `${(100 * v).toFixed(1)}%` : "–");
const seconds = (v) => (Number.isFinite(v) ? `${number(v)} s` : "–");

const FORMATS = { number, compact, percent, seconds, bytes };

/**
 * A chart of the chart answer, each series with its envelope (the lowest and highest step of
 * each point); the series named `smooth` (the job's speed) is drawn faint, its smoothed line bold over it.
 */
function lineChart(spec, smooth) {
  const series = spec.series.map((s, i) => ({ key: s.key, label: s.label, axis: s.axis, format: FORMATS[s.format] || number,
    sparse: s.sparse, color: i, envelope: envelopeKeys(s.key) }));
  const raw = series.findIndex((s) => s.key === smooth);
  if (raw >= 0) {
    Object.assign(series[raw], { faint: true, dash: undefined });
    series.splice(raw + 1, 0, smoothedSeries(series[raw]));
  }
  const why = raw >= 0 ? `The faint line is each step's ${series[raw].label}; the bold one their median over ${SMOOTH_WINDOW} neighbouring points, which one stalled step does not move.` : "";
  return new StepChart({
    id: `chart-${spec.id}`,
    title: spec.title,
    zeroBased: spec.zero_based,
    description: [spec.description, why].filter(Boolean).join(" "),
    series,
  });
}

/** "Your metrics": one line per name the job's code reported (user text: uPlot sets labels as text). */
function userChart(names) {
  return new StepChart({
    id: "chart-user",
    title: "Your metrics",
    description: "Scalars your code reported with report() (workers.user_metrics), mean over ranks.",
    // sparse: a name may be reported on some steps only (e.g. eval/… names, on evaluated steps)
    series: names.map((name) => ({ key: userKey(name), label: name, sparse: true })),
  });
}

/**
 * The charts of the chart answer's list (the metric table's, contract/metrics.py), by section,
 * plus the page's own communication chart: comm_bytes against the prediction.
 */
function buildCharts(job, chartList, throughputField) {
  const comm = new StepChart({
    id: "chart-comm",
    zeroBased: true,
    title: "Communication per step (bytes per rank)",
    series: [
      { key: "comm_bytes", label: "measured", format: bytes },
      { key: "expected_comm", label: "ZeRO formula", format: bytes },
    ],
    description: "Bytes each rank passed to collectives in a step, all its micro-steps included, against what the "
      + "stage's formula says it sends (the planner's count once the job stored one: bucket padding, gradient "
      + "accumulation and ZeRO++'s quantized bytes included).",
  });
  const inSection = (section) => chartList.filter((c) => c.section === section).map((c) => lineChart(c, throughputField));
  return { training: inSection("training"), communication: [comm, ...inSection("communication")] };
}

/** What the ZeRO formula says a stage communicates (docs/design.md, "The math the engine honours"). */
function formulaComm(bytesPerStep, stage) {
  return `The ZeRO formula for stage ${stage} expects ${bytes(bytesPerStep)} per rank per step.`;
}

/** The series spec of the job's speed (the field the progress line shows), if it is charted. */
function speedSeries(chart) {
  for (const c of chart.charts || []) for (const s of c.series) if (s.key === chart.throughput_field) return s;
  return null;
}

function speedText(point, series) {
  if (!series) return "";
  return ` · ${(FORMATS[series.format] || number)(point[series.key])} ${series.unit}`;
}

function metaList(job, prediction) {
  const spec = job.spec || {};
  const zero = spec.zero || {};
  const train = spec.train || {};
  const resources = spec.resources || {};
  const items = [
    ["Job id", h("code", { text: job.id })],
    ["Owner", job.owner],
    ["Model", (spec.model || {}).preset || (spec.model || {}).factory || "–"],
    ...(zero.shard_group_size ? [["Sharding", `hybrid: shards within groups of ${zero.shard_group_size} ranks, replicated across groups`]] : []),
    ["ZeRO stage", `${zero.stage ?? "auto"}${zero.stage === "auto" && prediction && Number.isFinite(prediction.stage) ? ` (running ${prediction.stage})` : ""}`],
    ["Precision", zero.precision || "–"],
    ["Workers", workersText(resources)],
    ["Batch", `${train.global_batch_size} global, ${train.micro_batch_size} per micro-batch`],
    ["Attempt", String(job.attempt ?? 0)],
    ["Created", timestamp(job.created_at)],
    ["Finished", job.finished_at ? timestamp(job.finished_at) : "–"],
  ];
  return h("dl", { class: "meta" }, items.map(([k, v]) => [h("dt", { text: k }), h("dd", {}, v)]));
}

/** Notices a user should not miss although the job carries on (a checkpoint that was not committed). */
const WARNING_REASONS = new Set(["checkpoint_failed"]);

function eventItem(event) {
  const restart = event.to_state === "RESTARTING" || (event.attempt > 0 && event.to_state === "RUNNING");
  const warning = WARNING_REASONS.has(event.reason);
  return h(
    "li",
    {
      class: `event${restart ? " restart" : ""}${warning ? " warning" : ""}`,
      "data-to-state": event.to_state,
      "data-reason": event.reason || "",
    },
    h("time", { datetime: event.created_at, text: timestamp(event.created_at) }),
    h(
      "div",
      {},
      event.from_state ? [h("span", { class: "muted", text: `${event.from_state} → ` })] : null,
      stateBadge(event.to_state),
      event.reason ? h("span", { class: "reason", text: ` ${event.reason}` }) : null,
      h("span", { class: "attempt", text: ` · attempt ${event.attempt ?? 0}` }),
      event.message ? h("p", { class: "event-message", text: event.message }) : null,
    ),
  );
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const area = h("textarea", { class: "visually-hidden", readonly: true });
    area.value = text;
    document.body.append(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
}

function checkpointRows(items) {
  if (!items.length) return [h("tr", {}, h("td", { colspan: 5, class: "muted", text: "No checkpoints yet." }))];
  return items.map((c) => {
    const uriId = `ckpt-uri-${c.step}`;
    const copy = h("button", { type: "button", class: "small", "aria-describedby": uriId, "data-focus-key": `copy:${c.step}`, text: "Copy URI" });
    copy.addEventListener("click", async () => {
      const ok = await copyText(c.uri);
      copy.textContent = ok ? "Copied" : "Copy failed";
      announce(ok ? `Copied the URI of the step ${c.step} checkpoint.` : "Could not copy; select the URI instead.");
      setTimeout(() => (copy.textContent = "Copy URI"), 2000);
    });
    return h(
      "tr",
      { "data-step": c.step },
      h("th", { scope: "row", text: String(c.step) }),
      h("td", { text: bytes(c.size_bytes) }),
      h("td", { text: `${c.world_size} ranks, stage ${c.stage}` }),
      h("td", {}, h("code", { id: uriId, class: "uri", text: c.uri })),
      h("td", {}, copy),
    );
  });
}

export function jobPage({ jobId, signal }) {
  const heading = h("h1", { id: "job-title", text: jobId });
  const badgeSlot = h("span", { id: "job-state" });
  const cancelButton = h("button", { type: "button", class: "danger", id: "cancel-job", text: "Cancel job", hidden: true });
  const liveStatus = h("span", { id: "live-status", class: "live", text: "" });
  const progressText = h("p", { id: "job-progress", class: "progress-line" });
  const reasonText = h("p", { id: "job-reason", class: "muted" });
  const preemptedSlot = h("div", { id: "job-preempted" }); // what it preempts; when it was preempted, for whom (queue.js)
  // A failed job: its message's first line stays in view (reasonText), the user's frames after
  // it, and the whole traceback (the job's `details`) folded until asked for. Text only.
  const reasonFrames = h("pre", { id: "job-reason-frames", class: "reason-frames", hidden: true });
  const tracebackText = h("pre", { id: "job-traceback", class: "logs", tabindex: "0" });
  const tracebackFold = h("details", { id: "job-details", class: "failure-details", hidden: true },
    h("summary", { text: "Full traceback" }), tracebackText);
  const metaSlot = h("div");
  const chartsSlot = h("div", { class: "charts" });
  const commSlot = h("div", { class: "charts" });
  const commSummary = h("p", { id: "comm-summary", class: "muted small" });
  const stepTimeSummary = h("p", { id: "step-time-summary", class: "muted small" });
  const memory = new MemoryBars();
  const events = h("ol", { class: "timeline", id: "events" });
  const checkpoints = h("tbody");
  const logs = h("pre", { id: "log-tail", class: "logs", tabindex: "0", "aria-label": "Job log" });
  const rankPick = h("select", { id: "log-rank", name: "rank" }, h("option", { value: "", text: "All lines" }));
  const element = h(
    "div",
    { class: "page job-page", "data-job-id": jobId },
    h("p", {}, h("a", { href: "/", "data-nav": true, text: "← All jobs" })),
    h("div", { class: "page-head" }, h("div", {}, heading, h("div", { class: "head-line" }, badgeSlot, " ", liveStatus)), cancelButton),
    progressText,
    reasonText,
    preemptedSlot,
    reasonFrames,
    tracebackFold,
    metaSlot,
    h("section", { "aria-labelledby": "h-training" }, h("h2", { id: "h-training", text: "Training" }), chartsSlot),
    h("section", { "aria-labelledby": "h-memory" }, h("h2", { id: "h-memory", text: "Memory per rank" }), memory.element),
    h("section", { "aria-labelledby": "h-comm" }, h("h2", { id: "h-comm", text: "Communication" }), commSummary, stepTimeSummary, commSlot),
    h("section", { "aria-labelledby": "h-events" }, h("h2", { id: "h-events", text: "Events" }), events),
    h(
      "section",
      { "aria-labelledby": "h-checkpoints" },
      h("h2", { id: "h-checkpoints", text: "Checkpoints" }),
      h("table", { class: "data", id: "checkpoints" },
        h("thead", {}, h("tr", {}, ["Step", "Size", "Layout", "URI", ""].map((c) => h("th", { scope: "col", text: c })))),
        checkpoints),
    ),
    h("section", { "aria-labelledby": "h-logs" }, h("h2", { id: "h-logs", text: "Logs" }),
      h("div", { class: "toolbar" }, h("label", { for: "log-rank", text: "Show" }), rankPick), logs),
  );

  let job = null;
  let charts = null;
  let speed = null;
  let prediction = null;
  let predictionMissing = null;
  let stepTime = null;
  let store = null;
  let streaming = false;
  let pollTimer = null;
  const path = `/jobs/${encodeURIComponent(jobId)}`;
  let logFollower = new LogFollower(`${path}/logs`);

  /** One option per rank of the job's workers (the API's `rank=` takes 0 … num_workers - 1). */
  function renderRankOptions(spec) {
    const ranks = Number(((spec || {}).resources || {}).num_workers) || 1;
    if (rankPick.options.length === ranks + 1) return;
    for (let r = rankPick.options.length - 1; r < ranks; r += 1) rankPick.append(h("option", { value: String(r), text: `Rank ${r} only` }));
  }

  rankPick.addEventListener("change", async () => {
    const rank = rankPick.value === "" ? null : Number(rankPick.value);
    logFollower = new LogFollower(`${path}/logs`, rank);
    logs.dataset.rank = rankPick.value;
    logs.textContent = "";
    const follower = logFollower;
    try {
      const text = await follower.read({ signal });
      if (follower === logFollower) renderLog(text || (rank === null ? "(no log output yet)" : `(no lines of rank ${rank} yet)`));
    } catch (error) {
      if (error.name !== "AbortError") renderLog(`(logs unavailable: ${error.message})`);
    }
  });

  function renderReason(job) {
    const [first, ...rest] = NAMES_JOBS.has(job.reason) ? [""] : (job.message || "").split("\n"); // in words below: #job-preempted
    reasonText.textContent = job.reason ? `Reason: ${job.reason}${first ? ` — ${first}` : ""}` : "";
    const frames = job.reason ? rest.join("\n").replace(/\s+$/, "") : "";
    reasonFrames.textContent = frames;
    reasonFrames.hidden = !frames;
    const details = job.state === "FAILED" ? job.details || "" : "";
    if (tracebackText.textContent !== details) tracebackText.textContent = details; // keeps the fold as it is
    tracebackFold.hidden = !details;
  }

  function renderJob(next) {
    const changed = !job || job.state !== next.state;
    job = next;
    heading.textContent = job.name;
    document.title = `${job.name} · zerotrain`;
    replaceChildren(badgeSlot, stateBadge(job.state));
    element.dataset.state = job.state;
    renderReason(job);
    cancelButton.hidden = TERMINAL_STATES.has(job.state) || job.state === "CANCELLING";
    replaceChildren(metaSlot, metaList(job, prediction));
    renderRankOptions(job.spec);
    if (changed) announce(`Job ${job.name} is ${job.state}.`);
  }

  function renderMetrics() {
    const points = store.points();
    const expected = prediction && prediction.comm_bytes_per_step;
    for (const p of points) p.expected_comm = expected && Number.isFinite(p.comm_bytes) ? expected : null;
    if (speed) addMovingMedian(points, speed.key);
    const names = store.userNames;
    if (names.length !== (charts.user ? charts.user.series.length : 0)) {
      if (charts.user) charts.user.destroy();
      charts.user = userChart(names);
      replaceChildren(chartsSlot, ...charts.training.map((c) => c.element), charts.user.element);
    }
    for (const chart of [...charts.training, ...charts.communication]) chart.setData(points);
    if (charts.user) charts.user.setData(points);
    memory.update(store.memoryRanks(), prediction, predictionMissing);
    stepTimeSummary.textContent = stepTimeText(stepTime, points);
    const last = points[points.length - 1];
    const steps = (job.spec.train || {}).steps;
    progressText.textContent = last
      ? `Step ${last.step} of ${steps ?? "?"}${speedText(last, speed)} · loss ${number(last.loss)}`
      : `Step 0 of ${steps ?? "?"} · no metrics yet`;
    element.dataset.lastStep = last ? String(last.step) : "";
    if (last && Number.isFinite(last.comm_exposed_s) && Number.isFinite(last.step_time_s) && last.step_time_s > 0) {
      commSummary.textContent = `Latest step: ${seconds(last.comm_exposed_s)} of ${seconds(last.step_time_s)} exposed — efficiency ${percent(1 - last.comm_exposed_s / last.step_time_s)}.`
        + (expected ? ` ${formulaComm(expected, prediction.stage)}` : "");
    } else {
      commSummary.textContent = expected ? formulaComm(expected, prediction.stage) : "";
    }
  }

  /** Everything but the metrics, fetched in parallel: job, events, checkpoints, what is new in the log. */
  function fetchSide() {
    const follower = logFollower; // a rank chosen meanwhile makes this answer stale: not shown
    const logTail = follower.read({ signal })
      .then((text) => (follower !== logFollower ? null : text || "(no log output yet)"))
      .catch((error) => (error.name === "AbortError" ? Promise.reject(error) : `(logs unavailable: ${error.message})`));
    return Promise.all([
      request(path, { signal }),
      request(`${path}/events`, { signal }),
      request(`${path}/checkpoints`, { signal }).catch((error) => (error.name === "AbortError" ? Promise.reject(error) : { items: [] })),
      logTail,
    ]);
  }

  // Keys of what the event and checkpoint lists show: redrawn only when they change, so a
  // "Copied" confirmation or the focus on a Copy button survives the polling.
  let shownEvents = null;
  let shownCheckpoints = null;

  function renderSide([nextJob, eventList, ckpts, logText]) {
    renderJob(nextJob);
    const eventsKey = eventList.items.map((e) => e.id).join(",");
    if (eventsKey !== shownEvents) {
      shownEvents = eventsKey;
      replaceChildren(events, eventList.items.map(eventItem));
      if (eventList.items.some((e) => NAMES_JOBS.has(e.reason))) showPreemption();
    }
    const items = ckpts.items || [];
    const checkpointsKey = items.map((c) => `${c.step}:${c.uri}`).join(",");
    if (checkpointsKey !== shownCheckpoints) {
      shownCheckpoints = checkpointsKey;
      replaceKeepingFocus(checkpoints, ...checkpointRows(items));
    }
    renderLog(logText);
  }

  /** The jobs it is making room for, and each time it was preempted and for whom, naming only jobs the viewer may see. */
  async function showPreemption() {
    try {
      const answer = await request(`/dashboard/preemption?job_id=${encodeURIComponent(jobId)}`, { signal });
      replaceChildren(preemptedSlot, preemptionLines(answer.items[jobId]));
    } catch (error) {
      if (error.name !== "AbortError") preemptedSlot.textContent = `(preemptions unavailable: ${error.message})`;
    }
  }

  /** The log panel stays where the reader scrolled, or follows the end if they are there. */
  function renderLog(logText) {
    if (logText === null || logs.textContent === logText) return;
    const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    logs.textContent = logText;
    if (atBottom) logs.scrollTop = logs.scrollHeight;
  }

  async function refreshSide() {
    renderSide(await fetchSide());
  }

  function startStream() {
    if (streaming || TERMINAL_STATES.has(job.state)) return;
    streaming = true;
    liveStatus.textContent = "● live";
    followEvents(`${path}/metrics/stream?after=${store.cursor}`, {
      signal,
      onStatus: (s) => (liveStatus.textContent = { live: "● live", reconnecting: "○ reconnecting…", stopped: "" }[s]),
      onEvent: (ev) => {
        if (ev.event !== "metric") return;
        store.add(JSON.parse(ev.data));
        renderMetrics();
      },
    }).finally(() => {
      streaming = false;
      if (!signal.aborted) liveStatus.textContent = TERMINAL_STATES.has(job.state) ? "finished" : "";
    });
  }

  async function poll() {
    try {
      await refreshSide();
    } catch (error) {
      if (error.name === "AbortError") return;
    }
    if (TERMINAL_STATES.has(job.state)) {
      clearInterval(pollTimer);
      pollTimer = null;
      // the log was read beside the job: once more, so that its last lines (written before
      // the driver reported the end) are shown; then the panel stops following
      try {
        renderLog(await logFollower.read({ signal }));
      } catch (error) {
        if (error.name === "AbortError") return;
      }
      liveStatus.textContent = streaming ? liveStatus.textContent : "finished";
    }
  }

  cancelButton.addEventListener("click", async () => {
    cancelButton.disabled = true;
    try {
      renderJob(await request(`${path}/cancel`, { method: "POST" }));
      await poll();
    } catch (error) {
      announce(`Could not cancel: ${error.message}`);
      reasonText.textContent = `Could not cancel: ${error.message}`;
    } finally {
      cancelButton.disabled = false;
    }
  });

  async function firstRender() {
    const started = performance.now();
    const [side, chart] = await Promise.all([
      fetchSide(),
      request(`${path}/metrics/chart?max_points=${MAX_POINTS}`, { signal }),
    ]);
    const first = side[0];
    prediction = chart.prediction && Number.isFinite(chart.prediction.total) ? chart.prediction : null;
    predictionMissing = chart.prediction && chart.prediction.reason;
    stepTime = chart.step_time || null;
    store = new SeriesStore({ world: (first.spec.resources || {}).num_workers || 1, maxPoints: MAX_POINTS });
    store.load(chart);
    renderSide(side);
    charts = buildCharts(first, chart.charts || [], chart.throughput_field);
    speed = speedSeries(chart);
    replaceChildren(chartsSlot, ...charts.training.map((c) => c.element));
    replaceChildren(commSlot, ...charts.communication.map((c) => c.element));
    renderMetrics();
    // Wait for the charts' frame so the measurement covers drawing, not just fetching.
    await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
    // Two numbers: since this view started fetching, and since the navigation began.
    element.dataset.firstRenderMs = (performance.now() - started).toFixed(1);
    element.dataset.renderedAtMs = performance.now().toFixed(1);
    element.dataset.rendered = "true";
    performance.mark("zerotrain:job-page-rendered");
    startStream();
    if (!TERMINAL_STATES.has(job.state)) pollTimer = setInterval(poll, POLL_MS);
  }

  signal.addEventListener("abort", () => {
    if (pollTimer) clearInterval(pollTimer);
    if (charts) for (const chart of [...charts.training, ...charts.communication, charts.user]) if (chart) chart.destroy();
  });
  firstRender().catch((error) => {
    if (error.name === "AbortError") return;
    replaceChildren(element, h("h1", { text: "Job not available" }), h("p", { role: "alert", text: error.message }), h("p", {}, h("a", { href: "/", "data-nav": true, text: "← All jobs" })));
  });
  return { element, title: "Job" };
}

/** "2 × (1 CPU, 0 GPU)", or for an elastic job "1–2 × (…), elastic": the range it may run at. */
function workersText(resources) {
  const most = resources.num_workers ?? 1;
  const least = resources.min_workers ?? most;
  const each = `(${resources.cpus_per_worker ?? 1} CPU, ${resources.gpus_per_worker ?? 0} GPU)`;
  return least < most ? `${least}–${most} × ${each}, elastic` : `${most} × ${each}`;
}
