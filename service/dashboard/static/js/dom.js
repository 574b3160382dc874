/**
 * A tiny hyperscript helper: the dashboard builds its DOM with `h()` instead of innerHTML so
 * that no server-provided string (job names, log lines, reasons) is ever parsed as HTML.
 */

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "text") el.textContent = value;
    else if (value === true) el.setAttribute(key, "");
    else el.setAttribute(key, String(value));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Replace every child of `el` with `children`. */
export function replaceChildren(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

/** Tell screen-reader users about something that changed without moving their focus. */
export function announce(message) {
  const region = document.getElementById("announcer");
  if (region) region.textContent = message;
}

/**
 * Replace the children of `el` while keeping keyboard focus: a periodic refresh must not throw
 * a keyboard user's focus back to the top of the page. Focusable elements that should survive
 * a refresh carry a stable `data-focus-key`.
 */
export function replaceKeepingFocus(el, ...children) {
  const active = document.activeElement;
  const key = active && el.contains(active) ? active.dataset.focusKey : null;
  replaceChildren(el, ...children);
  if (key) {
    const again = el.querySelector(`[data-focus-key="${CSS.escape(key)}"]`);
    if (again) again.focus();
  }
  return el;
}
