"""The run store as checkpointer and ledger: a run killed right after a tool call resumes without
repeating it; retries, approvals and the diff are recorded where ``stockade runs show`` finds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stockade import Sandbox
from stockade.agent import Agent, AgentEvent, MemoryCheckpointer, Observer, RunStatus, ToolReturned
from stockade.audit import Redactor
from stockade.exceptions import ApprovalRequired, ResourceContention
from stockade.models.scripted import Turn
from stockade.policy.approval import ApprovalRequest, Approvals, ApprovalStore, Choice
from stockade.runs import RunRecorder, RunStore, open_run_store
from stockade.runtime import Retrier, RetryingBackend, RetryPolicy
from stockade.sandbox.base import OpResult, SandboxSpec
from stockade.sandbox.ops import Op, ReadFile
from stockade.testing import FakeBackend, FakeInstance, MemoryWorkspace, ScriptedModel, tool_call
from stockade.tools import Tool, ToolContext, default_toolset, idempotency_key, tool


class Crash(Exception):
    """A bug (not a stop): it propagates out of the run, like the process dying there."""


def effect_tool(ran: list[str]) -> Tool:
    @tool
    def effect(ctx: ToolContext, name: str) -> str:
        """Do something visible outside the sandbox.

        Args:
            name: what to record.
        """
        ran.append(name)
        return f"did {name}"

    return effect


def crash_after(name: str) -> Observer:
    def observer(event: AgentEvent) -> None:
        if isinstance(event, ToolReturned) and event.record.call.args == {"name": name}:
            raise Crash  # after the call returned, before the loop's next checkpoint

    return observer


TURNS: list[Turn] = [[tool_call("effect", {"name": "a"}), tool_call("effect", {"name": "b"})], "done"]


async def test_a_call_that_returned_just_before_a_crash_is_not_run_again(store: RunStore) -> None:
    ran: list[str] = []
    tools = default_toolset().including(effect_tool(ran))
    sbx = Sandbox.create(backend=FakeBackend())
    crashing = Agent(
        ScriptedModel(TURNS),
        tools=tools,
        checkpointer=store,
        observers=[RunRecorder(store), crash_after("b")],
    )
    with pytest.raises(Crash):
        await crashing.run("effects", sandbox=sbx, run_id="r")
    assert ran == ["a", "b"]

    resumed = Agent(ScriptedModel(TURNS), tools=tools, checkpointer=store, observers=[RunRecorder(store)])
    result = await resumed.run(resume="r", sandbox=sbx)
    assert ran == ["a", "b"]  # "b" ran once: the ledger had it, the checkpoint did not
    assert result.status == RunStatus.SUCCESS
    assert [r.observation for r in result.steps[0].tool_calls] == ["did a", "did b"]
    assert [r.idempotency_key for r in store.tool_calls("r")] == [
        idempotency_key("r", 1, k, f"call_0_{k}") for k in (0, 1)
    ]


async def test_a_checkpoint_alone_would_have_run_it_twice() -> None:
    """Why the ledger exists: the loop checkpoints after the step, not after every return."""
    ran: list[str] = []
    tools = default_toolset().including(effect_tool(ran))
    sbx = Sandbox.create(backend=FakeBackend())
    saved = MemoryCheckpointer()
    with pytest.raises(Crash):
        await Agent(ScriptedModel(TURNS), tools=tools, checkpointer=saved, observers=[crash_after("b")]).run(
            "effects", sandbox=sbx, run_id="r"
        )
    await Agent(ScriptedModel(TURNS), tools=tools, checkpointer=saved).run(resume="r", sandbox=sbx)
    assert ran == ["a", "b", "b"]


def test_retries_are_filed_under_the_step_and_call_that_retried(store: RunStore) -> None:
    # the first read of a.txt is the run store's (the workspace after write_file, step 1);
    # the second is read_file's, in step 2
    failures = iter([None, ResourceContention("the host is busy")])
    workspace = MemoryWorkspace()

    def flaky_reads(op: Op[Any]) -> OpResult:
        if isinstance(op, ReadFile) and op.path == "a.txt":
            error = next(failures, None)
            if error is not None:
                raise error
        return workspace(op)

    recorder = RunRecorder(store)
    retrier = Retrier(policy=RetryPolicy(wait_initial=0.25, wait_jitter=0), observer=recorder.runtime)
    turns: list[Turn] = [
        tool_call("write_file", {"path": "a.txt", "content": "x\n"}),
        tool_call("read_file", {"path": "a.txt"}),
        "ok",
    ]
    with Sandbox.create(backend=RetryingBackend(FakeBackend(flaky_reads), retrier)) as sbx:
        result = Agent(ScriptedModel(turns), checkpointer=store, observers=[recorder]).run_sync(
            "read", sandbox=sbx, run_id="r"
        )
    assert result.ok
    (retry,) = store.retries("r")
    assert (retry.step, retry.call_id, retry.attempt, retry.delay_s) == (2, "call_1_0", 1, 0.25)
    assert retry.reason == "ResourceContention: the host is busy"
    trace = store.trace("r")
    assert trace is not None and trace.retries_of(2, "call_1_0") == (retry,)
    assert trace.diff == "--- /dev/null\n+++ b/a.txt\n@@ -0,0 +1 @@\n+x\n"


def test_a_retry_before_the_run_starts_is_kept_for_it(store: RunStore) -> None:
    starts = iter([ResourceContention("no cgroup slot")])

    class FlakyStart(FakeBackend):
        def start(self, spec: SandboxSpec) -> FakeInstance:
            error = next(starts, None)
            if error is not None:
                raise error
            return super().start(spec)

    recorder = RunRecorder(store)
    retrier = Retrier(policy=RetryPolicy(wait_initial=0.1, wait_jitter=0), observer=recorder.runtime)
    with Sandbox.create(backend=RetryingBackend(FlakyStart(), retrier)) as sbx:
        Agent(ScriptedModel(["done"]), checkpointer=store, observers=[recorder]).run_sync(
            "nothing", sandbox=sbx, run_id="r"
        )
    (retry,) = store.retries("r")
    assert (retry.step, retry.call_id, retry.subject) == (0, None, "fake:start")


def test_each_approval_outcome_is_recorded(store: RunStore, tmp_path: Path) -> None:
    recorder = RunRecorder(store)
    pending = recorder.approvals(Approvals(store=ApprovalStore(tmp_path)))
    approving = recorder.approvals(Approvals(lambda request: Choice.APPROVED))
    request = ApprovalRequest(run_id="r", action="run `git push`", rule="push", reason="it leaves the host")
    with pytest.raises(ApprovalRequired):
        pending.require(request)
    approving.require(request)
    assert [(a.request_id, a.decision) for a in store.approvals("r")] == [
        (request.id, "pending"),
        (request.id, "approved"),
    ]


def test_an_approval_asked_about_a_command_holding_a_token_is_recorded_redacted(
    store: RunStore, tmp_path: Path
) -> None:
    recorder = RunRecorder(store)
    token = "ghp_" + "a1" * 18
    request = ApprovalRequest(run_id="r", action=f"run `git push --token {token}`", rule="push", reason=token)
    book = ApprovalStore(tmp_path / "approvals")
    with pytest.raises(ApprovalRequired):
        recorder.approvals(Approvals(store=book)).require(request)
    (kept,) = store.approvals("r")
    assert token not in kept.action and "[REDACTED:github_token]" in kept.action
    assert kept.reason == "[REDACTED:github_token]"
    assert (
        kept.request_id == book.keyed(request).id != request.id
    )  # the book's id: it tells nothing of the token


def test_a_registered_secret_never_reaches_the_run_store(tmp_path: Path) -> None:
    secret = "hunter2-correct-horse"
    redactor = Redactor()
    redactor.add_secret(secret)
    turns: list[Turn] = [
        tool_call("write_file", {"path": "config.ini", "content": f"password = {secret}\n"}),
        tool_call("read_file", {"path": "config.ini"}),
        f"stored {secret}",
    ]
    with open_run_store(f"sqlite:///{tmp_path / 'runs.db'}", redactor=redactor) as store:
        recorder = RunRecorder(store)
        with Sandbox.create(backend=FakeBackend()) as sbx:
            agent = Agent(ScriptedModel(turns), checkpointer=store, observers=[recorder])
            assert agent.run_sync(f"use the password {secret}", sandbox=sbx, run_id="r").ok
        state = store.load("r")
        assert state is not None and state.answer == "stored [REDACTED:secret]"
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir())  # the database, its WAL
    assert secret.encode() not in stored
