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


def test_an_exec_word_the_sandbox_cut_keeps_no_head_of_a_credential(tmp_path: Path) -> None:
    """The sandbox caps each word of an exec it reports (4,096 characters) before the host
    redacts it: a token or a registered secret straddling the cap leaves no head in the trail."""
    require_tier("process")
    (tmp_path / "project").mkdir()
    token = "ghp_" + "C" * 36
    straddling = ["B" * 4072 + " " + token, "A" * 4090 + " " + SECRET]  # both cut inside the credential
    code = f"import subprocess\nsubprocess.run(['/bin/echo', *{straddling!r}], check=True)\n"
    redactor = Redactor()
    redactor.add_secret(SECRET)
    store = SQLiteStore(tmp_path / "audit.db")
    log = AuditLog(store, redactor=redactor)
    agent_config = AgentConfig(
        model=ScriptedModel([tool_call("run_code", {"code": code, "language": "python"}), "done"]),
        policy=EXAMPLE_POLICY,
        tier="process",
        audit=log,
        limits=RunLimits(max_steps=4),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
    )
    with build_agent(agent_config) as agent:
        result = agent.run_sync("echo", workspace=tmp_path / "project", run_id="cut")
    assert result.ok, result.state.error
    log.close()
    store.close()

    with sqlite3.connect(tmp_path / "audit.db") as con:
        bodies = [json.loads(b) for (b,) in con.execute("SELECT body FROM audit_events WHERE kind = 'exec'")]
    argvs = [b["attributes"].get("argv", []) for b in bodies]
    words = [w for argv in argvs for w in argv if isinstance(w, str) and "more characters" in w]
    assert len(words) == 2, argvs  # the sandbox did cut both
    for word in words:
        assert "[REDACTED:cut][... " in word, word[-200:]
        assert "CCCC" not in word and SECRET[:4] not in word, word[-200:]


def test_secrets_in_here_documents_reach_no_store(tmp_path: Path) -> None:
    """A key, a YAML password and an env line written with ``cat <<EOF``: the files hold them,
    the trail shows every command and no value."""
    require_tier("process")
    key_line = "QyNTUxOQAAACDkHEREDOCKEYBODY2"
    secrets = (key_line, "hunter2xyzHEREDOC", "djangoHEREDOCvalue123")
    command = (
        "cat > id_ed25519 <<'EOF'\n-----BEGIN OPENSSH PRIVATE KEY-----\n"
        f"b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n{key_line}\n"
        "-----END OPENSSH PRIVATE KEY-----\nEOF\n"
        f"cat > config.yaml <<EOF\ndb:\n  password: {secrets[1]}\nEOF\n"
        f"cat > .env <<-EOF\n\tSECRET_KEY={secrets[2]}\n\tEOF\n"
        "cat id_ed25519 config.yaml .env | wc -l"
    )
    store = SQLiteStore(tmp_path / "audit.db")
    log = AuditLog(store)
    backend = AuditedBackend(_registry.backend("process"), log, run_id="run-1")
    with Sandbox.create(backend=backend, limits=Limits(timeout_s=20)) as sbx:
        result = sbx.commands.run(command)
        assert result.stdout.strip() == "7" and key_line in sbx.files.read("id_ed25519")
    log.close()
    store.close()

    assert verify(SQLiteStore(tmp_path / "audit.db")).ok
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("audit.db"))
    for secret in secrets:
        assert secret.encode() not in stored
    assert b"[REDACTED:private_key]" in stored and b"cat id_ed25519 config.yaml .env | wc -l" in stored


def test_a_command_hidden_in_a_program_is_in_the_trail_and_its_secret_is_not(tmp_path: Path) -> None:
    """A bash program and Python code whose string ends with a credential's flag: the value
    once ran across the closing quote and ``;``, and the trail showed ``[REDACTED:flag]`` where
    the program removed a folder."""
    require_tier("process")
    store = SQLiteStore(tmp_path / "audit.db")
    log = AuditLog(store)
    with Sandbox.create(
        backend=AuditedBackend(_registry.backend("process"), log, run_id="r2"), limits=Limits(timeout_s=20)
    ) as sbx:
        sbx.run_code('mkdir -p src\nV="--password "; rm -rf src; echo "done" --token Zq9hunter2x\n', "bash")
        sbx.run_code('import os\nos.makedirs("src2")\nP = "--password "; os.rmdir("src2"); Q = "x"')
        sbx.run_code('password = "Zq9 hunter2x"')
        assert not sbx.files.exists("src") and not sbx.files.exists("src2")
    log.close()
    programs = [e.attributes.get("program") or e.attributes.get("code") for e in store.events(run_id="r2")]
    recorded = json.dumps(programs)
    assert "rm -rf src; echo" in recorded and 'os.rmdir(\\"src2\\")' in recorded
    assert "Zq9hunter2x" not in recorded and "Zq9 hunter2x" not in recorded
    store.close()
