/**
 * The job page's log panel, following the log as it grows: the first read is the log's tail,
 * each later one asks only for what came after (`GET …/logs?offset=`, the previous answer's
 * `Zerotrain-Log-Bytes`), so what the panel shows stays and new lines are appended, however
 * long the log. An answer smaller than the offset is a new log (a restarted driver's): it
 * replaces the text. The page polls while the job runs and stops once it ended (job_page.js).
 * At most KEEP_CHARS are kept: the oldest whole lines go first. A follower with a `rank` reads
 * only that rank's lines (`rank=`; the offsets then count bytes of those lines, as the API's do).
 */

import { requestText } from "./api.js";

export const TAIL_BYTES = 64 * 1024;
const KEEP_CHARS = 2 * 1024 * 1024;
const SIZE_HEADER = "Zerotrain-Log-Bytes";

export class LogFollower {
  constructor(path, rank = null) {
    this.path = path; // `/jobs/{id}/logs`
    this.rank = rank; // null: every line
    this.text = "";
    this.offset = null; // bytes of the log already shown; null before the first read
    this.inFlight = null;
  }

  /** Read what is new; resolves to the whole text to show. One read at a time: a poll that
   * comes while a read is in flight gets that read's answer (the same offset read twice would
   * append its text twice). */
  read({ signal } = {}) {
    if (!this.inFlight) this.inFlight = this.readNew(signal).finally(() => (this.inFlight = null));
    return this.inFlight;
  }

  async readNew(signal) {
    let query = this.offset === null ? `tail_bytes=${TAIL_BYTES}` : `offset=${this.offset}`;
    if (this.rank !== null) query += `&rank=${this.rank}`;
    const { text, headers } = await requestText(`${this.path}?${query}`, { signal });
    const size = Number(headers.get(SIZE_HEADER));
    if (this.offset === null || !Number.isFinite(size) || size < this.offset) this.text = text;
    else this.text += text;
    this.offset = Number.isFinite(size) ? size : null;
    if (this.text.length > KEEP_CHARS) {
      const cut = this.text.indexOf("\n", this.text.length - KEEP_CHARS);
      this.text = this.text.slice(cut + 1);
    }
    return this.text;
  }
}
