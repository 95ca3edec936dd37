"""The run viewer in a real browser (Debian's headless chromium, driven by Playwright): a
finished run, a live run that updates by itself, an approval given with the button that sends
the run on, a tool output holding ``<script>`` shown as text, and the roles and tenants of
``stockade serve`` holding in the pages as in the API."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2
import mcp_types as types
import pytest

from stockade.client import Client
from stockade.policy.approval import ApprovalStore
from stockade.server.tenants import Tenants, new_token
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import REPO, Server
from tests.integration.viewer_env import XSS, Ui, chromium, record_runs

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Dialog, Page

pytestmark = [pytest.mark.process, pytest.mark.slow]

SERVICE_POLICY = """\
version = 1
[trust]
level = "trusted"
[models]
approved = ["scripted*"]
[commands]
approve = ["rm -r"]
[roles.dev]
tiers = ["process"]
[roles.watcher]
tiers = ["process"]
can_approve = false
"""
MCP_POLICY = """\
version = 1
[trust]
level = "trusted"
[models]
approved = ["mcp"]
[commands]
approve = ["rm -r"]
"""
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    try:
        yield opened
    finally:
        context.close()


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Ui, str]]:
    require_tier("process")
    folder = tmp_path_factory.mktemp("viewer-browser")
    busy, _ = record_runs(folder / "audit.db", folder / "ws")
    ui = Ui(folder / "audit.db", folder, folder / "approvals")
    try:
        yield ui, busy
    finally:
        ui.stop()


class Tokens:
    def __init__(self, dev: str, watcher: str, other: str) -> None:
        self.dev, self.watcher, self.other = dev, watcher, other


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens]]:
    require_tier("process")
    folder = tmp_path_factory.mktemp("viewer-service")
    (folder / "policy.toml").write_text(SERVICE_POLICY)
    dev, dev_record = new_token("acme", "dev")
    watcher, watcher_record = new_token("acme", "watcher")
    other, other_record = new_token("other", "dev")
    empty = Tenants(tenants={}, tokens={})
    (folder / "tenants.toml").write_text(
        '[tenants.acme]\npolicy = "policy.toml"\n\n[tenants.other]\npolicy = "policy.toml"\n\n'
        + "\n".join(empty.toml_lines(r) for r in (dev_record, watcher_record, other_record))
    )
    server = Server(folder / "tenants.toml", f"sqlite:///{folder / 'service.db'}", folder)
    try:
        yield server, Tokens(dev, watcher, other)
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


def sign_in(page: Page, base: str, token: str, then: str = "/ui/") -> None:
    page.goto(f"{base}/ui/login?next={then}")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}{then}")


def run_code(code: str, language: str = "python") -> dict[str, Any]:
    return {"name": "run_code", "args": {"code": code, "language": language}}


# -- a finished run, and what the model wrote ------------------------------------------------------


def test_a_finished_run_reads_as_a_timeline(finished: tuple[Ui, str], page: Page, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    ui, busy = finished
    page.goto(f"{ui.url}/ui/login?key={ui.key}")
    expect(page.locator("table.runs")).to_contain_text(busy[:16])
    page.click(f"a[href='/ui/runs/{busy}']")
    expect(page.locator("#run-status")).to_have_text("success")
    tools = page.locator(".entry.k-tool")
    expect(tools.first).to_be_visible()
    assert tools.count() >= 3
    expect(page.locator(".entry.k-tool", has_text="run_tests")).to_contain_text("exit 3")
    expect(page.locator(".entry.k-denial")).to_contain_text("denied: write_file")
    expect(page.locator(".entry.k-model").first).to_contain_text("out tokens")
    expect(page.locator("pre.diff .d-add").first).to_be_visible()
    expect(page.locator("#chain")).to_contain_text("verifies")
    assert page.locator("[data-live]").count() == 0  # nothing to follow
    page.screenshot(path=str(tmp_path / "finished.png"), full_page=True)


def test_a_script_in_a_tool_output_is_text(finished: tuple[Ui, str], page: Page) -> None:
    from playwright.sync_api import expect

    ui, busy = finished
    dialogs: list[str] = []

    def seen(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", seen)
    page.goto(f"{ui.url}/ui/login?key={ui.key}")
    page.goto(f"{ui.url}/ui/runs/{busy}")
    shown = page.locator("pre.out", has_text="window.__pwned")
    expect(shown).to_be_visible()
    assert XSS in shown.inner_text()  # the characters, as the code printed them
    assert page.evaluate("typeof window.__pwned") == "undefined"
    expect(page.locator(".card", has_text="Answer")).to_contain_text("<img src=x onerror=alert(2)>")
    assert dialogs == []


def test_a_long_run_pages_back_to_its_first_event(page: Page, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    from stockade.server.viewer.values import PAGE
    from tests.unit.server.test_viewer_data import lengthen, record

    made: list[str] = []  # recorded on a thread of its own: Playwright's loop runs on this one
    thread = threading.Thread(target=lambda: made.append(record(tmp_path, "scripted-long", ["ok"])))
    thread.start()
    thread.join(60)
    [long] = made
    lengthen(tmp_path / "a.db", long, 2_000)
    ui = Ui(tmp_path / "a.db", tmp_path, tmp_path / "approvals")
    try:
        page.goto(f"{ui.url}/ui/login?key={ui.key}")
        page.goto(f"{ui.url}/ui/runs/{long}")
        expect(page.locator(".entry", has_text="call-1999")).to_be_visible()
        newest = page.locator("li.entry").count()
        assert 0 < newest <= PAGE and page.locator("#later").count() == 0
        first_seq = int(page.locator("li.entry").first.get_attribute("data-seq") or 0)
        page.click("#earlier-link")
        page.wait_for_url("**?before=*")
        earlier = page.locator("li.entry")
        assert int(earlier.last.get_attribute("data-seq") or 0) < first_seq
        expect(page.locator("#later")).to_contain_text("later events")
        page.click("text=first events")
        expect(page.locator(".entry.k-run", has_text="run started")).to_be_visible()
        assert page.locator("#earlier").is_hidden()
        page.click("text=the latest")
        expect(page.locator(".entry", has_text="call-1999")).to_be_visible()
    finally:
        ui.stop()


# -- the service: live, approvals, roles, tenants --------------------------------------------------


def test_a_live_run_updates_by_itself(service: tuple[Server, Tokens], page: Page) -> None:
    from playwright.sync_api import expect

    server, tokens = service
    with Client(server.url, tokens.dev) as client:
        run = client.runs.submit(
            "count slowly",
            scripted=[
                *(run_code(f"import time; time.sleep(1.5); print('tick {n}')") for n in (1, 2, 3, 4)),
                "done",
            ],
        )
        wait_for(lambda: run.refresh().status == "running", what="the run to start", timeout_s=30)
        sign_in(page, server.url, tokens.dev, then=f"/ui/runs/{run.id}")
        expect(page.locator("#run-status")).to_have_text("running")
        page.evaluate("window.__same_page = 42")  # gone if the page were loaded again
        expect(page.locator(".entry.k-tool", has_text="tick 4")).to_be_visible(timeout=WAIT_MS)
        expect(page.locator("#run-status")).to_have_text("success", timeout=WAIT_MS)
        expect(page.locator("#chain")).to_contain_text("verifies", timeout=WAIT_MS)
        assert page.evaluate("window.__same_page") == 42
        # each update brought only what was new: every entry once, in order, each step once
        seqs = [int(s) for s in page.eval_on_selector_all("li.entry", "es => es.map(e => e.dataset.seq)")]
        assert seqs == sorted(set(seqs)) and page.locator(".entry.k-tool", has_text="tick 1").count() == 1
        headings = page.eval_on_selector_all(".step h3", "hs => hs.map(h => h.textContent)")
        assert len(headings) == len(set(headings)), headings
        assert run.wait().status == "success"


def test_approving_with_the_button_sends_the_run_on(service: tuple[Server, Tokens], page: Page) -> None:
    from playwright.sync_api import expect

    server, tokens = service
    tidy = [run_code("mkdir -p build && rm -r build && echo removed-build", "bash"), "tidied"]
    with Client(server.url, tokens.dev) as client, Client(server.url, tokens.watcher) as watcher:
        run = client.runs.submit("tidy up", scripted=tidy)
        own = watcher.runs.submit("tidy up", scripted=tidy)
        assert run.wait().status == "paused" and own.wait().status == "paused"
        own_request = own.refresh().info["pending_approvals"][0]["id"]

        # a role that may not decide sees no buttons on its run, and the API refuses it too;
        # another role's run it does not see at all
        sign_in(page, server.url, tokens.watcher, then=f"/ui/runs/{own.id}")
        expect(page.locator(".pending")).to_contain_text("may not decide")
        assert page.locator("button.approve").count() == 0
        refused = httpx2.post(
            f"{server.url}/v1/runs/{own.id}/approvals/{own_request}",
            json={"decision": "approve"},
            headers={"Authorization": f"Bearer {tokens.watcher}"},
        )
        assert refused.status_code == 403 and "can_approve" in refused.text
        theirs = page.goto(f"{server.url}/ui/runs/{run.id}")
        assert theirs is not None and theirs.status == 404
        page.context.clear_cookies()
        own.kill()

    sign_in(page, server.url, tokens.dev, then=f"/ui/runs/{run.id}")
    expect(page.locator(".pending")).to_contain_text("rm -r build")
    page.click("button.approve")
    expect(page.locator("#run-status")).to_have_text("success", timeout=WAIT_MS)
    expect(page.locator(".entry.k-approval", has_text="approved").first).to_be_visible()
    expect(page.locator(".entry.k-tool", has_text="removed-build")).to_be_visible()
    assert page.locator(".pending").count() == 0


def test_a_paused_runs_page_goes_on_when_it_is_approved_elsewhere(
    service: tuple[Server, Tokens], page: Page
) -> None:
    """The stream of a paused run ends (it no longer polls the database for as long as the run
    waits); the page comes back for it now and then, and so follows a decision made through
    the API."""
    from playwright.sync_api import expect

    server, tokens = service
    with Client(server.url, tokens.dev) as client:
        run = client.runs.submit(
            "tidy up", scripted=[run_code("mkdir -p out && rm -r out && echo removed-out", "bash"), "tidied"]
        )
        assert run.wait().status == "paused"
        sign_in(page, server.url, tokens.dev, then=f"/ui/runs/{run.id}")
        expect(page.locator(".pending")).to_contain_text("rm -r out")
        page.evaluate("window.__same_page = 42")  # gone if the page were loaded again
        run.approve(run.refresh().info["pending_approvals"][0]["id"])
        expect(page.locator("#run-status")).to_have_text("success", timeout=WAIT_MS)
        expect(page.locator(".entry.k-tool", has_text="removed-out")).to_be_visible()
        assert page.evaluate("window.__same_page") == 42


def test_another_tenant_sees_no_such_run(service: tuple[Server, Tokens], page: Page) -> None:
    from playwright.sync_api import expect

    server, tokens = service
    with Client(server.url, tokens.dev) as client:
        run = client.runs.submit("a run of acme", scripted=["nothing to do"])
        run.wait()
    # An API token is pasted, never taken from a link: a URL put it in the access log, and
    # another site's link could sign a browser in to a tenant of its choosing.
    linked = page.request.get(f"{server.url}/ui/login?key={tokens.other}", max_redirects=0)
    assert linked.status == 200 and "set-cookie" not in linked.headers
    sign_in(page, server.url, tokens.other)
    expect(page.locator("main")).not_to_contain_text(run.id[:16])
    response = page.goto(f"{server.url}/ui/runs/{run.id}")
    assert response is not None and response.status == 404
    expect(page.locator("h1")).to_contain_text("No run")


# -- a laptop: an MCP session waits, the local viewer's button lets it go on ----------------------


def test_approving_in_stockade_ui_lets_a_waiting_mcp_session_go_on(page: Page, tmp_path: Path) -> None:
    from mcp import Client, StdioServerParameters
    from playwright.sync_api import expect

    require_tier("process")
    (tmp_path / "policy.toml").write_text(MCP_POLICY)
    db = tmp_path / "audit.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "stockade.cli.main", "mcp", "--policy", str(tmp_path / "policy.toml"), "--audit-db",
              f"sqlite:///{db}"],
        env=env, cwd=str(tmp_path),
    )  # fmt: skip
    outcome: list[str] = []

    async def session() -> None:
        async with Client(params, read_timeout_seconds=120) as client:
            result = await client.call_tool(
                "run_code", {"code": "mkdir b && rm -r b && echo let-go", "language": "bash"}
            )
            block = result.content[0]
            outcome.append(block.text if isinstance(block, types.TextContent) else repr(block))

    thread = threading.Thread(target=asyncio.run, args=(session(),))
    thread.start()
    try:
        approval_dir = Path(os.environ["STOCKADE_APPROVAL_DIR"])  # where `stockade mcp` keeps them
        pending = wait_for(
            ApprovalStore(approval_dir).pending, what="the MCP call to wait for approval", timeout_s=60
        )
        run_id = pending[0]["run_id"]
        ui = Ui(db, tmp_path, approval_dir)
        try:
            page.goto(f"{ui.url}/ui/login?key={ui.key}")
            page.goto(f"{ui.url}/ui/runs/{run_id}")
            expect(page.locator(".pending")).to_contain_text("rm -r b")
            page.click("button.approve")
            expect(page.locator(".entry.k-tool", has_text="let-go")).to_be_visible(timeout=WAIT_MS)
        finally:
            ui.stop()
    finally:
        thread.join(60)
    assert outcome and "let-go" in outcome[0], outcome
