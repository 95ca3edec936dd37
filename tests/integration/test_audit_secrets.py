"""A known secret handed to a real sandbox never reaches the audit store, the logs or the spans."""

from __future__ import annotations

import io
import json
from pathlib import Path

from stockade import Limits, Sandbox
from stockade.audit import AuditedBackend, AuditLog, EventKind, Redactor, SQLiteStore, verify
from stockade.observability import Telemetry, TracedBackend, json_logger
from stockade.sandbox import _registry
from tests.conftest import require, require_tier

SECRET = "tok-9f8e7d6c5b4a-never-write-me"
LOOKS_LIKE_A_KEY = "sk-proj-Q1w2E3r4T5y6U7i8O9p0AsDfGh"  # nobody registered it: caught by its shape


def test_a_secret_never_reaches_store_logs_or_spans(tmp_path: Path) -> None:
    require_tier("process")
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    except ImportError:
        require("opentelemetry-sdk", False, 'pip install "stockade[otel]"')
        raise

    redactor = Redactor()
    redactor.add_secret(SECRET)  # the caller registers what it hands to the sandbox
    logs = io.StringIO()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(
        tracer_provider=provider, redactor=redactor, logger=json_logger(logs, redactor=redactor)
    )
    store = SQLiteStore(tmp_path / "audit.db")
    log = AuditLog(store, redactor=redactor)

    backend = TracedBackend(AuditedBackend(_registry.backend("process"), log, run_id="run-1"), telemetry)
    with Sandbox.create(backend=backend, envs={"API_TOKEN": SECRET}, limits=Limits(timeout_s=20)) as sbx:
        result = sbx.commands.run('echo "$API_TOKEN"')
        assert result.stdout.strip() == SECRET  # the sandbox did get it
        sbx.commands.run(["echo", SECRET, LOOKS_LIKE_A_KEY], envs={"EXTRA": SECRET})
        sbx.files.write("notes.txt", f"token={SECRET}")
        sbx.run_code(f"key = {SECRET!r}")
        log.record(EventKind.NOTE, run_id="run-1", attributes={"said": f"the key is {LOOKS_LIKE_A_KEY}"})
    log.close()
    store.close()
    provider.shutdown()

    assert verify(SQLiteStore(tmp_path / "audit.db")).ok
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("audit.db"))
    spans = json.dumps([dict(s.attributes or {}) for s in exporter.get_finished_spans()])
    for secret in (SECRET, LOOKS_LIKE_A_KEY):
        assert secret.encode() not in stored
        assert secret not in logs.getvalue()
        assert secret not in spans
    assert b"[REDACTED:secret]" in stored and "[REDACTED:secret]" in spans  # redacted, not dropped
