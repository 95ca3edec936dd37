"""The run viewer over HTTP (``stockade ui`` on real recorded runs): sign-in, the list and its
filters, one run's timeline, its diff and chain, the headers, and untrusted text escaped."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx2
import pytest

from tests.conftest import require_tier
from tests.integration.viewer_env import XSS, Ui, record_runs

pytestmark = [pytest.mark.process]


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Ui, str, str]]:
    require_tier("process")
    folder = tmp_path_factory.mktemp("viewer")
    busy, stopped = record_runs(folder / "audit.db", folder / "ws")
    server = Ui(folder / "audit.db", folder, folder / "approvals")
    try:
        yield server, busy, stopped
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


@contextlib.contextmanager
def signed_in(ui: Ui) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=ui.url, timeout=30) as client:
        assert client.get(f"/ui/login?key={ui.key}").status_code in (200, 303)
        yield client


def test_nothing_is_shown_without_the_key(ui: tuple[Ui, str, str]) -> None:
    server, busy, _ = ui
    with httpx2.Client(base_url=server.url, timeout=30) as anonymous:
        first = anonymous.get(f"/ui/runs/{busy}")
        assert first.status_code == 303 and first.headers["location"].startswith("/ui/login")
        wrong = anonymous.post("/ui/login", data={"token": "not-the-key"})
        assert wrong.status_code == 401 and busy not in wrong.text
        assert anonymous.get(f"/ui/runs/{busy}/events").status_code == 401
        # the sign-in goes back to a page of the viewer, never elsewhere
        back = anonymous.post("/ui/login", data={"token": server.key, "next": "//evil.example/"})
        assert back.status_code == 303 and back.headers["location"] == "/ui/"
        cookie = back.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie


def test_the_list_filters_by_status_model_and_time(ui: tuple[Ui, str, str]) -> None:
    server, busy, stopped = ui
    with signed_in(server) as client:
        everything = client.get("/ui/").text
        assert busy[:16] in everything and stopped[:16] in everything
        denied = client.get("/ui/", params={"status": "denied"}).text
        assert stopped[:16] in denied and busy[:16] not in denied
        by_model = client.get("/ui/", params={"model": "busy"}).text
        assert busy[:16] in by_model and stopped[:16] not in by_model
        later = client.get("/ui/", params={"since": "2999-01-01T00:00"}).text
        assert busy[:16] not in later and "No runs match" in later
        assert client.get("/ui/", params={"since": "yesterday"}).status_code == 400


def test_a_run_shows_its_steps_diff_and_chain_and_escapes_what_the_model_wrote(
    ui: tuple[Ui, str, str],
) -> None:
    server, busy, _ = ui
    with signed_in(server) as client:
        page = client.get(f"/ui/runs/{busy}")
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    html = page.text
    assert XSS not in html and "&lt;script&gt;window.__pwned" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(2)&gt;" in html
    # the timeline: model calls with tokens, tool calls with exit code and output, the denial
    assert "model call" in html and "out tokens" in html
    assert "run_tests" in html and "exit 3" in html and "denied: write_file" in html
    assert "rule paths" in html
    # the diff, rendered line by line, and the chain
    assert 'class="d-add">+    return f&#39;hello {name}&#39;' in html
    assert "✓ verifies" in html
    # the only script is the viewer's own file
    assert html.count("<script") == 1 and '<script src="/ui/static/viewer.js" defer></script>' in html


def test_a_missing_run_is_404(ui: tuple[Ui, str, str]) -> None:
    server, _, _ = ui
    with signed_in(server) as client:
        assert client.get("/ui/runs/no-such-run").status_code == 404
