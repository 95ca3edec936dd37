"""The service's face to browsers, through the real application (``create_app``) under
uvicorn on 127.0.0.1 in a thread, on a real SQLite database: the interactive docs (a CDN's
scripts on the viewer's origin) only when asked for."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import uvicorn
from typer.testing import CliRunner

from stockade.cli.main import app
from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service
from stockade.server.tenants import Tenant, Tenants, new_token
from tests.conftest import wait_for
from tests.unit.server.test_run_controls import Recorded


@dataclass(frozen=True)
class Served:
    url: str
    service: Service
    acme: str  # acme's API token
    other: str  # another tenant's


@contextlib.contextmanager
def serving(tmp_path: Path, **config: object) -> Iterator[Served]:
    acme, acme_record = new_token("acme")
    other, other_record = new_token("other")
    tenants = Tenants(
        tenants={"acme": Tenant(id="acme"), "other": Tenant(id="other")},
        tokens={r.id: r for r in (acme_record, other_record)},
    )
    service = Service(
        ServiceConfig(
            tenants=tenants, database=f"sqlite:///{tmp_path / 'service.db'}", temp_dir=tmp_path,
            event_poll_s=0.05, **config,  # type: ignore[arg-type]
        ),
        executor=Recorded(),
    )  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, what="the service to start", timeout_s=10)
    try:
        yield Served(f"http://127.0.0.1:{port}", service, acme, other)
    finally:
        server.should_exit = True
        thread.join(15)


# -- the interactive docs --------------------------------------------------------------------------


def test_the_interactive_docs_are_off_unless_asked_for(tmp_path: Path) -> None:
    """Their pages load a CDN's scripts, which would run on the viewer's origin: its fetches
    carry the viewer's cookie (the API token), a decision's form included."""
    with serving(tmp_path / "plain") as plain, httpx2.Client(base_url=plain.url, timeout=10) as c:
        assert c.get("/docs").status_code == 404 and c.get("/redoc").status_code == 404
        assert c.get("/openapi.json").json()["info"]["title"] == "stockade"
        assert "/openapi.json" in c.get("/nothing-here").json()["fix"]
    (tmp_path / "asked").mkdir()
    with serving(tmp_path / "asked", docs=True) as asked, httpx2.Client(base_url=asked.url, timeout=10) as c:
        assert "swagger-ui" in c.get("/docs").text and c.get("/redoc").status_code == 200


def test_serve_asks_for_the_docs_with_a_flag_that_says_what_it_trades() -> None:
    described = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert described.exit_code == 0
    assert "--docs" in described.output and "CDN" in described.output and "origin" in described.output
