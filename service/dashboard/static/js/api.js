/**
 * The dashboard's only door to the control plane: bearer-token REST calls and server-sent
 * events read through fetch() (EventSource cannot send an Authorization header, and a token in
 * a query string would land in access logs). The token lives in sessionStorage: it survives a
 * reload of the tab and disappears with it.
 */

const TOKEN_KEY = "zerotrain.token";
const USER_KEY = "zerotrain.user";
export const API = "/api/v1";

export const session = {
  get token() {
    return sessionStorage.getItem(TOKEN_KEY);
  },
  set(token) {
    sessionStorage.setItem(TOKEN_KEY, token);
  },
  /** {name, is_admin} of the token, for the header; null until known. */
  get user() {
    try {
      return JSON.parse(sessionStorage.getItem(USER_KEY));
    } catch {
      return null;
    }
  },
  setUser(user) {
    sessionStorage.setItem(USER_KEY, JSON.stringify(user));
  },
  clear() {
    sessionStorage.removeItem(TOKEN_KEY);
    sessionStorage.removeItem(USER_KEY);
  },
};

export class ApiError extends Error {
  constructor(status, body) {
    super(ApiError.describe(status, body));
    this.status = status;
    this.body = body;
  }

  static describe(status, body) {
    const detail = body && body.detail;
    if (typeof detail === "string") return `${status}: ${detail}`;
    if (Array.isArray(detail) && detail.length) return `${status}: ${detail.map((d) => d.msg).join("; ")}`;
    return `HTTP ${status}`;
  }
}

function headers(extra = {}) {
  const result = { Accept: "application/json", ...extra };
  if (session.token) result.Authorization = `Bearer ${session.token}`;
  return result;
}

function unauthorized() {
  window.dispatchEvent(new CustomEvent("zerotrain:unauthorized"));
}

/**
 * JSON request to `/api/v1{path}`; throws ApiError on any non-2xx answer. A 401 also signs the
 * tab out (the app shows the sign-in form) unless `signOutOn401` is false (the sign-in check).
 */
export async function request(path, { method = "GET", body, signal, extraHeaders, signOutOn401 = true } = {}) {
  const init = { method, signal, headers: headers(extraHeaders) };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  const response = await fetch(`${API}${path}`, init);
  const text = await response.text();
  let data = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = { detail: text };
    }
  }
  if (!response.ok) {
    if (response.status === 401 && signOutOn401) unauthorized();
    throw new ApiError(response.status, data);
  }
  return data;
}

/** GET `/api/v1{path}` as plain text (logs), with the answer's headers. */
export async function requestText(path, { signal } = {}) {
  const response = await fetch(`${API}${path}`, { signal, headers: headers({ Accept: "text/plain, application/json" }) });
  if (!response.ok) {
    if (response.status === 401) unauthorized();
    let body = null;
    try {
      body = await response.json();
    } catch {
      /* not JSON */
    }
    throw new ApiError(response.status, body);
  }
  return { text: await response.text(), contentType: response.headers.get("Content-Type") || "", headers: response.headers };
}

/** Split an SSE byte stream into events ({event, data, id}); see the WHATWG SSE grammar. */
export function createSseParser(onEvent) {
  let buffer = "";
  let event = { event: "message", data: [], id: null };
  const dispatch = () => {
    if (event.data.length) onEvent({ event: event.event, data: event.data.join("\n"), id: event.id });
    event = { event: "message", data: [], id: null };
  };
  return (chunk) => {
    buffer += chunk;
    const lines = buffer.split(/\r\n|\r|\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (line === "") {
        dispatch();
        continue;
      }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon === -1 ? line : line.slice(0, colon);
      let value = colon === -1 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") event.event = value;
      else if (field === "data") event.data.push(value);
      else if (field === "id") event.id = value;
    }
  };
}

/**
 * Follow an SSE endpoint until `signal` aborts, reconnecting with Last-Event-ID after a drop.
 * Resolves when the server ends the stream with an `end` event (a finished job).
 */
export async function followEvents(path, { signal, onEvent, onStatus = () => {}, retryMs = 1000 }) {
  let lastId = null;
  while (!signal.aborted) {
    let ended = false;
    try {
      const extra = { Accept: "text/event-stream" };
      if (lastId) extra["Last-Event-ID"] = lastId;
      const response = await fetch(`${API}${path}`, { signal, headers: headers(extra), cache: "no-store" });
      if (response.status === 401) {
        unauthorized();
        return;
      }
      // Another 4xx (the job is gone or not ours) will not heal by retrying.
      if (response.status >= 400 && response.status < 500 && response.status !== 429) {
        onStatus("stopped");
        return;
      }
      if (!response.ok || !response.body) throw new ApiError(response.status, null);
      onStatus("live");
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      const feed = createSseParser((ev) => {
        if (ev.id) lastId = ev.id;
        if (ev.event === "end") ended = true;
        onEvent(ev);
      });
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        feed(value);
      }
    } catch (error) {
      if (signal.aborted) return;
      onStatus("reconnecting");
    }
    if (ended || signal.aborted) return;
    onStatus("reconnecting");
    await new Promise((resolve) => setTimeout(resolve, retryMs));
  }
}
