"""``McpSession`` over the shipped fakes: an MCP session is an agent run whose model is the
client; calls, denials, approvals (a pause, a decision, the parked call run again), the end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from pathlib import Path

import pytest

from stockade.agent import RunLimits
from stockade.assembly import AgentConfig
from stockade.audit import AuditLog, MemoryStore
from stockade.audit.verify import verify
from stockade.exceptions import ApprovalRequired, SessionBusy
from stockade.policy import Policy
from stockade.policy.approval import ApprovalRequest, Choice
from stockade.policy.schema import CommandRules, ModelRegistry, PathRules, TrustRules
from stockade.sandbox.ops import RunCommand
from stockade.server.mcp_outcomes import CallResult, Ended, Outcome, Paused
from stockade.server.mcp_session import MAX_QUEUED_BYTES, MAX_QUEUED_CALLS, MODEL_NAME, McpAgent
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools.base import ToolContext, tool
from stockade.tools.builtin import default_toolset
from stockade.types import CommandResult, Trust

POLICY = Policy(
    trust=TrustRules(level=Trust.TRUSTED),
    paths=PathRules(deny=("secrets/**",)),
    commands=CommandRules(approve=("rm -r",)),
    models=ModelRegistry(approved=(MODEL_NAME,)),
)


@pytest.fixture
def agent(tmp_path: Path) -> McpAgent:
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    config = AgentConfig(
        model=MODEL_NAME,
        policy=POLICY,
        backend=FakeBackend(MemoryWorkspace(), tier="process"),
        audit=log,
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
        limits=RunLimits(max_denials=2),
    )
    return McpAgent(config)


def test_calls_run_as_steps_and_the_end_ends_the_run(agent: McpAgent) -> None:
    session = agent.session("one", client="test 1.0")
    assert agent.session("one", client="test 1.0") is session  # the same client, the same session

    async def work() -> list[object]:
        wrote = await session.call("write_file", {"path": "a.txt", "content": "hello"})
        read = await session.call("read_file", {"path": "a.txt"})
        denied = await session.call("write_file", {"path": "secrets/k", "content": "x"})
        missing = await session.call("no_such_tool", {})
        # resource reads: calls of their tools, whose result is the content itself
        listed = await session.call("list_files", {}, resource=True)
        diff = await session.call("git_diff", {}, resource=True)
        raw = await session.call("read_file", {"path": "a.txt"}, resource=True)
        return [wrote, read, denied, missing, listed, diff, raw]

    wrote, read, denied, missing, listed, diff, raw = asyncio.run(work())
    assert isinstance(wrote, CallResult) and not wrote.is_error
    assert isinstance(read, CallResult) and "hello" in read.text
    assert isinstance(denied, CallResult) and denied.is_error and "denied by policy" in denied.text
    assert isinstance(missing, CallResult) and missing.is_error and "no tool" in missing.text
    assert isinstance(listed, CallResult) and json.loads(listed.text) == ["a.txt"]
    assert isinstance(diff, CallResult) and "+hello" in diff.text
    assert isinstance(raw, CallResult) and raw.text == "hello"
    assert session.info()["status"] == "running"
    asyncio.run(session.aclose())
    assert session.result is not None and session.result.status.value == "success"
    assert not session.sandbox_alive
    after = asyncio.run(session.call("read_file", {"path": "a.txt"}))
    assert isinstance(after, Ended) and after.status == "success"
    agent.close()
    kinds = [e.kind.value for e in agent.agent.audit_log.store.events(run_id=session.run_id)]
    assert kinds[0] == "sandbox_start" and "policy_decision" in kinds and kinds[-1] == "sandbox_stop"


def test_an_approval_pauses_and_the_decision_runs_the_parked_call(agent: McpAgent) -> None:
    session = agent.session("one", client="test")
    command = {"code": "rm -r build", "language": "bash"}

    async def work() -> tuple[object, object, object]:
        paused = await session.call("run_code", command)
        assert isinstance(paused, Paused) and len(paused.approvals) == 1
        pending = paused.approvals[0]
        assert session.decision(pending) is None and "rm -r build" in pending.action
        session.decide(pending, Choice.APPROVED, by="test")
        resumed = await session.resume()
        again = await session.call("run_code", {"code": "rm -r other", "language": "bash"})
        assert isinstance(again, Paused)
        session.decide(again.approvals[0], Choice.DENIED, by="test")
        return paused, resumed, await session.resume()

    _, resumed, refused = asyncio.run(work())
    assert isinstance(resumed, CallResult) and not resumed.is_error, resumed
    assert isinstance(refused, CallResult) and refused.is_error and "a human denied" in refused.text
    agent.close()
    outcomes = [
        e.attributes["outcome"]
        for e in agent.agent.audit_log.store.events(run_id=session.run_id)
        if e.kind.value == "approval"
    ]
    assert outcomes == ["pending", "approved", "pending", "denied"]


def test_denials_in_a_row_end_the_session_as_a_run_would(agent: McpAgent) -> None:
    session = agent.session("one", client="test")

    async def work() -> list[object]:
        return [await session.call("write_file", {"path": f"secrets/{n}", "content": "x"}) for n in range(3)]

    first, second, third = asyncio.run(work())
    assert isinstance(first, CallResult) and first.is_error
    assert isinstance(second, CallResult) and "ended denied" in second.text  # its own denial, then the end
    assert isinstance(third, Ended) and third.status == "denied"
    agent.close()


@pytest.mark.parametrize("threshold", [2, None])
def test_failed_calls_in_a_row_end_the_session_broken_unless_the_breaker_is_off(
    tmp_path: Path, threshold: int | None
) -> None:
    config = AgentConfig(
        model=MODEL_NAME,
        policy=POLICY,
        backend=FakeBackend(MemoryWorkspace(), tier="process"),
        audit=AuditLog(MemoryStore(), flush_interval_s=None),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
        max_consecutive_failures=threshold,
    )
    agent = McpAgent(config)
    session = agent.session("one", client="test 1.0")

    async def work() -> list[object]:
        return [await session.call("read_file", {"path": f"missing-{i}"}) for i in range(4)]

    outcomes = asyncio.run(work())
    try:
        if threshold is None:
            assert all(isinstance(o, CallResult) and o.is_error for o in outcomes)
            assert session.info()["status"] == "running"
        else:
            last = outcomes[1]
            assert isinstance(last, CallResult) and "ended broken" in last.text, last
            assert all(isinstance(o, Ended) and o.status == "broken" for o in outcomes[2:])
            assert not session.sandbox_alive
    finally:
        agent.close()


def test_a_session_ended_mid_call_cuts_the_call_and_the_stop_keeps_its_records(tmp_path: Path) -> None:
    """An HTTP client's DELETE freed the session's slot at once, while its thread kept the
    sandbox until the call in flight returned (up to a week): 4 sandboxes ran under
    ``--max-sessions 1``. And the server's stop closed the audit log before that thread wrote
    its last records. Now the call is cut with the session, and the stop waits for it."""
    started = threading.Event()

    def until_closed(op: RunCommand) -> CommandResult:
        started.set()
        instance = backend.instances[-1]
        deadline = time.monotonic() + 30
        while instance.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0.0)

    backend = FakeBackend(MemoryWorkspace(commands=until_closed), tier="process")
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    agent = McpAgent(
        AgentConfig(
            model=MODEL_NAME, policy=POLICY, backend=backend, audit=log,
            approval_dir=tmp_path / "approvals", kill_target=str(tmp_path / "kill"),
        )
    )  # fmt: skip
    session = agent.session("one", client="test")

    async def work() -> object:
        call = asyncio.ensure_future(session.call("run_code", {"code": "sleep 600", "language": "bash"}))
        assert await asyncio.to_thread(started.wait, 10)
        forgotten = agent.forget("one")
        assert forgotten is session
        forgotten.end()  # what the server's DELETE does
        return await asyncio.wait_for(call, 10)

    outcome = asyncio.run(work())
    assert isinstance(outcome, Ended) and outcome.status == "interrupted", outcome
    agent.close()  # at once: it waits for the forgotten session's thread
    assert not session.running and not backend.instances[-1].alive
    kinds = [e.kind.value for e in log.store.events(run_id=session.run_id)]
    assert "sandbox_stop" in kinds and kinds[-1] == "run_end", kinds


def slow_agent(tmp_path: Path, release: threading.Event) -> McpAgent:
    """An agent whose commands return once ``release`` is set."""

    def slow(op: RunCommand) -> CommandResult:
        release.wait(30)
        return CommandResult(exit_code=0, stdout="done", stderr="", duration_s=0.0)

    backend = FakeBackend(MemoryWorkspace(commands=slow), tier="process")
    return McpAgent(
        AgentConfig(
            model=MODEL_NAME, policy=POLICY, backend=backend,
            audit=AuditLog(MemoryStore(), flush_interval_s=None),
            approval_dir=tmp_path / "approvals", kill_target=str(tmp_path / "kill"),
        )
    )  # fmt: skip


def test_calls_queued_behind_a_running_one_are_bounded(tmp_path: Path) -> None:
    """Found from outside: one session queued calls without limit behind a slow run_code, each
    holding its arguments: 300 write_files of ~4 MB held 2.4 GB. Now at most
    ``MAX_QUEUED_CALLS`` wait; the next is refused as busy (retryable), and a queued call its
    client gave up frees its place."""
    release = threading.Event()
    agent = slow_agent(tmp_path, release)
    session = agent.session("one", client="test")

    async def work() -> list[object]:
        running = asyncio.ensure_future(session.call("run_code", {"code": "sleep 120", "language": "bash"}))
        while session._current is None:  # the slow call is taken: the others queue behind it
            await asyncio.sleep(0.01)
        queued = [
            asyncio.ensure_future(session.call("write_file", {"path": f"f{i}", "content": "x" * 1000}))
            for i in range(MAX_QUEUED_CALLS)
        ]
        await asyncio.sleep(0)  # each is in the inbox
        with pytest.raises(SessionBusy, match="busy") as refused:
            await session.call("write_file", {"path": "one-too-many", "content": "x"})
        assert refused.value.retryable
        queued[0].cancel()  # given up while queued: its place is free
        await asyncio.sleep(0)
        queued.append(asyncio.ensure_future(session.call("write_file", {"path": "after", "content": "y"})))
        await asyncio.sleep(0)
        release.set()
        return await asyncio.gather(running, *queued[1:])

    outcomes = asyncio.run(work())
    agent.close()
    assert all(isinstance(o, CallResult) and not o.is_error for o in outcomes), outcomes
    assert agent._queued_bytes == 0  # every queued call's bytes were given back


def test_the_bytes_of_queued_arguments_are_bounded_per_server(tmp_path: Path) -> None:
    """The per-session count alone lets sessions together hold ``MAX_QUEUED_CALLS`` calls of a
    message's size each: the server also bounds the bytes of queued arguments."""
    release = threading.Event()
    agent = slow_agent(tmp_path, release)
    session = agent.session("one", client="test")
    big = "x" * (MAX_QUEUED_BYTES // 3)

    async def work() -> None:
        running = asyncio.ensure_future(session.call("run_code", {"code": "sleep 120", "language": "bash"}))
        while session._current is None:
            await asyncio.sleep(0.01)
        queued = [
            asyncio.ensure_future(session.call("write_file", {"path": f"f{i}", "content": big}))
            for i in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(SessionBusy, match="bytes"):
            await session.call("write_file", {"path": "f3", "content": big + big})
        release.set()
        await asyncio.gather(running, *queued)

    asyncio.run(work())
    agent.close()


def _refusing_execs_in(holder: list[McpAgent], count: int) -> MemoryWorkspace:
    """A workspace whose ``loop`` program does as code looping over ``rm -r dN`` does inside a
    real sandbox: each exec is asked about, refused on the spot, and left pending."""

    def run(op: RunCommand) -> CommandResult:
        if b"loop" in (op.stdin or b""):
            [agent] = holder
            [session] = agent._sessions.values()
            for n in range(count):
                exec_ = ApprovalRequest(
                    run_id=session.run_id, action=f"exec `rm -r d{n}`", rule="rm -r",
                    reason="code in the sandbox starts rm, which needs a human's approval",
                )  # fmt: skip
                with contextlib.suppress(ApprovalRequired):
                    agent.agent.approvals.require(exec_)
        return CommandResult(exit_code=0, stdout="looped", stderr="", duration_s=0.0)

    return MemoryWorkspace(commands=run)


def test_a_pause_holds_only_the_requests_its_call_waits_on(tmp_path: Path) -> None:
    """Found from outside: code that looped over 20 `rm -r dN` left 20 execs pending (each
    refused on the spot); the next call the policy paused held all 21, and the client was asked
    21 questions for it. Its pause holds its own request; the execs stay pending, unasked."""
    holder: list[McpAgent] = []
    config = AgentConfig(
        model=MODEL_NAME, policy=POLICY, audit=AuditLog(MemoryStore(), flush_interval_s=None),
        backend=FakeBackend(_refusing_execs_in(holder, 20), tier="process"),
        approval_dir=tmp_path / "approvals", kill_target=str(tmp_path / "kill"),
    )  # fmt: skip
    agent = McpAgent(config)
    holder.append(agent)
    session = agent.session("one", client="test")

    async def work() -> Paused:
        looped = await session.call("run_code", {"code": "loop", "language": "bash"})
        assert isinstance(looped, CallResult) and "looped" in looped.text, looped
        paused = await session.call("run_code", {"code": "rm -r x", "language": "bash"})
        assert isinstance(paused, Paused)
        session.decide(paused.approvals[0], Choice.DENIED, by="test")
        await session.resume()
        return paused

    paused = asyncio.run(work())
    try:
        assert [p.action for p in paused.approvals] == ["run `bash -c 'rm -r x'`"], paused.approvals
        store = agent.agent.approvals.store
        assert store is not None and len(store.pending(session.run_id)) == 20
    finally:
        agent.close()


def test_the_wall_time_left_shrinks_while_a_pause_waits(agent: McpAgent) -> None:
    """Found from outside: measured at the pause, the wall time left stayed whole however long
    the pause waited, and one call waited past ``--max-session-s`` (48 s under 20)."""
    session = agent.session("one", client="test")

    async def work() -> tuple[float, float]:
        paused = await session.call("run_code", {"code": "rm -r build", "language": "bash"})
        assert isinstance(paused, Paused)
        at_pause = session.wall_left()
        await asyncio.sleep(0.05)
        later = session.wall_left()
        session.decide(paused.approvals[0], Choice.DENIED, by="test")
        await session.resume()
        return at_pause, later

    at_pause, later = asyncio.run(work())
    agent.close()
    assert later < at_pause


def test_a_session_spends_no_tokens_and_a_huge_call_is_refused_by_its_size(tmp_path: Path) -> None:
    """Found from outside: the client's calls were counted as a model's answers without usage,
    estimated from the whole history each step, so a session reading 40 KB files ended
    "budget" (1 M tokens) at its 23rd read, and one 3.9 MB write_file ended it instead of being
    refused. The client's model is not ours to count: a call is one request and no tokens, so
    even a token budget of 1,000 never ends a session, and the huge call meets its size cap."""
    agent = McpAgent(
        AgentConfig(
            model=MODEL_NAME, policy=POLICY, backend=FakeBackend(MemoryWorkspace(), tier="process"),
            audit=AuditLog(MemoryStore(), flush_interval_s=None), approval_dir=tmp_path / "approvals",
            kill_target=str(tmp_path / "kill"), limits=RunLimits(max_tokens=1_000),
        )
    )  # fmt: skip
    session = agent.session("one", client="test")

    async def work() -> list[object]:
        outcomes: list[object] = [
            await session.call("write_file", {"path": "big.txt", "content": "x\n" * 20_000})
        ]
        outcomes += [await session.call("read_file", {"path": "big.txt"}) for _ in range(5)]
        outcomes.append(await session.call("write_file", {"path": "huge.txt", "content": "y" * 3_900_000}))
        outcomes.append(await session.call("read_file", {"path": "big.txt", "limit": 2}))
        return outcomes

    *calls, huge, after = asyncio.run(work())
    try:
        assert all(isinstance(o, CallResult) and not o.is_error for o in calls), calls
        assert isinstance(huge, CallResult) and huge.is_error, huge
        assert "over the 262,144 one call may carry" in huge.text, huge.text
        assert isinstance(after, CallResult) and not after.is_error, after
        assert session.info()["status"] == "running"
    finally:
        agent.close()
    assert session.result is not None and session.result.state.usage.total_tokens == 0


@tool
def flaky(ctx: ToolContext, fail: bool) -> str:
    """A tool whose own failure is asked for.

    Args:
        fail: whether it fails.
    """
    if fail:
        raise RuntimeError("the tool's service is down")
    return "ok"


def test_a_sessions_errors_open_no_breaker_of_another_session(tmp_path: Path) -> None:
    """Found from outside: the tools' breakers were the server's, and a missing file counted
    as read_file failing. One session reading five missing files opened ``tool:read_file`` for
    every session (``CircuitOpen``, retry in 30 s), and five such refusals ended another's
    run "broken". Now a caller's error opens no breaker, and a session's tool failing opens
    that tool's breaker for that session alone."""
    agent = McpAgent(
        AgentConfig(
            model=MODEL_NAME, policy=POLICY, backend=FakeBackend(MemoryWorkspace(), tier="process"),
            audit=AuditLog(MemoryStore(), flush_interval_s=None), approval_dir=tmp_path / "approvals",
            kill_target=str(tmp_path / "kill"), max_consecutive_failures=None,
            tools=default_toolset().including(flaky),
        )
    )  # fmt: skip
    prober, victim = agent.session("prober", client="test"), agent.session("victim", client="test")

    async def work() -> tuple[list[Outcome], list[Outcome], list[Outcome], list[Outcome]]:
        await victim.call("write_file", {"path": "notes.txt", "content": "mine"})
        missing = [await prober.call("read_file", {"path": f"missing-{n}.txt"}) for n in range(7)]
        failing = [await prober.call("flaky", {"fail": True}) for _ in range(6)]
        read = [await victim.call("read_file", {"path": "notes.txt"}) for _ in range(6)]
        return missing, failing, read, [await victim.call("flaky", {"fail": False})]

    missing, failing, read, [served] = asyncio.run(work())
    try:
        assert all(isinstance(o, CallResult) and "CircuitOpen" not in o.text for o in missing), missing
        assert all(isinstance(o, CallResult) and "no such file" in o.text for o in missing), missing
        # five failures of the tool itself open its breaker, for the session they happened in
        assert isinstance(failing[-1], CallResult) and "CircuitOpen" in failing[-1].text, failing[-1]
        assert all(isinstance(o, CallResult) and "mine" in o.text for o in read), read
        assert isinstance(served, CallResult) and not served.is_error and "ok" in served.text, served
        assert victim.info()["status"] == "running"
    finally:
        agent.close()


def test_every_decision_made_through_mcp_reaches_the_trail(agent: McpAgent) -> None:
    """Found from outside: 21 elicitations answered, 21 decisions in the approval book, 1 in
    the audit trail: a decision was recorded only when the run asked for its request again,
    and a run that never did (it ended first, or the request was one it had stopped waiting
    for) left it out. Each decision is recorded as it is made, once, and the chain verifies."""
    session = agent.session("one", client="test")

    async def work() -> list[object]:
        outcomes: list[object] = []
        for n, choice in enumerate((Choice.APPROVED, Choice.DENIED)):
            paused = await session.call("run_code", {"code": f"rm -r build{n}", "language": "bash"})
            assert isinstance(paused, Paused)
            session.decide(paused.approvals[0], choice, by="test")
            outcomes.append(await session.resume())  # the run asks again: recorded no second time
        last = await session.call("run_code", {"code": "rm -r left", "language": "bash"})
        assert isinstance(last, Paused)
        session.decide(last.approvals[0], Choice.APPROVED, by="test")
        await session.aclose()  # the client left before the run asked again
        return outcomes

    approved, denied = asyncio.run(work())
    agent.close()
    assert isinstance(approved, CallResult) and not approved.is_error, approved
    assert isinstance(denied, CallResult) and denied.is_error, denied
    store = agent.agent.audit_log.store
    approvals = [e for e in store.events(run_id=session.run_id) if e.kind.value == "approval"]
    decided = [(e.attributes["outcome"], e.actor) for e in approvals if e.attributes["outcome"] != "pending"]
    assert decided == [("approved", "human:test"), ("denied", "human:test"), ("approved", "human:test")]
    assert len([e for e in approvals if e.attributes["outcome"] == "pending"]) == 3
    report = verify(store, run_id=session.run_id)
    assert report.ok and report.found, report.problems
