"""The runtime controls plugged into an ``Agent``, each through the loop's own extension points.

    controls = RuntimeControls(run_id="run-1", rate=RateLimit(per_minute=60),
                               kill_switch=KillSwitch("run-1", [FileKillSource()]),
                               failures=AgentBreaker(threshold=5))
    agent = Agent(model, tools=controls.wrap_tools(default_toolset()), guards=[controls.guard],
                  observers=[controls.observe])
    with controls.watch():                                  # polls the kill sources
        agent.run_sync(task, sandbox=controls.protect(sbx), run_id="run-1")

- ``observe`` (an agent observer): pulls the kill switch check before every model request and
  tool call (the run stops between steps with status "killed"), counts failed actions for the
  agent's breaker (``failures``: the run stops "broken") and feeds the anomaly monitor;
- ``guard`` (a loop guard, put first): a killed or broken run stops before the next tool call
  is judged or recorded;
- ``wrap_tools``: a tool wrapper that applies the action rate limits, per run (``run_rate``)
  and shared by every run of ``rate_key`` (``rate``; across processes with a ``RedisWindow``):
  a refused action waits for the window (``on_rate_limit="wait"``, the kill switch still
  stops it) or stops the run (``"stop"``, status "budget"); the model never hears of a
  refusal, so no model call is spent on one. Then the tool's breaker (a tool that keeps
  raising is refused for a while), and, for a tool declared ``idempotent``, retries of
  transient failures (``retrier``; a tool that is not idempotent is never run twice);
- ``flag`` (``on_flag`` of the policy's prompt filters): a prompt rule flagged the task or a
  tool's output: recorded (``observer``), logged (the ``stockade.runtime`` logger) and counted
  by the anomaly monitor;
- ``protect``: a sandbox whose processes die the moment the switch is pulled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from stockade.agent.events import (
    AgentEvent,
    ModelRequested,
    ModelResponded,
    ToolCalled,
    ToolDenied,
    ToolReturned,
)
from stockade.agent.settings import GuardContext
from stockade.exceptions import RunStopped, RuntimeLimit
from stockade.models.messages import ToolCall
from stockade.models.pricing import DEFAULT_PRICES, cost_usd
from stockade.runtime.anomaly import ActionRecord, AnomalyMonitor
from stockade.runtime.breaker import Breakers
from stockade.runtime.clock import Clock, SystemClock
from stockade.runtime.events import Observer, PromptFlagged, ignore
from stockade.runtime.failures import AgentBreaker
from stockade.runtime.killswitch import KillSwitch
from stockade.runtime.limits import LimitGate, OnLimit, RateLimit
from stockade.runtime.retry import Retrier, is_transient
from stockade.sandbox.facade import Sandbox
from stockade.tools.base import CallNext, Tool, ToolContext, Toolset
from stockade.tools.deadline import stopping

__all__ = ["RuntimeControls"]

log = logging.getLogger("stockade.runtime")


def _transient(err: BaseException) -> bool:
    """What a tool call is retried for: a transient failure, not a control's refusal."""
    return is_transient(err) and not isinstance(err, RuntimeLimit | RunStopped)


def fingerprint(name: str, args: object) -> str:
    body = args.model_dump(mode="json") if isinstance(args, BaseModel) else args
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{name}:{digest}"


@dataclass(kw_only=True)
class RuntimeControls:
    run_id: str
    breakers: Breakers = field(default_factory=Breakers)
    rate: RateLimit | None = None  # shared by every run of ``rate_key``
    rate_key: str = "global"
    run_rate: RateLimit | None = None  # this run's own
    on_rate_limit: OnLimit = OnLimit.WAIT
    # a longer wait for a window stops the run resumable (``LimitWait``) instead of sleeping here
    limit_wait_in_place_s: float | None = None
    clock: Clock = field(default_factory=SystemClock)  # what a wait for a window waits on
    kill_switch: KillSwitch | None = None
    monitor: AnomalyMonitor | None = None
    failures: AgentBreaker | None = None  # the agent's breaker: N failed actions in a row stop the run
    retrier: Retrier | None = None  # retries transient failures of idempotent tools
    observer: Observer = ignore  # what the controls report themselves (flags)

    # -- observer and guard -------------------------------------------------------------

    def observe(self, event: AgentEvent) -> None:
        if isinstance(event, ModelRequested | ToolCalled) and self.kill_switch is not None:
            self.kill_switch.check()
        if self.failures is not None:
            self.failures.observe(event)
        if self.monitor is None:
            return
        match event:
            case ToolReturned():
                record = event.record
                self.monitor.observe(
                    ActionRecord(
                        subject=f"tool:{record.call.name}",
                        fingerprint=fingerprint(record.call.name, record.call.args),
                        ok=not record.failed,
                        output_bytes=len(record.observation.encode()),
                    )
                )
            case ToolDenied():
                self.monitor.observe(
                    ActionRecord(
                        subject=f"tool:{event.call.name}",
                        fingerprint=fingerprint(event.call.name, event.call.args),
                        ok=False,
                        denied=True,
                    )
                )
            case ModelResponded():
                response = event.response
                self.monitor.observe(
                    ActionRecord(
                        subject=f"model:{response.model_name}",
                        fingerprint=f"model:{event.step}",
                        dollars=cost_usd(response.model_name, response.usage, DEFAULT_PRICES),
                    )
                )
            case _:
                pass

    def guard(self, ctx: GuardContext, call: ToolCall) -> ToolCall:
        """A loop guard: a killed or broken run goes no further."""
        if self.kill_switch is not None:
            self.kill_switch.check()
        if self.failures is not None:
            self.failures.check()
        return call

    # -- tools --------------------------------------------------------------------------

    async def tool_wrapper(
        self, ctx: ToolContext, tool: Tool, args: BaseModel, call_next: CallNext
    ) -> object:
        if self.kill_switch is not None:
            self.kill_switch.check()
            # the tool's host work (a worker thread) stops at its next checkpoint once killed
            with stopping(self.kill_switch.raise_if_pulled):
                return await self._call(ctx, tool, args, call_next)
        return await self._call(ctx, tool, args, call_next)

    async def _call(self, ctx: ToolContext, tool: Tool, args: BaseModel, call_next: CallNext) -> object:
        await self._admit(self.run_rate, f"run:{self.run_id}")
        await self._admit(self.rate, self.rate_key)
        breaker = self.breakers.get(f"tool:{tool.name}")
        retrier = self.retrier
        if retrier is None or not tool.idempotent:
            return await breaker.acall(lambda: call_next(ctx, tool, args))
        subject = f"tool:{tool.name}"
        return await breaker.acall(
            lambda: retrier.acall(subject, lambda: call_next(ctx, tool, args), transient=_transient)
        )

    async def _admit(self, limit: RateLimit | None, key: str) -> None:
        if limit is None:
            return
        gate = LimitGate(
            on_limit=OnLimit(self.on_rate_limit), clock=self.clock, observer=limit.observer,
            wait_in_place_s=self.limit_wait_in_place_s,
        )  # fmt: skip
        await gate.admit(
            kind="rate",
            key=key,
            probe=lambda: limit.take(key),
            describe=lambda _: limit.describe(key),
            interrupted=self.kill_switch.check if self.kill_switch is not None else None,
        )

    def wrap_tools(self, tools: Toolset) -> Toolset:
        return tools.wrapped(self.tool_wrapper)

    # -- flags ----------------------------------------------------------------------------

    def flag(self, event: PromptFlagged) -> None:
        """A prompt rule flagged the task or a tool's output: record, log, count."""
        where = "the task" if event.source == "task" else f"the output of {event.tool or 'a tool'}"
        log.warning("run %s: prompt rule(s) %s flagged %s", self.run_id, ", ".join(event.rules), where)
        self.observer(event)
        if self.monitor is not None:
            subject = "prompt:task" if event.source == "task" else f"tool:{event.tool}"
            self.monitor.observe(
                ActionRecord(subject=subject, fingerprint=f"flag:{','.join(event.rules)}", flagged=True)
            )

    # -- sandbox ------------------------------------------------------------------------

    def protect(self, sandbox: Sandbox) -> Sandbox:
        """The same sandbox, killed with the run."""
        if self.kill_switch is None:
            return sandbox
        return Sandbox(self.kill_switch.attach(sandbox.instance))

    @contextlib.contextmanager
    def watch(self) -> Iterator[RuntimeControls]:
        if self.kill_switch is None:
            yield self
            return
        with self.kill_switch.watch():
            yield self
