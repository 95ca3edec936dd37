// The run viewer's only script: a run that is still going follows its audit trail (Server-Sent
// Events) and reloads the page's body from the server, which renders and escapes it.
"use strict";

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

  const source = new EventSource(root.dataset.events + "?after=" + encodeURIComponent(root.dataset.after || "0"));
  source.addEventListener("changed", () => { refresh(false); });
  source.addEventListener("end", () => {
    source.close();
    refresh(true).then(() => { root.removeAttribute("data-live"); root.dataset.ended = "1"; });
  });
  source.onerror = () => { /* the browser reconnects by itself */ };
}

document.addEventListener("DOMContentLoaded", () => {
  const root = document.getElementById("run");
  if (root && root.dataset.live) {
    follow(root);
  }
});
