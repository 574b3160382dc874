/**
 * Predicted against measured step time, the way the memory bars show predicted against measured
 * memory: the prediction is the planner's from the rates the job's ranks measured at start
 * (`step_time` of the chart answer), the measurement the median `step_time_s` of the latest steps.
 */
import { number } from "./format.js";

export const MEASURED_STEPS = 20; // the median of this many latest steps (the first step of an attempt warms up)

const s = (v) => `${number(v)} s`;

/** The median step time of the latest points (the first step left out while there are others). */
export function measuredStepTime(points) {
  const times = points.filter((p) => p.step > 1 && Number.isFinite(p.step_time_s)).slice(-MEASURED_STEPS)
    .map((p) => p.step_time_s).sort((a, b) => a - b);
  if (!times.length) return null;
  const mid = Math.floor(times.length / 2);
  return times.length % 2 ? times[mid] : (times[mid - 1] + times[mid]) / 2;
}

/** One sentence: the prediction and its terms, the measurement, their ratio; "" with no prediction. */
export function stepTimeText(stepTime, points) {
  if (!stepTime || !Number.isFinite(stepTime.step_time_s)) return "";
  const parts = [["compute", stepTime.compute_time_s], ["communication", stepTime.comm_time_s],
    ["optimizer", stepTime.optimizer_time_s], ["disk", stepTime.disk_time_s]]
    .filter(([, v]) => Number.isFinite(v)).map(([name, v]) => `${name} ${s(v)}`);
  // NVMe: the disk's reads and writes overlap the work; what the step waits for is the exposed part
  if (Number.isFinite(stepTime.disk_exposed_s) && Number.isFinite(stepTime.disk_time_s)) {
    parts[parts.length - 1] = `disk ${s(stepTime.disk_exposed_s)} exposed of ${s(stepTime.disk_time_s)}`;
  }
  const terms = parts.join(", ");
  let text = `Predicted step time ${s(stepTime.step_time_s)} (${terms}; from the rates the ranks measured at the start of attempt ${stepTime.attempt})`;
  const measured = measuredStepTime(points);
  if (measured !== null) text += `; measured ${s(measured)} (median of the latest steps), predicted/measured ${number(stepTime.step_time_s / measured, 2)}`;
  return `${text}.`;
}
