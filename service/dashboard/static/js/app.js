/**
 * Entry point: sign-in with an API token, and a router (`/` jobs, `/jobs/compare?ids=…` runs
 * side by side, `/jobs/{id}` a job) over the History API, so moving between pages never reloads the document. Each view
 * gets an AbortSignal that stops its timers and streams when the user leaves it.
 */

import { request, session, ApiError } from "./api.js";
import { h, replaceChildren } from "./dom.js";
import { jobsPage } from "./jobs_page.js";
import { jobPage } from "./job_page.js";
import { comparePage } from "./compare_page.js";

const main = document.getElementById("main");
const logoutButton = document.getElementById("logout");
const whoami = document.getElementById("whoami");
let current = null; // AbortController of the view on screen

function navigate(url, { replace = false } = {}) {
  if (replace) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  render();
}

function loginView(message = "") {
  const input = h("input", {
    id: "token",
    name: "token",
    type: "password",
    autocomplete: "off",
    required: true,
    "aria-describedby": "token-help token-error",
  });
  const error = h("p", { id: "token-error", class: "field-error", hidden: !message, text: message });
  const submit = h("button", { type: "submit", class: "primary", text: "Sign in" });
  const form = h(
    "form",
    { class: "login", novalidate: true },
    h("label", { for: "token", text: "API token" }),
    h("p", { id: "token-help", class: "muted small", text: "Kept in this tab's session storage only. `zerotrain token create` makes one; the local admin token is in ~/.zerotrain/token." }),
    input,
    error,
    h("div", { class: "actions" }, submit),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const token = input.value.trim();
    if (!token) {
      error.textContent = "Enter a token.";
      error.hidden = false;
      input.setAttribute("aria-invalid", "true");
      input.focus();
      return;
    }
    submit.disabled = true;
    session.set(token);
    try {
      const me = await request("/dashboard/whoami", { signOutOn401: false });
      session.setUser(me);
      render();
    } catch (err) {
      session.clear();
      error.textContent = err instanceof ApiError && err.status === 401 ? "That token was not accepted." : `Could not sign in: ${err.message}`;
      error.hidden = false;
      input.setAttribute("aria-invalid", "true");
      input.focus();
    } finally {
      submit.disabled = false;
    }
  });
  return { element: h("div", { class: "page login-page" }, h("h1", { text: "Sign in" }), form), title: "Sign in", focus: input };
}

/** "Signed in as alice" in the header; asks the server once if this tab does not know yet. */
function showWho() {
  const me = session.user;
  if (!session.token) whoami.textContent = "";
  else if (me) whoami.textContent = `Signed in as ${me.name}${me.is_admin ? " (admin: sees all jobs)" : ""}`;
  else {
    whoami.textContent = "Signed in";
    request("/dashboard/whoami").then((user) => {
      session.setUser(user);
      showWho();
    }, () => {});
  }
}

function notFound() {
  return { element: h("div", { class: "page" }, h("h1", { text: "Not found" }), h("p", {}, h("a", { href: "/", "data-nav": true, text: "← All jobs" }))), title: "Not found" };
}

function route(signal) {
  const path = location.pathname.replace(/\/+$/, "") || "/";
  if (path === "/") return jobsPage({ navigate, signal });
  if (path === "/jobs/compare") return comparePage({ signal });
  const match = path.match(/^\/jobs\/([^/]+)$/);
  if (match) return jobPage({ jobId: decodeURIComponent(match[1]), signal });
  return notFound();
}

function render(message = "") {
  if (current) current.abort();
  current = new AbortController();
  const signedIn = Boolean(session.token);
  logoutButton.hidden = !signedIn;
  showWho();
  const view = signedIn ? route(current.signal) : loginView(message);
  document.title = `${view.title} · zerotrain`;
  replaceChildren(main, view.element);
  main.setAttribute("aria-busy", "false");
  if (view.focus) view.focus.focus();
  else main.focus({ preventScroll: true });
}

document.addEventListener("click", (event) => {
  const link = event.target.closest && event.target.closest("a[data-nav]");
  if (!link || event.defaultPrevented || event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey || event.altKey) return;
  event.preventDefault();
  navigate(link.getAttribute("href"));
});
window.addEventListener("popstate", () => render());
window.addEventListener("zerotrain:unauthorized", () => {
  session.clear();
  render("Your token was refused (revoked or wrong); sign in again.");
});
logoutButton.addEventListener("click", () => {
  session.clear();
  render();
});

render();
