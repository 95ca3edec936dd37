"""Structured JSON logs through a logger you own: nothing global is configured.

    log = json_logger(sys.stderr, redactor=redactor)
    log.info("tool_call", tool="run_code", exit_code=0)
    # {"tool": "run_code", "exit_code": 0, "event": "tool_call", "level": "info", "timestamp": "..."}

The same ``Redactor`` as the audit trail runs before rendering, so a registered secret never
reaches the stream.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import structlog

from stockade.audit.redact import Redactor

__all__ = ["json_logger"]


def json_logger(stream: TextIO | None = None, *, redactor: Redactor | None = None) -> Any:
    """A structlog logger writing one JSON object per line to ``stream`` (stderr by default).

    Built with ``structlog.wrap_logger``: ``structlog.configure`` (global) is never called.
    """
    redact = redactor if redactor is not None else Redactor()
    return structlog.wrap_logger(
        structlog.PrintLogger(stream if stream is not None else sys.stderr),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact.structlog_processor,
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
    )
