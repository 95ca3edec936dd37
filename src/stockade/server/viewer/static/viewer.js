// The run viewer's only script: a run that is still going follows its audit trail (Server-Sent
// Events) and reloads the page's body from the server, which renders and escapes it.
"use strict";

const AGAIN_MS = 10000;  // how often a page comes back for a waiting run

function follow(root) {
  const body = root.dataset.body;
  let loading = null;
  let again = false;

  async function refresh(verified) {
    if (loading) { again = true; return loading; }
    loading = (async () => {
      const response = await fetch(body + (verified ? "?verified=1" : ""), { credentials: "same-origin" });
      if (response.ok) {
        root.innerHTML = await response.text();  // server-rendered: every untrusted text escaped there
      }
    })();
    try { await loading; } finally { loading = null; }
    if (again) { again = false; await refresh(verified); }
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
