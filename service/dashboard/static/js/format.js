/** Human formats for the numbers the dashboard shows: bytes, rates, durations, ages, states. */

// Decimal units, as everywhere else in zerotrain (contract/zero_math.py: GB = 1e9 bytes): the
// CLI's tables, the spec's gpu_memory_gb and bucket_mb, the workers' log lines.
const BYTE_UNITS = ["B", "kB", "MB", "GB", "TB"];

export function bytes(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  let v = Number(value);
  let unit = 0;
  while (Math.abs(v) >= 1000 && unit < BYTE_UNITS.length - 1) {
    v /= 1000;
    unit += 1;
  }
  return `${v.toFixed(unit === 0 ? 0 : v < 10 ? 2 : 1)} ${BYTE_UNITS[unit]}`;
}

export function number(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const v = Number(value);
  const abs = Math.abs(v);
  if (abs !== 0 && (abs >= 1e6 || abs < 1e-3)) return v.toExponential(2);
  if (abs >= 1000) return Math.round(v).toLocaleString("en-US");
  return Number(v.toPrecision(digits)).toString();
}

export function compact(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const v = Number(value);
  const abs = Math.abs(v);
  for (const [scale, suffix] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (abs >= scale) return `${(v / scale).toFixed(abs / scale < 10 ? 2 : 1)}${suffix}`;
  }
  return number(v);
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function parseTime(value) {
  if (value === null || value === undefined) return null;
  if (typeof value === "number") return new Date(value * 1000);
  // Timestamps without a zone are UTC on the server.
  const text = /[zZ]|[+-]\d\d:?\d\d$/.test(value) ? value : `${value}Z`;
  const date = new Date(text);
  return Number.isNaN(date.getTime()) ? null : date;
}

export function age(value, now = Date.now()) {
  const date = parseTime(value);
  return date ? duration((now - date.getTime()) / 1000) : "–";
}

export function timestamp(value) {
  const date = parseTime(value);
  return date ? date.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z") : "–";
}

export const TERMINAL_STATES = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
export const ALL_STATES = ["QUEUED", "STARTING", "RUNNING", "RESTARTING", "CANCELLING", "SUCCEEDED", "FAILED", "CANCELLED"];

/** A glyph per state so that the state reads without colour, next to its name. */
const STATE_GLYPHS = {
  QUEUED: "◷", STARTING: "◔", RUNNING: "▶", RESTARTING: "↻", CANCELLING: "◌",
  SUCCEEDED: "✓", FAILED: "✗", CANCELLED: "⊘",
};

export function stateGlyph(state) {
  return STATE_GLYPHS[state] || "•";
}
