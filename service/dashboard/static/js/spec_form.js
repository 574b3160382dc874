/**
 * Submit a job from a JSON or YAML spec. The server is the only validator (its 422 names the
 * field and the numbers); this module maps each error's `loc` back onto the spec the user
 * wrote and shows the message beside that field, in a field view of the parsed spec whose
 * inputs edit the text. YAML is parsed by the vendored js-yaml; JSON is YAML too, but JSON
 * text is kept JSON when a field is edited.
 */

import { request, ApiError } from "./api.js";
import { h, replaceChildren, announce } from "./dom.js";

export const EXAMPLE_SPEC = `name: my-gpt
model:
  preset: gpt-mini
data:
  kind: synthetic
  vocab_size: 256
  seq_len: 128
train:
  steps: 200
  global_batch_size: 16
  micro_batch_size: 4
  lr: 0.0003
zero:
  stage: auto
  precision: bf16
resources:
  num_workers: 2
  gpus_per_worker: 0
  cpus_per_worker: 1
checkpoint:
  every_steps: 50
  keep_last: 2
max_failures: 2
`;

const YAML_SRC = "/static/vendor/js-yaml/js-yaml.min.js";
let yamlLoading = null;

/** js-yaml (vendored, MIT) is loaded on first use: most page views never parse YAML. */
function loadYaml() {
  if (window.jsyaml) return Promise.resolve(window.jsyaml);
  yamlLoading ||= new Promise((resolve, reject) => {
    const script = h("script", { src: YAML_SRC });
    script.addEventListener("load", () => resolve(window.jsyaml));
    script.addEventListener("error", () => {
      yamlLoading = null;
      reject(new Error("could not load the YAML parser"));
    });
    document.head.append(script);
  });
  return yamlLoading;
}

/** Parse JSON or YAML text into {value, format} or throw an Error with a readable message. */
export async function parseSpec(text) {
  const trimmed = text.trim();
  if (!trimmed) throw new Error("The spec is empty.");
  if (trimmed.startsWith("{")) {
    try {
      return { value: JSON.parse(trimmed), format: "json" };
    } catch (error) {
      throw new Error(`Not valid JSON: ${error.message}`);
    }
  }
  const jsyaml = await loadYaml();
  let value;
  try {
    value = jsyaml.load(trimmed);
  } catch (error) {
    throw new Error(`Not valid YAML: ${error.reason || error.message}${error.mark ? ` (line ${error.mark.line + 1})` : ""}`);
  }
  if (value === null || typeof value !== "object" || Array.isArray(value)) throw new Error("The spec must be a mapping of fields (e.g. name:, model:, train:).");
  return { value, format: "yaml" };
}

function serialize(value, format) {
  return format === "json" ? `${JSON.stringify(value, null, 2)}\n` : window.jsyaml.dump(value, { lineWidth: 100 });
}

const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

/**
 * Map an error's field onto a path of the user's spec. The server names fields as dotted paths
 * (`{"field": "train.global_batch_size", "message": ...}`); plain FastAPI answers carry a
 * `loc` list instead. Segments that are not keys (union tags) are skipped; a final key the
 * spec lacks (a required field) is kept so it can be shown as a missing field.
 */
export function locateError(spec, error) {
  let segments = error.field ? String(error.field).split(".") : (error.loc || []).map(String);
  if (["body", "query", "path", "header"].includes(segments[0])) segments = segments.slice(1);
  const path = [];
  let cur = spec;
  segments.forEach((seg, i) => {
    const last = i === segments.length - 1;
    if (isObject(cur) && Object.prototype.hasOwnProperty.call(cur, seg)) {
      path.push(seg);
      cur = cur[seg];
    } else if (Array.isArray(cur) && /^\d+$/.test(seg) && Number(seg) < cur.length) {
      path.push(seg);
      cur = cur[Number(seg)];
    } else if (last && isObject(cur) && !/[\[\]]/.test(seg)) {
      path.push(seg);
      cur = undefined;
    }
  });
  return path;
}

const fieldId = (path) => `field-${path.length ? path.join("-") : "spec"}`;
const errorId = (path) => `error-${path.length ? path.join("-") : "spec"}`;

export class SpecForm {
  constructor({ onSubmitted }) {
    this.onSubmitted = onSubmitted;
    this.parsed = null;
    this.textarea = h("textarea", {
      id: "spec-text",
      name: "spec",
      rows: 16,
      spellcheck: "false",
      "aria-describedby": "spec-text-help spec-text-error",
      oninput: () => this.clearTextError(),
    });
    this.textError = h("p", { id: "spec-text-error", class: "field-error", hidden: true });
    this.summary = h("div", { id: "spec-errors", class: "error-summary", role: "alert", tabindex: "-1", hidden: true });
    this.fields = h("div", { id: "spec-fields", class: "spec-fields" });
    this.submitButton = h("button", { type: "submit", class: "primary", text: "Submit job" });
    this.element = h(
      "form",
      { id: "submit-form", class: "submit-form", novalidate: true, onsubmit: (e) => this.submit(e) },
      this.summary,
      h("label", { for: "spec-text", text: "Job spec (JSON or YAML)" }),
      h("p", { id: "spec-text-help", class: "muted small", text: "Unknown fields are rejected; the server names the field and the numbers of anything that cannot hold." }),
      this.textarea,
      this.textError,
      h(
        "div",
        { class: "actions" },
        this.submitButton,
        h("button", { type: "button", text: "Insert example", onclick: () => this.setText(EXAMPLE_SPEC) }),
      ),
      this.fields,
    );
  }

  setText(text) {
    this.textarea.value = text;
    this.clearTextError();
    this.textarea.focus();
  }

  clearTextError() {
    this.textError.hidden = true;
    this.textarea.removeAttribute("aria-invalid");
  }

  showTextError(message) {
    this.textError.textContent = message;
    this.textError.hidden = false;
    this.textarea.setAttribute("aria-invalid", "true");
    this.textarea.focus();
  }

  async submit(event) {
    event.preventDefault();
    this.summary.hidden = true;
    let parsed;
    try {
      parsed = await parseSpec(this.textarea.value);
    } catch (error) {
      replaceChildren(this.fields);
      this.showTextError(error.message);
      return;
    }
    this.parsed = parsed;
    this.submitButton.disabled = true;
    try {
      const job = await request("/jobs", { method: "POST", body: parsed.value });
      replaceChildren(this.fields);
      this.textarea.value = "";
      announce(`Job ${job.name || job.id} submitted.`);
      this.onSubmitted(job);
    } catch (error) {
      const body = (error instanceof ApiError && error.body) || {};
      const fieldErrors = Array.isArray(body.errors) && body.errors.length ? body.errors : Array.isArray(body.detail) ? body.detail : null;
      if (error.status === 422 && fieldErrors) {
        this.showFieldErrors(fieldErrors);
      } else {
        this.showSummary([{ path: [], msg: error.message }]);
      }
    } finally {
      this.submitButton.disabled = false;
    }
  }

  showSummary(errors) {
    replaceChildren(
      this.summary,
      h("h3", { text: errors.length === 1 ? "The job was not submitted: 1 problem" : `The job was not submitted: ${errors.length} problems` }),
      h(
        "ul",
        {},
        errors.map((e) =>
          h("li", {}, e.path.length ? h("a", { href: `#${fieldId(e.path)}`, text: `${e.path.join(".")}: ` }) : null, e.msg),
        ),
      ),
    );
    this.summary.hidden = false;
    this.summary.focus();
  }

  showFieldErrors(list) {
    const errors = list.map((e) => ({ path: locateError(this.parsed.value, e), msg: e.message || e.msg || String(e) }));
    this.renderFields(errors);
    this.showSummary(errors);
  }

  /** The parsed spec as labelled inputs (one per leaf), each error beside its field. */
  renderFields(errors) {
    const byPath = new Map();
    for (const e of errors) {
      const key = e.path.join(".");
      byPath.set(key, [...(byPath.get(key) || []), e.msg]);
    }
    const used = new Set();
    const errorFor = (path) => {
      const key = path.join(".");
      const messages = byPath.get(key);
      if (!messages) return null;
      used.add(key);
      return h("p", { class: "field-error", id: errorId(path), "data-field": key, text: messages.join(" ") });
    };
    const leaf = (path, value, missing = false) => {
      const message = errorFor(path);
      const input = h("input", {
        id: fieldId(path),
        name: path.join("."),
        type: "text",
        value: missing ? "" : typeof value === "string" ? value : JSON.stringify(value),
        placeholder: missing ? "(missing)" : null,
        "aria-invalid": message ? "true" : null,
        "aria-describedby": message ? errorId(path) : null,
        onchange: (e) => this.editField(path, e.target.value),
      });
      return h("div", { class: `field${message ? " invalid" : ""}`, "data-field": path.join(".") }, h("label", { for: fieldId(path), text: path[path.length - 1] }), input, message);
    };
    const group = (path, obj) => {
      const rows = Object.entries(obj).map(([k, v]) => (isObject(v) ? group([...path, k], v) : leaf([...path, k], v)));
      // Errors about keys this object lacks (e.g. "Field required") get an empty input here.
      for (const e of errors) {
        if (e.path.length === path.length + 1 && e.path.slice(0, -1).join(".") === path.join(".") && !(e.path[e.path.length - 1] in obj)) {
          if (!used.has(e.path.join("."))) rows.push(leaf(e.path, undefined, true));
        }
      }
      const message = errorFor(path);
      if (!path.length) return h("div", { class: "field-root" }, message, rows);
      return h(
        "fieldset",
        { id: fieldId(path), class: message ? "invalid" : null, "aria-describedby": message ? errorId(path) : null, "data-field": path.join(".") },
        h("legend", { text: path[path.length - 1] }),
        message,
        rows,
      );
    };
    replaceChildren(
      this.fields,
      h("h3", { text: "Spec fields" }),
      h("p", { class: "muted small", text: "Edit a field here or the text above, then submit again." }),
      group([], this.parsed.value),
    );
  }

  editField(path, raw) {
    let value = raw;
    try {
      value = JSON.parse(raw);
    } catch {
      /* keep as a string */
    }
    let cur = this.parsed.value;
    for (const key of path.slice(0, -1)) {
      if (!isObject(cur[key])) cur[key] = {};
      cur = cur[key];
    }
    cur[path[path.length - 1]] = value;
    this.textarea.value = serialize(this.parsed.value, this.parsed.format);
  }
}
