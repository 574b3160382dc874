/**
 * The job page's chart data: the server's downsampled points for the history, then live
 * records from the stream combined per step exactly as the server combines them (see
 * service/dashboard/charts.py). Which fields there are and how each combines ranks comes with
 * the chart answer (`aggregation`, from the metric table, contract/metrics.py): `mean` over
 * ranks, or `total`, the mean of each rank's share × its attempt's world size (the record's
 * `world_size`; the spec's num_workers for records without one). A restart
 * repeats steps with a newer attempt; its records replace what was drawn from that step on.
 * The number of points stays bounded: when it doubles past the limit, neighbouring points
 * are merged pairwise.
 *
 * Scalars the job's code reported (a record's `user` object, the chart answer's
 * `user_metrics`) are fields too, combined by their mean over ranks, under the key
 * `user:<name>` (userKey): a user's name is never a key of its own, so neither "loss" nor
 * "__proto__" can reach another field or an object's prototype.
 *
 * Each point also holds its field's envelope, the lowest and highest of the steps it stands
 * for (envelopeKeys): from the answer's `series_min`/`series_max` for the history, the value
 * itself for a live step, the extremes of both when two points merge.
 */

const USER_PREFIX = "user:";
export const userKey = (name) => USER_PREFIX + name;
/** The keys of a field's lowest and highest step value in a point. */
export const envelopeKeys = (field) => ({ min: `min:${field}`, max: `max:${field}` });

const OPEN_STEPS = 32; // steps whose ranks may still be arriving

function mean(values) {
  const xs = values.filter(Number.isFinite);
  return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null;
}

/** The lowest or highest (`pick`) of the finite values; null when neither is. */
function extreme(pick, ...values) {
  const xs = values.filter(Number.isFinite);
  return xs.length ? pick(...xs) : null;
}

export class SeriesStore {
  constructor({ world = 1, maxPoints = 1000 } = {}) {
    this.world = world;
    this.maxPoints = maxPoints;
    this.final = [];
    this.open = new Map(); // step -> {attempt, byRank: Map(rank -> record)}
    this.lastId = 0;
    this.cursor = "0:0"; // the live stream's start (?after=), from the chart's answer
    this.finalAttempt = -1;
    this.memory = new Map(); // rank -> latest record with memory numbers
    this.memoryAttempt = -1;
    this.aggregation = {}; // field -> "mean" | "total"
    this.userNames = []; // the job's user metric names, in the order first seen
  }

  /** The server's answer of GET /jobs/{id}/metrics/chart. */
  load(chart) {
    const s = chart.series;
    this.aggregation = { ...(chart.aggregation || {}) };
    const user = chart.user_metrics || { names: [], values: [] };
    this.userNames = [];
    for (const name of user.names) this.addUserName(name);
    const lowest = chart.series_min || {};
    const highest = chart.series_max || {};
    this.final = s.step.map((step, i) => {
      const point = { step };
      for (const f of Object.keys(chart.aggregation || {})) {
        const { min, max } = envelopeKeys(f);
        point[f] = s[f] ? s[f][i] : null;
        point[min] = lowest[f] ? lowest[f][i] : point[f];
        point[max] = highest[f] ? highest[f][i] : point[f];
      }
      user.names.forEach((name, k) => (point[userKey(name)] = user.values[k] ? user.values[k][i] : null));
      return point;
    });
    this.lastId = chart.last_id || 0;
    this.cursor = chart.cursor || "0:0";
    this.finalAttempt = chart.latest_attempt ?? -1;
    this.memory = new Map((chart.memory || []).map((r) => [r.rank, r]));
    this.memoryAttempt = Math.max(-1, ...(chart.memory || []).map((r) => r.attempt));
  }

  addUserName(name) {
    const key = userKey(name);
    if (Object.prototype.hasOwnProperty.call(this.aggregation, key)) return;
    this.aggregation[key] = "mean";
    this.userNames.push(name);
  }

  /** One live record from the stream. */
  add(record) {
    if (record.id) this.lastId = Math.max(this.lastId, record.id);
    if (record.user && typeof record.user === "object") {
      for (const [name, value] of Object.entries(record.user)) {
        this.addUserName(name);
        record[userKey(name)] = value;
      }
    }
    this.addMemory(record);
    const last = this.final.length ? this.final[this.final.length - 1].step : -1;
    if (record.step <= last) {
      // A late rank of a step already drawn changes little: skip it. A restart replays steps:
      // the new attempt's numbers replace the old from that step on.
      if (record.attempt <= this.finalAttempt) return;
      this.final = this.final.filter((p) => p.step < record.step);
    }
    this.finalAttempt = Math.max(this.finalAttempt, record.attempt);
    let entry = this.open.get(record.step);
    if (!entry || entry.attempt < record.attempt) {
      entry = { attempt: record.attempt, byRank: new Map() };
      this.open.set(record.step, entry);
    }
    if (record.attempt < entry.attempt) return;
    entry.byRank.set(record.rank, record);
    for (const step of [...this.open.keys()]) if (step > record.step && this.open.get(step).attempt < record.attempt) this.open.delete(step);
    this.closeOldSteps();
  }

  fields() {
    return Object.keys(this.aggregation);
  }

  combine(step, records) {
    const point = { step };
    for (const [f, across] of Object.entries(this.aggregation)) {
      // a total is each rank's share times its attempt's world size (an elastic job's shrink)
      point[f] = across === "total"
        ? mean(records.map((r) => (Number.isFinite(r[f]) ? r[f] * (r.world_size || this.world) : null)))
        : mean(records.map((r) => r[f]));
      const { min, max } = envelopeKeys(f);
      point[min] = point[max] = point[f]; // one step
    }
    return point;
  }

  mergePair(a, b) {
    const point = { step: b.step };
    for (const f of this.fields()) {
      const { min, max } = envelopeKeys(f);
      point[f] = mean([a[f], b[f]]);
      point[min] = extreme(Math.min, a[min], b[min]);
      point[max] = extreme(Math.max, a[max], b[max]);
    }
    return point;
  }

  addMemory(record) {
    if (!Number.isFinite(record.mem_params_bytes)) return;
    if (record.attempt > this.memoryAttempt) {
      this.memory = new Map();
      this.memoryAttempt = record.attempt;
    }
    if (record.attempt < this.memoryAttempt) return;
    const current = this.memory.get(record.rank);
    if (!current || current.step <= record.step) this.memory.set(record.rank, record);
  }

  closeOldSteps() {
    if (this.open.size <= OPEN_STEPS) return;
    const steps = [...this.open.keys()].sort((a, b) => a - b);
    for (const step of steps.slice(0, steps.length - OPEN_STEPS)) {
      this.final.push(this.combine(step, [...this.open.get(step).byRank.values()]));
      this.open.delete(step);
    }
    this.final.sort((a, b) => a.step - b.step);
    if (this.final.length > 2 * this.maxPoints) {
      const merged = [];
      for (let i = 0; i + 1 < this.final.length; i += 2) merged.push(this.mergePair(this.final[i], this.final[i + 1]));
      if (this.final.length % 2) merged.push(this.final[this.final.length - 1]);
      this.final = merged;
    }
  }

  points() {
    const open = [...this.open.entries()].sort((a, b) => a[0] - b[0]).map(([step, e]) => this.combine(step, [...e.byRank.values()]));
    return this.final.concat(open);
  }

  memoryRanks() {
    return [...this.memory.values()];
  }

  lastStep() {
    const pts = this.points();
    return pts.length ? pts[pts.length - 1].step : null;
  }
}
