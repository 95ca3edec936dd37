"""The default deadline of a request's body, for every HTTP server of stockade (``stockade
serve`` and ``stockade mcp`` over HTTP): a module of its own, importing nothing, so that the
command line can show the defaults without the ``server`` extra (``guard`` needs Starlette)."""

from __future__ import annotations

__all__ = ["BODY_TIMEOUT_S", "MIN_BODY_RATE"]

# A body's deadline by default: within 30 s, then at 64 KiB a second (16 MiB within 286 s)
BODY_TIMEOUT_S = 30.0
MIN_BODY_RATE = 64 * 1024
