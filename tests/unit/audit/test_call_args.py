"""What the trail and the run store keep of a tool call's arguments: bounded, and provable.

The arguments went into the audit event whole and into the run store five more times: five
calls of 4 MB made a 126 MB audit.db. A call over ``MAX_CALL_ARGS_BYTES`` is now refused before
it is validated (the model is told why) and its arguments are kept nowhere; a smaller one is
kept whole in the run store and cut past ``ARGS_CAP`` in the trail, with its size and digest.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import JsonValue

from stockade.agent import Agent, RunLimits
from stockade.agent.limits import MAX_CALL_ARGS_BYTES
from stockade.agent.state import args_measure
from stockade.audit import AuditLog, EventKind, verify
from stockade.audit.agent import ARGS_CAP, TEXT_CAP, AuditObserver
from stockade.audit.redact import Redactor
from stockade.audit.stores import open_store
from stockade.models.scripted import ScriptedModel, Turn
from stockade.runs import RunRecorder, open_run_store
from stockade.sandbox import Sandbox
from stockade.testing import FakeBackend, capture_audit, tool_call


def test_a_call_over_the_cap_is_refused_and_its_arguments_are_kept_nowhere(tmp_path: Path) -> None:
    huge: dict[str, JsonValue] = {"path": "big.txt", "content": "x" * (4 << 20)}
    size, digest = args_measure(huge)
    turns: list[Turn] = [
        *[tool_call("write_file", huge)] * 4,
        tool_call("no_such_tool", huge),  # an unknown tool is refused the same way
        "gave up",
    ]
    audit = AuditLog(open_store(f"sqlite:///{tmp_path / 'audit.db'}"), flush_interval_s=None)
    with (
        open_run_store(f"sqlite:///{tmp_path / 'runs.db'}") as store,
        Sandbox.create(backend=FakeBackend()) as sbx,
    ):
        agent = Agent(
            ScriptedModel(turns),
            checkpointer=store,
            observers=[RunRecorder(store), AuditObserver(audit)],
            limits=RunLimits(max_malformed=10, max_tokens=10**9),  # 4 MB are 1M tokens
        )
        result = agent.run_sync("write a big file", sandbox=sbx, run_id="r")
        assert not sbx.files.exists("big.txt")
    audit.close()  # the trail is written; the store is read again below
    told = result.steps[0].tool_calls[0].observation
    assert told == (
        f"error: malformed call to write_file: its arguments are {size:,} bytes ({digest}), over the "
        f"{MAX_CALL_ARGS_BYTES:,} one call may carry; nothing was run. Send less at once: a large "
        "file in parts, or code that makes it"
    )
    trail = open_store(f"sqlite:///{tmp_path / 'audit.db'}")
    calls = [e for e in trail.events(run_id="r") if e.kind == EventKind.TOOL_CALL]
    trail.close()
    assert len(calls) == 5 and all(
        f"{size:,} bytes ({digest})" in str(e.attributes["malformed"]) for e in calls
    )
    kept = sum(p.stat().st_size for p in tmp_path.iterdir())  # the databases and their WALs
    assert kept < 2 << 20, f"{kept:,} bytes kept for 5 refused calls"


def test_a_call_under_the_cap_is_cut_in_the_trail_with_its_size_and_digest() -> None:
    content = "line\n" * 20_000  # 100 KB: runs, and is kept whole by the run store
    written: dict[str, JsonValue] = {"path": "a.txt", "content": content}
    unknown: dict[str, JsonValue] = {"what": "y" * 100_000}
    invalid: dict[str, JsonValue] = {"path": "z" * 100_000, "offset": "not a number"}
    turns: list[Turn] = [
        tool_call("write_file", written),
        tool_call("no_such_tool", unknown),
        tool_call("read_file", invalid),
        "done",
    ]
    with capture_audit() as audit, Sandbox.create(backend=FakeBackend()) as sbx:
        agent = Agent(ScriptedModel(turns), observers=[AuditObserver(audit)])
        result = agent.run_sync("write a.txt", sandbox=sbx, run_id="r")
        assert sbx.files.read("a.txt") == content
    assert result.steps[0].tool_calls[0].call.args == written  # the run's own record is whole
    calls = audit.of(EventKind.TOOL_CALL)
    assert [c.attributes["tool"] for c in calls] == ["write_file", "no_such_tool", "read_file"]
    for event, args in zip(calls, (written, unknown, invalid), strict=True):
        attributes = event.attributes
        assert len(json.dumps(attributes)) < ARGS_CAP + 2048
        assert (attributes["args_bytes"], attributes["args_digest"]) == args_measure(args)
        assert attributes["args_cut"] is True and set(attributes["args"]) == set(args)  # type: ignore[arg-type]
    assert verify(audit.store).ok


def test_a_small_call_is_kept_whole_in_the_trail() -> None:
    args: dict[str, JsonValue] = {"path": "a.py", "content": "x = 1\n"}
    with capture_audit() as audit, Sandbox.create(backend=FakeBackend()) as sbx:
        Agent(
            ScriptedModel([tool_call("write_file", args), "done"]), observers=[AuditObserver(audit)]
        ).run_sync("write a.py", sandbox=sbx, run_id="r")
    (event,) = audit.of(EventKind.TOOL_CALL)
    assert event.attributes["args"] == args and "args_cut" not in event.attributes


KEY = "sk-" + "Q7w8E9r0T1y2U3i4O5p6A7s8D9f0G1h2J3k4L5z6"
REGISTERED = "plain-registered-secret-0042"


def test_a_credential_across_the_cut_is_redacted_before_the_cut_keeps_any_of_it() -> None:
    share = ARGS_CAP // 2  # two arguments: each keeps its first share of characters
    for secret in (KEY, REGISTERED):
        pad = "A" * (share - 3 - 15 - 1) + " "  # the cut falls 15 characters into the secret
        args: dict[str, JsonValue] = {"path": "k.txt", "content": pad + secret + "\n" + "B" * 3000}
        redactor = Redactor()
        redactor.add_secret(REGISTERED)
        with capture_audit(redactor=redactor) as audit, Sandbox.create(backend=FakeBackend()) as sbx:
            Agent(
                ScriptedModel([tool_call("write_file", args), "done"]), observers=[AuditObserver(audit)]
            ).run_sync("write k.txt", sandbox=sbx, run_id="r")
        (event,) = audit.of(EventKind.TOOL_CALL)
        kept = str(event.attributes["args"]["content"])  # type: ignore[call-overload,index]
        assert event.attributes["args_cut"] is True and "[REDACTED:" in kept
        assert secret[3:18] not in kept, kept[share - 40 : share + 40]
        assert (event.attributes["args_bytes"], event.attributes["args_digest"]) == args_measure(args)


def test_a_task_cut_in_the_trail_is_redacted_first() -> None:
    task = "x" * (TEXT_CAP - 10) + " " + KEY  # the cut falls inside the key
    with capture_audit() as audit, Sandbox.create(backend=FakeBackend()) as sbx:
        Agent(ScriptedModel(["done"]), observers=[AuditObserver(audit)]).run_sync(
            task, sandbox=sbx, run_id="r"
        )
    (start,) = audit.of(EventKind.RUN_START)
    assert KEY[3:9] not in str(start.attributes["task"])
