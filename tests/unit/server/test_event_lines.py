"""How the SDK reads a run's event stream (``RemoteRun.events`` and its async twin share it):
audit events, the service's status and end events, and the error event a stream ends with when
its token was taken out meanwhile, which raises the error it stands for."""

from __future__ import annotations

import json

import pytest

from stockade import exceptions as exc
from stockade.client.client import EventLines, RunEvent


def read(lines: EventLines, text: str) -> list[RunEvent]:
    events = (lines.feed(line) for line in text.split("\n"))
    return [event for event in events if event is not None]


def test_audit_events_and_the_end_come_through_in_order() -> None:
    lines = EventLines()
    stream = (
        'id: 3\nevent: tool_call\ndata: {"attributes": {"tool": "run_code"}}\n\n'
        'id: 4\nevent: error\ndata: {"attributes": {"error": "the model failed"}}\n\n'  # an audit "error"
        'event: end\ndata: {"run_id": "r", "status": "success"}\n\n'
    )
    events = read(lines, stream)
    assert [(e.kind, e.seq) for e in events] == [("tool_call", 3), ("error", 4), ("end", 0)]
    assert events[1].data == {"attributes": {"error": "the model failed"}}
    assert lines.done


def test_a_stream_cut_for_a_revoked_token_raises_the_authentication_error() -> None:
    problem = {
        "type": "about:blank", "title": "Unauthorized", "status": 401, "error": "AuthenticationError",
        "retryable": False, "detail": "the API token no longer stands for tenant 'acme'",
    }  # fmt: skip
    lines = EventLines()
    assert read(lines, "id: 1\nevent: run_start\ndata: {}\n\n")[0].kind == "run_start"
    with pytest.raises(exc.AuthenticationError, match="no longer stands for tenant 'acme'") as raised:
        read(lines, f"event: error\ndata: {json.dumps(problem)}\n\n")
    assert raised.value.retryable is False and not lines.done


def test_an_error_event_without_a_status_is_still_an_error() -> None:
    with pytest.raises(exc.StockadeError, match="cut"):
        read(EventLines(), 'event: error\ndata: {"detail": "cut"}\n\n')
