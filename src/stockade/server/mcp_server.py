"""``stockade mcp``: the agent tools as an MCP server (the official ``mcp`` SDK), over stdio or
streamable HTTP, with a sandbox per client session.

A thin shell over ``mcp_session``: each MCP session is an agent run whose model is the client
(``McpSession``), so the policy, the limits, the kill switch, approvals and the audit trail
are the agent's own. The server only speaks the protocol:

- ``tools/list``, ``tools/call``: the toolset's tools the role allows (run_code, run_tests,
  read_file, write_file, apply_patch, list_files, git_diff); a call's observation is the
  result, an error or a denial is ``isError`` with the reason the model of a run would read;
- ``resources/list``, ``resources/read``: ``stockade://workspace/<path>`` for each file the
  policy lets the session read, ``stockade://session/diff`` (the session's changes) and
  ``stockade://session`` (its run id, for ``stockade kill`` or ``stockade runs show``); a
  read or a listing is the call of read_file, git_diff or list_files (judged, limited and
  recorded as that call), its content the call's result;
- whatever a handler raises is that request's error, never the server's end;
- an action the policy sends for approval is asked through the client when it supports
  elicitation (a yes/no form: ``elicitation/create`` on the handshake versions; on 2026-07-28,
  an ``InputRequiredResult`` whose answer comes with the client's retry of the call);
  otherwise the call waits for ``stockade approve RUN REQUEST`` (or the run viewer's button)
  for ``approval_wait_s``, and is denied, with the reason recorded, when nobody decided.

Sessions. Over stdio the process serves one client: that is the session. Over HTTP a session
is the transport's (``Mcp-Session-Id``, the handshake protocol versions); it ends when the
client deletes it, when it has been idle for ``idle_timeout_s``, or when the server stops.
The 2026-07-28 protocol has no sessions over HTTP: a client that probes for it is answered
so that it falls back to a session (``server/discover`` is refused there).

Where each part lives: the handlers and the sessions in ``mcp_face`` (``McpFace``), what a
paused call asks and of whom in ``mcp_approvals``, the transports in ``mcp_stdio`` and
``mcp_http``; this module names the server's entry points.
"""

from __future__ import annotations

from stockade.server.mcp_face import McpFace
from stockade.server.mcp_http import http_app, serve_http
from stockade.server.mcp_stdio import serve_stdio

__all__ = ["McpFace", "http_app", "serve_http", "serve_stdio"]
