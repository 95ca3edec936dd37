"""An MCP client session as an agent run: the client is the model, its tool calls are the steps.

``stockade mcp`` does not call tools itself. Each MCP session is one ``AgentSession`` of a
``GuardedAgent`` (``build_agent``), driven by a ``Model`` whose "responses" are the tool calls
the MCP client sends. So a call goes through exactly what a step of an agent run goes
through: the policy's guards (deny, or ask a human), the runtime controls (kill switch,
rate limit, breakers, anomalies), the sandbox's own enforcement, the audit trail and the
run store; the session shows in ``stockade runs``, the run viewer and ``stockade audit``
like any run.

    owner = McpAgent(AgentConfig(model=..., policy="policy.toml", audit="sqlite:///..."))
    session = owner.open_session(client="claude-desktop 1.0", workspace="project/")
    outcome = await session.call("write_file", {"path": "a.py", "content": "..."})
    ...
    await session.aclose()        # the run ends "success", the sandbox is removed

A session runs its loop in a thread of its own (the loop's ``run_sync``/``resume_sync``, a
sandbox that starts and stops on that thread): the MCP server's event loop only passes calls
in and outcomes out. An action the policy sends for approval pauses the run, as it pauses
any run: the outcome is ``Paused`` with the pending requests; whoever decides (the MCP
client through elicitation, ``stockade approve``, the run viewer) writes the decision to the
approval book and the session resumes, which runs the parked call again under the decision.

What a call comes to (``CallResult``, ``Paused``, ``Ended``) are values of their own
(``mcp_outcomes``), and so are the session's tools as it wraps them, cut when their client
cancels and serving resources (``mcp_tools``); here are the agent, its sessions and the
model that is their clients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from pydantic import JsonValue

from stockade import exceptions as exc
from stockade.agent.nodes import RunResult
from stockade.agent.state import RunStatus
from stockade.assembly import AgentConfig, AgentSession, GuardedAgent, build_agent
from stockade.models.base import Model
from stockade.models.messages import ModelRequest, ModelResponse, ToolCall, ToolResultMessage, Usage
from stockade.policy.approval import unanswered
from stockade.policy.approval_book import Choice
from stockade.policy.schema import Verdict
from stockade.server.mcp_outcomes import CallResult, ClientCall, Ended, Outcome, Paused, PendingApproval
from stockade.server.mcp_tools import cancellable, running, serving_resources
from stockade.tools.builtin import default_toolset

__all__ = [
    "CANCELLED",
    "MODEL_NAME",
    "CallResult",
    "ClientModel",
    "Ended",
    "McpAgent",
    "McpSession",
    "Outcome",
    "Paused",
    "PendingApproval",
]

log = logging.getLogger("stockade.mcp")

_END = object()  # put in a session's inbox: the client went away

# Calls of a session run one at a time; those behind the running one wait in its inbox, each
# holding its arguments. Unbounded, a client that sent write_files of ~4 MB behind a slow
# run_code held 2.4 GB after 300 of them (~7.7 MB a call). Past either cap a call is refused
# (``SessionBusy``), not held.
MAX_QUEUED_CALLS = 8  # per session
MAX_QUEUED_BYTES = 64 << 20  # of queued arguments, every session of the server together

MODEL_NAME = "mcp"  # what the policy's [models] approved list must allow
# who denied what a cancelled call waited for: nobody was left to ask
CANCELLED = unanswered("the MCP client cancelled the call", timeout=False)
# What a client's call counts as: one request and no tokens. The client's model is not ours to
# count, and a response without usage is estimated from the whole history each step: a session
# reading 40 KB files ended "budget" (1 M tokens) after 23 reads, and one 3.9 MB write_file
# ended it before the call's own size cap could refuse it.
_NO_TOKENS = Usage(requests=1)


class ClientModel(Model):
    """The MCP clients, seen by the loop as its model (one for the agent, as its wrappers are:
    each session's loop reaches its own client). A request reports the observation of the
    call in flight to its caller, then waits for the client's next tool call: one per step."""

    name = MODEL_NAME

    async def request(self, request: ModelRequest) -> ModelResponse:
        session = running.get()
        if session is None:
            raise exc.ConfigurationError("the MCP client model runs only inside an MCP session")
        session._deliver(request.messages)
        name = MODEL_NAME  # what the policy's registry judges; the client is in the run's task
        while True:
            item = await session._next()
            if item is _END or not isinstance(item, ClientCall):
                return ModelResponse(
                    text="the MCP client ended its session", finish_reason="stop", model_name=name,
                    usage=_NO_TOKENS,
                )  # fmt: skip
            with session._lock:  # taken, or cancelled while queued: never both
                session._unqueue(item)
                if item.cancelled:
                    continue  # a queued call its client gave up never runs
                session._current = item
            return ModelResponse(
                tool_calls=(item.call,), finish_reason="tool_calls", model_name=name, usage=_NO_TOKENS
            )


class McpAgent:
    """One ``GuardedAgent`` for the MCP server (its rate and spend windows, model and backend
    breakers and audit trail are shared by every session; its tools' breakers are each
    session's own, as each run's are), and the sessions it holds."""

    def __init__(self, config: AgentConfig, *, workspace: str | Path | None = None) -> None:
        """``config.model`` is replaced: the model of an MCP session is its client."""
        tools = config.tools if config.tools is not None else default_toolset()
        # a resource read is the call of its tool: judged, limited and recorded as that call is
        config = dataclasses.replace(
            config, model=ClientModel(), tools=serving_resources(tools).wrapped(cancellable)
        )
        self.config = config
        self.workspace = workspace
        self._sessions: dict[str, McpSession] = {}
        self._leaving: list[McpSession] = []  # forgotten, their threads maybe not ended yet
        self._lock = threading.Lock()
        self._queued_bytes = 0  # of the arguments of calls queued in every session
        self.agent: GuardedAgent = build_agent(config)

    @property
    def tools(self) -> list[tuple[str, str, dict[str, JsonValue]]]:
        """(name, description, JSON schema of the arguments) of each tool the sessions offer:
        those the policy (the role's tools) does not deny outright."""
        return [
            (d.name, d.description, d.parameters)
            for d in self.agent.tools.definitions()
            if self.allows(d.name)
        ]

    def allows(self, tool: str) -> bool:
        """Whether a call of ``tool`` may be made at all (it may still be denied, or asked)."""
        return self.agent.engine.tool(tool).verdict is not Verdict.DENY

    def session(self, key: str, *, client: str) -> McpSession:
        """The session of ``key`` (an MCP session id, or the one stdio client), started on first use."""
        with self._lock:
            found = self._sessions.get(key)
            if found is None:  # one that ended stays, to say so, until the client leaves
                found = McpSession(self, client=client, key=key)
                self._sessions[key] = found
            return found

    def _reserve(self, size: int) -> None:
        with self._lock:
            if self._queued_bytes + size > MAX_QUEUED_BYTES:
                raise exc.SessionBusy(
                    f"this MCP server holds {self._queued_bytes:,} bytes of queued calls' arguments "
                    f"(at most {MAX_QUEUED_BYTES:,}): retry once the calls in flight have returned"
                )
            self._queued_bytes += size

    def _release(self, size: int) -> None:
        with self._lock:
            self._queued_bytes -= size

    def find(self, key: str) -> McpSession | None:
        with self._lock:
            return self._sessions.get(key)

    def forget(self, key: str) -> McpSession | None:
        """The session of ``key``, no longer found by it; ``close`` still waits for its thread
        (its last records go to the audit log, which closes after it)."""
        with self._lock:
            session = self._sessions.pop(key, None)
            if session is not None:
                self._leaving = [s for s in self._leaving if s.running] + [session]
            return session

    def live(self) -> int:
        """The sessions whose runs (and sandboxes) are still up, forgotten ones included."""
        with self._lock:
            return sum(s.running for s in [*self._sessions.values(), *self._leaving])

    def close(self, timeout_s: float = 60.0) -> None:
        """End every session (their runs end, their sandboxes are removed), then the agent."""
        with self._lock:
            sessions, self._sessions = [*self._sessions.values(), *self._leaving], {}
            self._leaving = []
        for session in sessions:
            session.end()
        for session in sessions:
            session.join(timeout_s)
        self.agent.close()


class McpSession:
    """One MCP client session: a run of its own, in a thread of its own, with one sandbox."""

    def __init__(self, owner: McpAgent, *, client: str, key: str) -> None:
        self.owner = owner
        self.key = key
        self.client = client
        self.run_id = f"mcp-{uuid.uuid4().hex[:20]}"
        self._inbox: queue.Queue[object] = queue.Queue()
        self._control: queue.Queue[concurrent.futures.Future[Outcome] | None] = queue.Queue()
        self._current: ClientCall | None = None
        self._queued = 0  # calls in the inbox, not taken nor cancelled
        self._lock = threading.Lock()  # between the loop taking a call and its client cancelling it
        self._ids = itertools.count(1)
        self._started = threading.Event()
        self._agent_session: AgentSession | None = None
        self._failure: BaseException | None = None
        self.result: RunResult | None = None
        self.closed = False
        self.paused: Paused | None = None  # asked of a 2026-07-28 client, until its retry answers
        # The requests pending once the last call returned: an exec refused on the spot inside a
        # call stays pending (a yes lets it run next time), and no later call waits on it.
        self._settled: frozenset[str] = frozenset()
        # The run's wall time leaves out its pauses: the seconds it waited in them, and since
        # when it waits now, count against the session's wall time all the same (``wall_left``).
        self._waited_s = 0.0
        self._paused_at: float | None = None
        self._thread = threading.Thread(target=self._main, name=f"stockade-mcp-{self.run_id}", daemon=True)
        self._thread.start()

    # -- the MCP side (any thread, or the server's event loop) ------------------------------------

    async def call(
        self, name: str, args: Mapping[str, JsonValue], *, resource: bool = False,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> Outcome:  # fmt: skip
        """Run one tool call as the session's next step (calls of a session run one at a time).
        With ``resource``, the call of ``name`` (read_file, list_files, git_diff) stands for a
        resource read: judged, limited and recorded as that call, its result is the content
        (the file's text, the workspace's paths as a JSON list, the session's diff). ``gone``
        returns once nobody can hear the outcome (its HTTP request went away): a call still
        queued then is dropped (``CallCancelled``); one running goes on."""
        if self.closed:
            return self._ended()
        call = ToolCall(id=f"mcp_{next(self._ids)}", name=name, args=dict(args))
        item = ClientCall(call=call, resource=resource, size=_size(args))
        with self._lock:
            if self._queued >= MAX_QUEUED_CALLS:
                raise exc.SessionBusy(
                    f"this MCP session is busy: {self._queued} calls wait behind its running one "
                    f"(at most {MAX_QUEUED_CALLS}); retry once they have returned"
                )
            self.owner._reserve(item.size)
            self._queued += 1
        # Queued as it came, not once the sandbox is up: calls waiting for the session's start
        # were queued in any order, and a call its client cancelled ran ahead of the one before it.
        self._inbox.put(item)
        if self.closed:  # ended meanwhile, its inbox maybe drained already: this call is told
            self._drain()
        try:
            waiting = asyncio.wrap_future(item.future)
            if gone is not None:
                await self._unless_gone(item, waiting, gone)
            return await waiting
        except asyncio.CancelledError:
            self._cancel(item)
            raise

    async def _unless_gone(
        self, item: ClientCall, waiting: asyncio.Future[Outcome], gone: Callable[[], Awaitable[object]]
    ) -> None:
        """Until ``item`` is answered, or ``gone`` returns while it still waits in the inbox:
        then it is dropped (its arguments with it: a client that sent calls of ~4 MB each
        and closed their connections had them all held behind a slow one)."""
        watch = asyncio.ensure_future(gone())
        try:
            await asyncio.wait((waiting, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if waiting.done():
            return
        with self._lock:
            dropped = item.queued and not item.cancelled
        if dropped:
            self._cancel(item)
            waiting.cancel()
            raise exc.CallCancelled(
                f"its request went away while call {item.call.id} was queued; it never ran"
            )

    def _cancel(self, item: ClientCall) -> None:
        """The client gave ``item`` up: queued, it is dropped; running, what it runs in the
        sandbox is cut (a thread of its own: the cut waits for the sandbox's answer)."""
        with self._lock:
            item.cancelled = True
            running = item is self._current
            if item.queued:  # it stays in the inbox until the loop skips it: its arguments go now
                self._unqueue(item)
                item.call = ToolCall(id=item.call.id, name=item.call.name, args={})
        session = self._agent_session
        if running and session is not None and not self.closed:
            instance = session.sandbox.instance
            threading.Thread(target=instance.cut_running, name=f"stockade-mcp-cut-{self.run_id}").start()

    async def resume(self) -> Outcome:
        """Continue after the pending approvals were decided: the parked call runs again. Its
        caller cancelled meanwhile, it is cut as a running call is (``_cancel``): the resumed
        call went on to its end, recorded as a success, and the session's next call waited
        for it (a `sleep 6` after an approved `rm -r`, cancelled 1 s in, held the next 5 s)."""
        future: concurrent.futures.Future[Outcome] = concurrent.futures.Future()
        self._control.put(future)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            current = self._current
            if current is not None:
                self._cancel(current)
            raise

    def decide(self, pending: PendingApproval, choice: Choice, *, by: str) -> None:
        """Record a decision in the approval book the run reads (as ``stockade approve`` does),
        and in the audit trail now, whether or not the run asks for it again."""
        self.owner.agent.approvals.decide(pending.request(), choice, by=by)

    def wall_left(self) -> float:
        """The seconds left of the session's wall time (``--max-session-s``) now: what its run
        counted as of its last pause, plus every second spent waiting in a pause, this one's
        so far included. What an approval is waited for at most: counted at the pause alone, a
        call waited the whole of it again for each of its questions, and past it."""
        session = self._agent_session
        last = session.last if session is not None else None
        spent = (last.state.elapsed_s if last is not None else 0.0) + self._waited_s
        paused_at = self._paused_at
        if paused_at is not None:
            spent += time.monotonic() - paused_at
        return max(0.0, self.owner.agent.config.limits.max_wall_s - spent)

    def decision(self, pending: PendingApproval) -> Choice | None:
        store = self.owner.agent.approvals.store
        return store.decision(pending.request()) if store is not None else None

    def give_up(self, paused: Paused, *, by: str) -> None:
        """Nobody waits for the paused call any more (its caller was cancelled): what is still
        undecided is denied, and the run goes on, so that the session's next call is served."""
        for pending in paused.approvals:
            with contextlib.suppress(exc.ApprovalDecided):  # decided meanwhile: that stands
                self.decide(pending, Choice.DENIED, by=by)
        self._control.put(concurrent.futures.Future())  # its outcome is nobody's

    def end(self) -> None:
        """The client went away: the run ends (its sandbox is removed) on the session's thread.
        A call in flight is cut (its sandbox killed, the run "interrupted"): nobody waits for
        it, and it held the sandbox past the session's end, up to its ``timeout_s`` (a week),
        while the session's slot was free for another: an HTTP client ran 4 sandboxes under
        ``max_sessions=1``."""
        session = self._agent_session
        if session is not None and self._current is not None and not self.closed:
            session.interrupt("the MCP client ended its session")
        self._inbox.put(_END)
        self._control.put(None)

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        """Whether the session's thread still runs (its run, its sandbox)."""
        return self._thread.is_alive()

    async def aclose(self) -> None:
        self.end()
        await asyncio.to_thread(self.join, 60.0)

    @property
    def sandbox_alive(self) -> bool:
        session = self._agent_session
        return session is not None and not self.closed and session.sandbox.alive

    def info(self) -> dict[str, object]:
        agent = self.owner.agent
        return {
            "run_id": self.run_id,
            "client": self.client,
            "tier": agent.tier,
            "tier_reason": agent.tier_reason,
            "status": self._ended().status if self.closed else "running",
            "kill": f"stockade kill {self.run_id}",
        }

    # -- the session's thread ---------------------------------------------------------------------

    async def _next(self) -> object:
        """The client's next call; a kill pulled meanwhile stops the run now (it would otherwise
        wait for the call: an idle client is the usual state of an MCP session)."""
        while True:
            try:
                return await asyncio.to_thread(self._inbox.get, True, 0.25)
            except queue.Empty:
                if self._agent_session is not None:
                    self._agent_session.kill_switch.check()

    def _open(self) -> AgentSession:
        self._started.wait()
        if self._agent_session is None or self.closed:
            raise exc.SandboxClosed(f"MCP session {self.run_id} has ended")
        return self._agent_session

    def _main(self) -> None:
        owner = self.owner
        try:
            with owner.agent.session(workspace=owner.workspace, run_id=self.run_id) as session:
                self._agent_session = session
                self._started.set()
                running.set(self)
                result = session.run_sync(f"MCP session of {self.client}")
                while result.status is RunStatus.PAUSED:
                    paused = self._paused(session)
                    self._paused_at = time.monotonic()  # before its caller hears of the pause
                    if not self._answer(paused):  # its caller was cancelled: nobody will decide
                        self.give_up(
                            paused, by=unanswered("the MCP client cancelled the call", timeout=False)
                        )
                    future = self._control.get()
                    self._waited_s += time.monotonic() - self._paused_at
                    self._paused_at = None
                    if future is None:  # the client left while an action waited: it stays undecided
                        break
                    self._resuming = future
                    result = session.resume_sync()
                self.result = result
        except BaseException as error:  # reported to the calls in flight, and logged
            self._failure = error
            log.exception("MCP session %s failed", self.run_id)
        finally:
            self.closed = True
            self._started.set()
            self._answer(self._last_word())
            self._drain()

    _resuming: concurrent.futures.Future[Outcome] | None = None

    def _paused(self, session: AgentSession) -> Paused:
        """The pause of the call in flight: the requests it waits on, those that came pending
        since the last call returned. The rest are execs refused on the spot by earlier calls,
        which nothing waits on: asked too, one call asked (and waited for) 21 questions, 20 of
        them about execs of the call before. (Should none be new, all are asked, as before.)"""
        store = session.approvals.store
        pending = store.pending(self.run_id) if store is not None else []
        fresh = [r for r in pending if r["id"] not in self._settled] or pending
        current = self._current
        return Paused(
            call=current.call if current is not None else None,
            approvals=tuple(
                PendingApproval(
                    run_id=self.run_id,
                    request_id=r["id"],
                    action=r["action"],
                    rule=r["rule"],
                    reason=r["reason"],
                )
                for r in fresh
            ),
        )

    def _settle(self) -> None:
        """Note what is pending as a call returns (see ``_paused``)."""
        session = self._agent_session
        store = session.approvals.store if session is not None else None
        if store is not None:
            self._settled = frozenset(r["id"] for r in store.pending(self.run_id))

    def _deliver(self, messages: tuple[object, ...]) -> None:
        """The loop asks its model again: the call in flight returned; tell its caller."""
        current = self._current
        if current is None:
            return
        for message in reversed(messages):
            if isinstance(message, ToolResultMessage) and message.call_id == current.call.id:
                served = current.content if current.resource and not message.is_error else None
                text = message.content if served is None else served
                self._settle()
                self._answer(CallResult(text=text, is_error=message.is_error))
                return

    def _answer(self, outcome: Outcome) -> bool:
        """Resolve whoever waits for the call in flight (its caller, or a resume's); whether
        anyone still did (a cancelled caller's future is done)."""
        waiting = (self._resuming, self._current.future if self._current is not None else None)
        # no call in flight before its caller hears: one that ends the session at once must
        # not find it still there (``end`` would cut a run that had nothing left to cut)
        self._resuming = None
        if not isinstance(outcome, Paused):
            self._current = None
        heard = False
        for future in waiting:
            if future is not None and not future.done():
                future.set_result(outcome)
                heard = True
        return heard

    def _last_word(self) -> Outcome:
        """For the call in flight when the run ended: its own result when it returned one (a
        denial that ended the run, a kill mid-command), with the end said; else the end."""
        ended, current = self._ended(), self._current
        if current is not None and self.result is not None:
            for message in reversed(self.result.state.messages):
                if isinstance(message, ToolResultMessage) and message.call_id == current.call.id:
                    why = f": {ended.error}" if ended.error else ""
                    text = f"{message.content}\n(the session's run ended {ended.status}{why})"
                    return CallResult(text=text, is_error=True)
        return ended

    def _ended(self) -> Ended:
        if self._failure is not None:
            return Ended(status="error", error=f"{type(self._failure).__name__}: {self._failure}")
        result = self.result
        if result is None:
            return Ended(status="ended", error="the MCP session has ended")
        return Ended(status=result.status.value, error=result.error)

    def _unqueue(self, item: ClientCall) -> None:
        """``item`` left the inbox's count (taken, cancelled, or told the end); under ``_lock``."""
        if item.queued:
            item.queued = False
            self._queued -= 1
            self.owner._release(item.size)

    def _drain(self) -> None:
        """Calls that arrived after the run ended are told so."""
        ended = self._ended()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, ClientCall):
                with self._lock:
                    self._unqueue(item)
                if not item.future.done():
                    item.future.set_result(ended)


def _size(args: Mapping[str, JsonValue]) -> int:
    """About the bytes ``args`` hold (their JSON), what a queued call keeps."""
    return len(json.dumps(args, ensure_ascii=False, default=str))
