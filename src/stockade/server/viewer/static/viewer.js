// The run viewer's only script: a run that is still going follows its audit trail (Server-Sent
// Events) and asks the server for what came after the last event the page shows: the run's
// head and tail again, and only the new entries, rendered and escaped there. The page keeps
// its newest MAX_ENTRIES; older ones are a link away.
"use strict";

const AGAIN_MS = 10000;  // how often a page comes back for a waiting run
const MAX_ENTRIES = 1000;

function adopt(target, fresh) {
  if (target && fresh) { target.replaceChildren(...fresh.childNodes); }
}

function append(steps, fresh) {
  for (const step of Array.from(fresh.children)) {
    const last = steps.lastElementChild;
    if (last && last.dataset.step === step.dataset.step) {
      last.querySelector("ol").append(...step.querySelector("ol").children);
    } else {
      steps.append(step);
    }
  }
  const entries = steps.querySelectorAll("li.entry");
  let cut = entries.length - MAX_ENTRIES;
  for (const entry of entries) {
    if (cut-- <= 0) { break; }
    const step = entry.closest(".step");
    entry.remove();
    if (!step.querySelector("li.entry")) { step.remove(); }
  }
  const first = steps.querySelector("li.entry");
  const earlier = document.getElementById("earlier");
  if (entries.length > MAX_ENTRIES && first && earlier) {
    document.getElementById("earlier-link").search = "?before=" + first.dataset.seq;
    earlier.hidden = false;
  }
  const nothing = document.getElementById("nothing");
  if (nothing && first) { nothing.remove(); }
}

function follow(root) {
  const body = root.dataset.body;
  let shown = root.dataset.shown || "0";  // the last event the page shows
  let loading = null;
  let again = false;
  let verify = false;  // once the run ended: its chain is checked (a slower answer)

  async function refresh(verified) {
    if (verified) { verify = true; }
    if (loading) { again = true; return loading; }
    loading = (async () => {
      const steps = document.getElementById("steps");
      const last = steps ? steps.lastElementChild : null;
      const query = "?after=" + encodeURIComponent(shown) + "&step=" + encodeURIComponent(last ? last.dataset.step : "0");
      const response = await fetch(body + query + (verify ? "&verified=1" : ""), { credentials: "same-origin" });
      if (!response.ok) { return; }
      const delta = document.createElement("template");
      delta.innerHTML = await response.text();  // server-rendered: every untrusted text escaped there
      const update = delta.content;
      adopt(document.getElementById("run-head"), update.getElementById("delta-head"));
      adopt(document.getElementById("run-tail"), update.getElementById("delta-tail"));
      const entries = update.getElementById("delta-entries");
      if (steps && entries) {
        append(steps, entries);
        shown = entries.dataset.last || shown;
        if (entries.dataset.more) { again = true; }  // more came than one answer holds
      }
    })();
    try { await loading; } finally { loading = null; }
    if (again) { again = false; await refresh(false); }
  }

  // where the page is: a stream that finds the run there says nothing until it moves
  let after = root.dataset.after || "0";
  let status = root.dataset.status || "";

  function listen() {
    const source = new EventSource(
      root.dataset.events + "?after=" + encodeURIComponent(after) + "&status=" + encodeURIComponent(status));
    source.addEventListener("changed", (event) => {
      const moved = JSON.parse(event.data);
      after = String(moved.seq);
      status = moved.status;
      refresh(false);
    });
    source.addEventListener("end", (event) => {
      source.close();
      const ended = JSON.parse(event.data || "{}");
      if (ended.signed_out) {
        window.location.reload();  // the session is over: the page sends us to sign in
        return;
      }
      if (ended.waits) {
        // paused or broken: the server does not watch it for us; a decision (here or
        // elsewhere) sends it on, and a look now and then finds that
        setTimeout(listen, AGAIN_MS);
        return;
      }
      refresh(true).then(() => { root.removeAttribute("data-live"); root.dataset.ended = "1"; });
    });
    source.onerror = () => {
      // a dropped stream is reopened by the browser; a refused one (too many open) is not
      if (source.readyState === EventSource.CLOSED) { setTimeout(listen, AGAIN_MS); }
    };
  }
  listen();
}

document.addEventListener("DOMContentLoaded", () => {
  const root = document.getElementById("run");
  if (root && root.dataset.live) {
    follow(root);
  }
});
