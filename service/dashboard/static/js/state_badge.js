/** A job state as coloured text with a glyph: readable without colour, announced as text. */

import { h } from "./dom.js";
import { stateGlyph } from "./format.js";

export function stateBadge(state) {
  return h(
    "span",
    { class: `state state-${String(state).toLowerCase()}`, "data-state": state },
    h("span", { "aria-hidden": "true", class: "glyph", text: stateGlyph(state) }),
    ` ${state}`,
  );
}
