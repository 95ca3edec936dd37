"""A known secret handed to a real sandbox never reaches the audit store, the logs or the spans."""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path

from stockade import Limits, Sandbox
from stockade.agent import RunLimits
from stockade.assembly import AgentConfig, build_agent
from stockade.audit import AuditedBackend, AuditLog, EventKind, Redactor, SQLiteStore, verify
from stockade.models import ScriptedModel, tool_call
from stockade.observability import Telemetry, TracedBackend, json_logger
from stockade.sandbox import _registry
from tests.conftest import require, require_tier

EXAMPLE_POLICY = Path(__file__).parents[2] / "examples" / "policy.toml"
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


def test_credentials_written_as_json_or_env_assignments_reach_no_table(tmp_path: Path) -> None:
    """A config file written, read back and shown in the diff, and an env line echoed: the
    audit trail and every run table hold the names, never the values."""
    require_tier("process")
    (tmp_path / "project").mkdir()
    config = '{"db": {"user": "bob", "password": "JsonPw-7788aa"}, "clientSecret": "cs-4455-plain"}'
    model = ScriptedModel(
        [
            tool_call("write_file", {"path": "cfg.json", "content": config}),
            tool_call("read_file", {"path": "cfg.json"}),
            tool_call("run_tests", {"command": "echo AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG"}),
            "done",
        ]
    )
    db = tmp_path / "audit.db"
    agent_config = AgentConfig(
        model=model,
        policy=EXAMPLE_POLICY,
        tier="process",
        audit=f"sqlite:///{db}",
        limits=RunLimits(max_steps=6),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
    )
    with build_agent(agent_config) as agent:
        result = agent.run_sync("write the config", workspace=tmp_path / "project", run_id="cfg")
    assert result.ok, result.state.error

    with sqlite3.connect(db) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        rows = {t: [repr(row) for row in con.execute(f'SELECT * FROM "{t}"')] for t in tables}
    for value in ("JsonPw-7788aa", "cs-4455-plain", "wJalrXUtnFEMI"):
        assert not [t for t, held in rows.items() if any(value in row for row in held)], value
    assert any("json_assignment" in row for row in rows["runs_tool_calls"])  # redacted, not dropped
