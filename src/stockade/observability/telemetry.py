"""OpenTelemetry spans and metrics for runs, model calls, tool calls and sandbox operations.

Names and attributes follow the OpenTelemetry GenAI semantic conventions where they exist:
``invoke_agent {agent}``, ``chat {model}`` and ``execute_tool {tool}`` spans with
``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.model``,
``gen_ai.usage.input_tokens``/``output_tokens``, ``gen_ai.tool.name``, ``gen_ai.tool.call.id``,
and the ``gen_ai.client.operation.duration`` / ``gen_ai.client.token.usage`` histograms.
Sandbox operations use ``process.command_args`` / ``process.exit.code`` and ``stockade.*``.
stockade's own counters: ``stockade.retries``, ``stockade.breaker.trips``,
``stockade.policy.denials``; durations: ``stockade.sandbox.duration``, ``stockade.tool.duration``.

Hooks only: pass your ``tracer_provider`` / ``meter_provider``; without them the global
OpenTelemetry API is used (a no-op unless your application set providers). stockade never
sets a global provider. Every string attribute goes through the ``Redactor`` first.
Needs the ``otel`` extra: ``pip install "stockade[otel]"``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from stockade import __version__
from stockade import exceptions as exc
from stockade.audit.redact import Redactor

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import Span, TracerProvider
    from opentelemetry.util.types import AttributeValue

__all__ = ["ModelCall", "Telemetry"]

SCOPE = "stockade"
# Span attribute strings are cut here: spans are for finding things, the audit trail keeps more.
ATTRIBUTE_CAP = 4096


def _otel() -> None:
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError as error:
        raise exc.ConfigurationError(
            'stockade telemetry needs OpenTelemetry: pip install "stockade[otel]"'
        ) from error


class ModelCall:
    """The span of one model call; record the response when it arrives."""

    def __init__(
        self, telemetry: Telemetry, span: Span, metric_attributes: dict[str, AttributeValue]
    ) -> None:
        self._telemetry = telemetry
        self.span = span
        self._metric_attributes = metric_attributes

    def record_response(
        self,
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        finish_reasons: Sequence[str] = (),
        response_model: str | None = None,
        response_id: str | None = None,
    ) -> None:
        attributes: dict[str, object] = {
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": list(finish_reasons) or None,
            "gen_ai.response.model": response_model,
            "gen_ai.response.id": response_id,
        }
        self.span.set_attributes(self._telemetry.attributes(attributes))
        for token_type, count in (("input", input_tokens), ("output", output_tokens)):
            if count is not None:
                self._telemetry.token_usage.record(
                    count, {**self._metric_attributes, "gen_ai.token.type": token_type}
                )


class Telemetry:
    """Spans, metrics and (optionally) JSON log lines for every observed operation."""

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        redactor: Redactor | None = None,
        logger: Any = None,
    ) -> None:
        _otel()
        from opentelemetry import metrics, trace

        self.redactor = redactor if redactor is not None else Redactor()
        self.logger = logger
        self.tracer = trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
        self.operation_duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s", description="GenAI operation duration"
        )
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}", description="Tokens used per model call"
        )
        self.tool_duration = meter.create_histogram("stockade.tool.duration", unit="s")
        self.sandbox_duration = meter.create_histogram("stockade.sandbox.duration", unit="s")
        self.retries = meter.create_counter("stockade.retries", unit="{retry}")
        self.breaker_trips = meter.create_counter("stockade.breaker.trips", unit="{trip}")
        self.denials = meter.create_counter("stockade.policy.denials", unit="{denial}")

    # -- helpers ---------------------------------------------------------------------------

    def attributes(self, values: Mapping[str, object]) -> dict[str, AttributeValue]:
        """Span-ready attributes: redacted, capped, ``None`` dropped, lists of one type."""
        out: dict[str, AttributeValue] = {}
        for name, value in values.items():
            if value is None:
                continue
            if isinstance(value, bool | int | float):
                out[name] = value
            elif isinstance(value, list | tuple):
                out[name] = [self._text(item) for item in value]
            else:
                out[name] = self._text(value)
        return out

    def _text(self, value: object) -> str:
        text = self.redactor.text(value if isinstance(value, str) else str(value))
        return text if len(text) <= ATTRIBUTE_CAP else text[:ATTRIBUTE_CAP] + "…"

    @contextmanager
    def span(self, name: str, attributes: Mapping[str, object], *, kind: str = "internal") -> Iterator[Span]:
        """A span that records an escaping exception (``error.type``) and logs when it ends."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        span_kind = SpanKind.CLIENT if kind == "client" else SpanKind.INTERNAL
        start = time.perf_counter()
        error_type: str | None = None
        with self.tracer.start_as_current_span(
            name,
            kind=span_kind,
            attributes=self.attributes(attributes),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except BaseException as error:
                error_type = type(error).__name__
                span.set_attribute("error.type", error_type)
                span.set_status(Status(StatusCode.ERROR, self._text(str(error))))
                span.add_event(
                    "exception", {"exception.type": error_type, "exception.message": self._text(error)}
                )
                raise
            finally:
                if self.logger is not None:
                    self.logger.info(
                        name,
                        duration_s=round(time.perf_counter() - start, 6),
                        error=error_type,
                        **{k.replace(".", "_"): v for k, v in attributes.items() if v is not None},
                    )

    # -- GenAI operations ------------------------------------------------------------------

    @contextmanager
    def agent_run(self, agent: str, *, run_id: str) -> Iterator[Span]:
        attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": agent,
            "gen_ai.conversation.id": run_id,
            "stockade.run_id": run_id,
        }
        with self.span(f"invoke_agent {agent}", attributes) as span:
            yield span

    @contextmanager
    def model_call(
        self, *, provider: str, model: str, run_id: str = "", step: int | None = None
    ) -> Iterator[ModelCall]:
        metric_attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
        }
        attributes = {**metric_attributes, "stockade.run_id": run_id or None, "stockade.step": step}
        start = time.perf_counter()
        error_type: str | None = None
        try:
            with self.span(f"chat {model}", attributes, kind="client") as span:
                yield ModelCall(self, span, metric_attributes)
        except BaseException as error:
            error_type = type(error).__name__
            raise
        finally:
            recorded = dict(metric_attributes)
            if error_type is not None:
                recorded["error.type"] = error_type
            self.operation_duration.record(time.perf_counter() - start, recorded)

    @contextmanager
    def tool_call(
        self, tool: str, *, call_id: str = "", run_id: str = "", step: int | None = None
    ) -> Iterator[Span]:
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool,
            "gen_ai.tool.call.id": call_id or None,
            "stockade.run_id": run_id or None,
            "stockade.step": step,
        }
        start = time.perf_counter()
        error_type: str | None = None
        try:
            with self.span(f"execute_tool {tool}", attributes) as span:
                yield span
        except BaseException as error:
            error_type = type(error).__name__
            raise
        finally:
            recorded: dict[str, AttributeValue] = {"gen_ai.tool.name": tool}
            if error_type is not None:
                recorded["error.type"] = error_type
            self.tool_duration.record(time.perf_counter() - start, recorded)

    # -- runtime controls ------------------------------------------------------------------

    def retry(self, *, operation: str, reason: str, attempt: int) -> None:
        """Count a retry and note it on the current span."""
        from opentelemetry import trace

        self.retries.add(1, {"stockade.operation": operation, "stockade.retry.reason": self._text(reason)})
        trace.get_current_span().add_event(
            "retry", self.attributes({"stockade.retry.reason": reason, "stockade.retry.attempt": attempt})
        )

    def breaker_change(self, *, breaker: str, state: str) -> None:
        """Note a circuit breaker's new state; a change to ``open`` counts as a trip."""
        from opentelemetry import trace

        if state == "open":
            self.breaker_trips.add(1, {"stockade.breaker": breaker})
        trace.get_current_span().add_event(
            "breaker_change", self.attributes({"stockade.breaker": breaker, "stockade.breaker.state": state})
        )

    def denial(self, *, rule: str, action: str = "") -> None:
        """Count a policy denial and note it on the current span."""
        from opentelemetry import trace

        self.denials.add(1, {"stockade.policy.rule": rule})
        trace.get_current_span().add_event(
            "policy_denied", self.attributes({"stockade.policy.rule": rule, "stockade.policy.action": action})
        )
