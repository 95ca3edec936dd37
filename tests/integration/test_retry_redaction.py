"""A model gateway that fails once with the API key it was sent quoted in its error (a 503
"upstream overloaded for Bearer <key>"): the run retries and succeeds, and the key is nowhere
the retry is written down: not in the run store, not in `stockade runs show`, not in the
retry metric, not in stamina's own log line. A key of any shape is caught, since the model's
key is registered with the redactors; an ``sk-...`` key would be caught by its shape alone."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from typer.testing import CliRunner

from stockade.agent import RunLimits
from stockade.assembly import AgentConfig, build_agent
from stockade.cli.main import app
from stockade.models.openai_chat import OpenAIModel
from stockade.observability import Telemetry
from stockade.runtime import RetryPolicy
from tests.conftest import require_tier

pytestmark = pytest.mark.process

EXAMPLE_POLICY = Path(__file__).parents[2] / "examples" / "policy.toml"
runner = CliRunner()


class QuotingGateway(BaseHTTPRequestHandler):
    """OpenAI-compatible: the first request gets a 503 quoting its Authorization header."""

    requests = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).requests += 1
        if type(self).requests == 1:
            status = 503
            auth = self.headers.get("Authorization", "")
            body: dict[str, object] = {"error": {"message": f"upstream overloaded for {auth}"}}
        else:
            status = 200
            body = {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "gpt-4.1",
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "done"}}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            }
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def gateway() -> Iterator[str]:
    handler = type("Gateway", (QuotingGateway,), {"requests": 0})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(
    "key",
    ["gwkey-PlainShape-77665544", "sk-proj-LeakTestKey0123456789abcdef"],
    ids=["a key of no known shape", "an sk- key"],
)
def test_a_key_the_gateway_quotes_in_a_retried_error_is_written_nowhere(
    tmp_path: Path, gateway: str, key: str, stamina_log: list[Any]
) -> None:
    require_tier("process")
    (tmp_path / "project").mkdir()
    db = tmp_path / "audit.db"
    metrics = InMemoryMetricReader()
    config = AgentConfig(
        model=OpenAIModel("gpt-4.1", base_url=gateway, api_key=key),
        policy=EXAMPLE_POLICY,
        tier="process",
        audit=f"sqlite:///{db}",
        telemetry=Telemetry(meter_provider=MeterProvider(metric_readers=[metrics])),
        limits=RunLimits(max_steps=3),
        retry=RetryPolicy(wait_initial=0.01, wait_jitter=0),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
    )
    logs = stamina_log
    with build_agent(config) as agent:
        result = agent.run_sync("say done", workspace=tmp_path / "project", run_id="quoted-key")
    assert result.ok, result.state.error
    secret = key.split("-", 1)[1]  # what an sk- key keeps after its prefix is secret too

    with sqlite3.connect(db) as con:
        (reason,) = con.execute("SELECT reason FROM runs_retries WHERE run_id = 'quoted-key'").fetchone()
        everything = [repr(row) for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")
                      for row in con.execute(f'SELECT * FROM "{t}"')]  # fmt: skip
    assert reason.startswith("ModelUnavailable: ") and "Bearer [REDACTED" in reason
    assert not [row for row in everything if secret in row]

    for args in (["runs", "show", "quoted-key"], ["runs", "show", "quoted-key", "--json"]):
        shown = runner.invoke(app, [*args, "--db", f"sqlite:///{db}"])
        assert shown.exit_code == 0, shown.output
        assert "upstream overloaded" in shown.output and secret not in shown.output

    data = metrics.get_metrics_data()
    assert data is not None
    exported = data.to_json()
    assert "stockade.retry.reason" in exported and secret not in exported

    stamina_lines = [line for line in logs if line["event"] == "stamina.retry_scheduled"]
    assert stamina_lines and "upstream overloaded" in stamina_lines[0]["caused_by"]
    assert secret not in repr(stamina_lines)
