"""``TelemetryObserver``: the agent loop's events as GenAI spans and metrics.

    traced = TelemetryObserver(telemetry)
    agent = Agent(model, tools.wrapped(traced.tool_wrapper), observers=[traced])
    retrier = Retrier(observer=traced.runtime)
    backend = TracedBackend(backend, telemetry)

An ``invoke_agent`` span per run, with a ``chat {model}`` span per model call and an
``execute_tool {tool}`` span per tool call under it; a denied call counts in
``stockade.policy.denials``. Spans are opened and closed from the events, so they carry the
loop's own timing, and parenting is explicit (no reliance on the current context).
``tool_wrapper`` makes a call's span the current one while the tool runs, so that the
``sandbox.*`` spans of ``TracedBackend`` nest under it; ``runtime`` counts retries and
breaker trips and notes them on the current span.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

from stockade.agent.events import (
    AgentEvent,
    ModelRequested,
    ModelResponded,
    RunFinished,
    RunStarted,
    StepFinished,
    ToolCalled,
    ToolDenied,
    ToolReturned,
)
from stockade.observability.telemetry import Telemetry
from stockade.runtime.events import BreakerChanged, RetryScheduled, RuntimeEvent
from stockade.tools.base import CallNext, Tool, ToolContext

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["TelemetryObserver"]


class TelemetryObserver:
    """An agent observer (``observer(event) -> None``) that opens and closes spans."""

    def __init__(self, telemetry: Telemetry, *, agent_name: str = "stockade") -> None:
        self.telemetry = telemetry
        self.agent_name = agent_name
        self._runs: dict[str, Span] = {}
        self._models: dict[tuple[str, int], Span] = {}
        self._tools: dict[tuple[str, str], Span] = {}

    def _child(self, run_id: str, name: str, attributes: dict[str, object]) -> Span:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        parent = self._runs.get(run_id)
        context = trace.set_span_in_context(parent) if parent is not None else None
        kind = SpanKind.CLIENT if name.startswith("chat") else SpanKind.INTERNAL
        return self.telemetry.tracer.start_span(
            name, context=context, kind=kind, attributes=self.telemetry.attributes(attributes)
        )

    async def tool_wrapper(
        self, ctx: ToolContext, tool: Tool, args: BaseModel, call_next: CallNext
    ) -> object:
        """A ``ToolWrapper``: the call's span is current while the tool (and its sandbox ops) run."""
        from opentelemetry import trace

        span = self._tools.get((ctx.run_id, ctx.call_id))
        if span is None:
            return await call_next(ctx, tool, args)
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            return await call_next(ctx, tool, args)

    def runtime(self, event: RuntimeEvent) -> None:
        """A runtime observer: retries and breaker changes as metrics and span events."""
        if isinstance(event, RetryScheduled):
            self.telemetry.retry(operation=event.subject, reason=event.reason, attempt=event.attempt)
        elif isinstance(event, BreakerChanged):
            self.telemetry.breaker_change(breaker=event.name, state=event.new.value)

    def __call__(self, event: AgentEvent) -> None:
        from opentelemetry.trace import Status, StatusCode

        t = self.telemetry
        match event:
            case RunStarted():
                self._runs[event.run_id] = t.tracer.start_span(
                    f"invoke_agent {self.agent_name}",
                    attributes=t.attributes(
                        {
                            "gen_ai.operation.name": "invoke_agent",
                            "gen_ai.agent.name": self.agent_name,
                            "gen_ai.conversation.id": event.run_id,
                            "gen_ai.request.model": event.model_name,
                            "stockade.run_id": event.run_id,
                            "stockade.resumed": event.resumed,
                        }
                    ),
                )
            case ModelRequested():
                self._models[(event.run_id, event.step)] = self._child(
                    event.run_id, "chat", {"gen_ai.operation.name": "chat", "stockade.step": event.step}
                )
            case ModelResponded():
                self._model_responded(event)
            case ToolCalled():
                self._tools[(event.run_id, event.call.id)] = self._child(
                    event.run_id,
                    f"execute_tool {event.call.name}",
                    {
                        "gen_ai.operation.name": "execute_tool",
                        "gen_ai.tool.name": event.call.name,
                        "gen_ai.tool.call.id": event.call.id,
                        "stockade.step": event.step,
                        "stockade.idempotency_key": event.idempotency_key,
                    },
                )
            case ToolReturned():
                record = event.record
                span = self._tools.pop((event.run_id, record.call.id), None)
                if span is not None:
                    if record.is_error:
                        span.set_attribute("error.type", record.error_type or "ToolError")
                        span.set_status(Status(StatusCode.ERROR))
                    span.end()
                t.tool_duration.record(record.duration_s, {"gen_ai.tool.name": record.call.name})
            case ToolDenied():
                span = self._tools.pop((event.run_id, event.call.id), None) or self._runs.get(event.run_id)
                t.denials.add(1, {"stockade.policy.rule": event.rule})
                if span is not None:
                    span.add_event(
                        "policy_denied",
                        t.attributes(
                            {"stockade.policy.rule": event.rule, "gen_ai.tool.name": event.call.name}
                        ),
                    )
            case StepFinished():
                pass
            case RunFinished():
                self._run_finished(event)

    def _model_responded(self, event: ModelResponded) -> None:
        t, response = self.telemetry, event.response
        span = self._models.pop((event.run_id, event.step), None)
        metric = {"gen_ai.operation.name": "chat", "gen_ai.request.model": response.model_name}
        if span is not None:
            span.update_name(f"chat {response.model_name}")
            span.set_attributes(
                t.attributes(
                    {
                        "gen_ai.request.model": response.model_name,
                        "gen_ai.response.model": response.model_name,
                        "gen_ai.response.finish_reasons": [response.finish_reason],
                        "gen_ai.usage.input_tokens": response.usage.input_tokens,
                        "gen_ai.usage.output_tokens": response.usage.output_tokens,
                    }
                )
            )
            span.end()
        t.operation_duration.record(event.duration_s, metric)
        t.token_usage.record(response.usage.input_tokens, {**metric, "gen_ai.token.type": "input"})
        t.token_usage.record(response.usage.output_tokens, {**metric, "gen_ai.token.type": "output"})

    def _run_finished(self, event: RunFinished) -> None:
        from opentelemetry.trace import Status, StatusCode

        run = self._runs.pop(event.run_id, None)
        if run is None:
            return
        result = event.result
        run.set_attributes(
            self.telemetry.attributes(
                {
                    "stockade.status": str(result.status),
                    "gen_ai.usage.input_tokens": result.usage.input_tokens,
                    "gen_ai.usage.output_tokens": result.usage.output_tokens,
                }
            )
        )
        if not result.ok:
            run.set_status(Status(StatusCode.ERROR, str(result.status)))
        run.end()
