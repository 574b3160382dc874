/**
 * The smoothed throughput line drawn over the raw one on the job page. Computed here and only
 * here, from the points the page draws (the server's downsampled history plus the live
 * records): the server sends raw numbers, so a live point is smoothed exactly like a stored one.
 *
 * [Note: why a moving median] A step's tokens/s spikes when a checkpoint, an evaluation or a
 * garbage collection stalls one rank: one slow step out of many. A mean of the neighbours is
 * dragged by such a spike; a median of them ignores it until half the window is slow, and
 * then follows a real change of speed (a smaller batch, a restart on fewer nodes) within half
 * a window. The window is centred, so the line does not lag behind the raw points; at the
 * ends it holds the points there are.
 */

export const SMOOTH_WINDOW = 9;
const SMOOTH_PREFIX = "smoothed:";
export const smoothedKey = (key) => SMOOTH_PREFIX + key;

function median(values) {
  const xs = values.slice().sort((a, b) => a - b);
  const mid = xs.length >> 1;
  return xs.length % 2 ? xs[mid] : (xs[mid - 1] + xs[mid]) / 2;
}

/** Sets `point[smoothedKey(key)]` on each point: the median of `key` over the `window` points
 * centred on it (its finite values; null where there are none). */
export function addMovingMedian(points, key, window = SMOOTH_WINDOW) {
  const half = window >> 1;
  const target = smoothedKey(key);
  for (let i = 0; i < points.length; i++) {
    const around = [];
    for (let j = Math.max(0, i - half); j <= Math.min(points.length - 1, i + half); j++) {
      if (Number.isFinite(points[j][key])) around.push(points[j][key]);
    }
    points[i][target] = Number.isFinite(points[i][key]) && around.length ? median(around) : null;
  }
}

/** The series spec of the smoothed line of `series` (a chart answer's series spec). */
export function smoothedSeries(series, window = SMOOTH_WINDOW) {
  return {
    ...series,
    key: smoothedKey(series.key),
    label: `${series.label}, median of ${window} points`,
    faint: false,
    width: 3,
    envelope: undefined,
  };
}
