/**
 * The queue and preemption in words: why a job waits (its reason as a phrase, the scheduler's
 * message under it), which running jobs it is making room for, and when a job was preempted
 * and for whom. The jobs named come from `/dashboard/preemption` (service/dashboard/preemption.py),
 * which names only jobs the viewer may see; any other is "another job", never its id.
 */

import { h } from "./dom.js";
import { timestamp } from "./format.js";

/** The reasons of contract/reasons.py a user reads in the list, as phrases; others are spelled out. */
const REASON_PHRASES = {
  submitted: "Submitted",
  insufficient_resources: "Waiting for resources",
  user_limit: "Owner's limit reached",
  team_quota: "Team quota reached",
  service_limit: "Service limit reached",
  preempting: "Preempting lower-priority jobs",
  preempted: "Preempted",
  preemption_requested: "Asked to make room",
  resources_acquired: "Resources acquired",
  claimed: "Starting",
  cancelled_by_user: "Cancelled",
};

export function reasonPhrase(reason) {
  if (!reason) return "–";
  const phrase = REASON_PHRASES[reason] || reason.replace(/_/g, " ");
  return phrase.charAt(0).toUpperCase() + phrase.slice(1);
}

/** A job the viewer may see, linked, with its priority and team: `name (priority 0, team red)`. */
function jobLink(job) {
  const link = h("a", { href: `/jobs/${encodeURIComponent(job.id)}`, "data-nav": true, class: "job-ref", "data-job-ref": job.id, text: job.name });
  return [link, ` (priority ${job.priority}${job.team ? `, team ${job.team}` : ""})`];
}

function joined(parts) {
  return parts.flatMap((part, i) => (i === 0 ? [part] : [i === parts.length - 1 ? " and " : ", ", part]));
}

/** "Stopping A (priority 0, team red) and another job at their next checkpoint to make room." */
function makingRoom(info) {
  const parts = info.asked.map(jobLink);
  if (info.asked_hidden) parts.push(info.asked_hidden === 1 ? "another job" : `${info.asked_hidden} other jobs`);
  const many = info.asked.length + info.asked_hidden > 1;
  if (info.shrink_to) {  // one elastic job gives up some of its workers: "Shrinking A to 1 worker at …"
    const size = `${info.shrink_to} worker${info.shrink_to === 1 ? "" : "s"}`;
    return h("p", { class: "making-room" }, "Shrinking ", joined(parts), ` to ${size} at its next checkpoint to make room for it.`);
  }
  return h("p", { class: "making-room" }, "Stopping ", joined(parts), ` at ${many ? "their" : "its"} next checkpoint to make room for it.`);
}

/** "Preempted at 2026-…Z for job H" (linked), or "for another job" the viewer may not see. */
export function preemptedLine(entry) {
  return h(
    "p",
    { class: "preempted-line" },
    "Preempted at ",
    h("time", { datetime: entry.at, text: timestamp(entry.at) }),
    entry.for_job ? [" for job ", jobLink(entry.for_job)] : " for another job",
    ".",
  );
}

/** Reasons whose messages name other jobs by id: shown through the endpoint's answer instead. */
export const NAMES_JOBS = new Set(["preempting", "preempted"]);

/** A job page's lines: the jobs it is making room for, then each time it was preempted. */
export function preemptionLines(info) {
  if (!info) return [];
  return [info.asked.length + info.asked_hidden ? makingRoom(info) : null, ...info.preempted.map(preemptedLine)];
}

/**
 * The queue's reason cell: the reason as a phrase and, for a QUEUED job, why it waits — the
 * jobs it is making room for, or the scheduler's message — and, for a job back in the queue
 * because it was preempted (a QUEUED job that ran), when and for whom that was.
 */
export function reasonCell(job, info) {
  const namesJobs = NAMES_JOBS.has(job.reason);
  const cell = h("td", { class: "reason", "data-reason": job.reason || "", title: namesJobs ? null : job.message || null },
    h("span", { class: "reason-phrase", text: reasonPhrase(job.reason) }));
  if (job.state !== "QUEUED") return cell;
  const why = [];
  if (job.reason === "preempting" && info && info.asked.length + info.asked_hidden) why.push(makingRoom(info));
  else if (job.message && !namesJobs) why.push(h("p", { class: "wait-message", text: job.message }));
  if (info && info.preempted.length) why.push(preemptedLine(info.preempted[info.preempted.length - 1]));
  for (const line of why) line.classList.add("why-waiting", "small");
  cell.append(...why);
  return cell;
}
