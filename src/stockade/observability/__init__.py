"""Observability through hooks: JSON logs you own, spans and metrics through your providers.

    telemetry = Telemetry(tracer_provider=provider, meter_provider=meters, redactor=redactor,
                          logger=json_logger(sys.stderr, redactor=redactor))
    backend = TracedBackend(backend, telemetry)
    with telemetry.model_call(provider="openai", model="gpt-4o") as call:
        ...; call.record_response(input_tokens=120, output_tokens=40)

Nothing here installs a global handler or provider. ``Telemetry`` and the traced wrappers
need the ``otel`` extra (imported when a ``Telemetry`` is made, never at import).
"""

from stockade.observability.logs import json_logger
from stockade.observability.sandbox import TracedBackend, TracedInstance
from stockade.observability.telemetry import ModelCall, Telemetry

__all__ = ["ModelCall", "Telemetry", "TracedBackend", "TracedInstance", "json_logger"]
