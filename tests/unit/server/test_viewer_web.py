"""The run viewer's pages in process (uvicorn on 127.0.0.1 in a thread, runs recorded over the
shipped fakes): sign-in and its cookie, the list, a run's page and body with untrusted text
escaped under the CSP, the event stream, decisions with their CSRF token, static files."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import uvicorn

from stockade.models import tool_call
from stockade.policy.approval import ApprovalStore
from stockade.server.viewer.data import LocalRuns
from stockade.server.viewer.forms import csrf_token
from stockade.server.viewer.rendering import diff_class, diff_lines
from stockade.server.viewer.values import PAGE
from stockade.server.viewer.web import local_app
from tests.conftest import wait_for
from tests.unit.server.test_viewer_data import LONG, lengthen, record

XSS = "<script>alert(1)</script>"
KEY = "a-key-for-the-tests"


@pytest.fixture(scope="module")
def viewer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str, Path]]:
    folder = tmp_path_factory.mktemp("web")
    done = record(folder, "scripted-busy", [tool_call("write_file", {"path": "x.html", "content": XSS}), XSS])
    paused = record(
        folder, "scripted-careful", [tool_call("run_code", {"code": "rm -r x", "language": "bash"})]
    )
    source = LocalRuns(f"sqlite:///{folder / 'a.db'}", approvals=folder / "approvals")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(local_app(source, KEY), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: server.started, what="the viewer to start", timeout_s=10)
    try:
        yield url, done, paused, folder
    finally:
        server.should_exit = True
        thread.join(10)
        source.close()


def client(url: str) -> httpx2.Client:
    return httpx2.Client(base_url=url, timeout=10, cookies={"stockade_viewer": KEY})


def test_sign_in(viewer: tuple[str, str, str, Path]) -> None:
    url, done, _, _ = viewer
    with httpx2.Client(base_url=url, timeout=10) as anonymous:
        assert anonymous.get("/").headers["location"] == "/ui/"
        assert anonymous.get("/ui/").headers["location"].startswith("/ui/login")
        form = anonymous.get("/ui/login")
        assert form.status_code == 200 and "Sign in" in form.text and form.headers["content-security-policy"]
        assert anonymous.get("/ui/login", params={"key": "wrong"}).status_code == 401
        assert anonymous.post("/ui/login", data={"token": "wrong"}).status_code == 401
        signed = anonymous.get("/ui/login", params={"key": KEY, "next": f"/ui/runs/{done}"})
        assert signed.status_code == 303 and signed.headers["location"] == f"/ui/runs/{done}"
        assert "httponly" in signed.headers["set-cookie"].lower()
        out = anonymous.post("/ui/logout")
        assert out.status_code == 303 and 'stockade_viewer=""' in out.headers["set-cookie"]


def test_another_sites_form_cannot_sign_a_browser_in_or_out(viewer: tuple[str, str, str, Path]) -> None:
    """Login CSRF: a page elsewhere posts its own token to /ui/login; the browser would then
    show, and approve in, the tenant of that site's choosing."""
    url, _, _, _ = viewer
    host = url.removeprefix("http://")
    crossings = (
        {"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"},
        {"Sec-Fetch-Site": "same-site", "Origin": f"http://other.{host}"},
        {"Origin": "http://evil.example"},  # a browser that sends only Origin
        {"Origin": "null"},  # a sandboxed frame
    )
    with httpx2.Client(base_url=url, timeout=10) as browser:
        for headers in crossings:
            refused = browser.post("/ui/login", data={"token": KEY}, headers=headers)
            assert refused.status_code == 403 and "set-cookie" not in refused.headers, headers
            assert browser.post("/ui/logout", headers=headers).status_code == 403
        for headers in ({"Sec-Fetch-Site": "same-origin", "Origin": url}, {"Origin": url}, {}):
            signed = browser.post("/ui/login", data={"token": KEY}, headers=headers)
            assert signed.status_code == 303 and "stockade_viewer=" in signed.headers["set-cookie"], headers


def test_pages_escape_and_forbid_scripts(viewer: tuple[str, str, str, Path]) -> None:
    url, done, paused, _ = viewer
    with client(url) as c:
        listing = c.get("/ui/", params={"status": "success"})
        assert done[:16] in listing.text and paused[:16] not in listing.text
        assert c.get("/ui/", params={"until": "nonsense"}).status_code == 400
        page = c.get(f"/ui/runs/{done}")
        assert XSS not in page.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
        body = c.get(f"/ui/runs/{done}/body", params={"verified": 1})
        assert "✓ verifies" in body.text and XSS not in body.text
        assert c.get("/ui/runs/nothing").status_code == 404
        assert c.get("/ui/runs/nothing/body").status_code == 404
        assert c.get("/ui/static/viewer.js").headers["content-type"].startswith("text/javascript")
        assert c.get("/ui/static/icon.svg").status_code == 200
        assert c.get("/ui/static/other.js").status_code == 404
        with c.stream("GET", f"/ui/runs/{done}/events") as events:
            lines = [line for line in events.iter_lines() if line.startswith("event:")]
        assert lines == ["event: changed", "event: end"]
        with c.stream("GET", "/ui/runs/nothing/events") as events:
            assert [line for line in events.iter_lines() if line.startswith("event:")] == ["event: end"]


def test_the_frameworks_own_answers_under_ui_carry_the_viewers_headers(
    viewer: tuple[str, str, str, Path],
) -> None:
    """A path no route has (404), a method none takes (405), a query that does not parse (422):
    FastAPI's own answers, which carried none of the viewer's headers."""
    url, _, _, _ = viewer
    with client(url) as c:
        for answer in (c.get("/ui/no/such/page"), c.put("/ui/"), c.get("/ui/", params={"limit": "many"})):
            assert answer.status_code in (404, 405, 422), answer
            assert answer.headers["content-security-policy"].startswith("default-src 'none'"), answer
            assert answer.headers["x-content-type-options"] == "nosniff"
            assert answer.headers["x-frame-options"] == "DENY"
        assert c.get("/").headers.get("x-frame-options") == "DENY"  # its own, as before


def test_a_decision_needs_its_form_token(viewer: tuple[str, str, str, Path]) -> None:
    url, _, paused, folder = viewer
    with client(url) as c:
        page = c.get(f"/ui/runs/{paused}")
        assert "Approve" in page.text and 'data-live="1"' in page.text
        request_id = ApprovalStore(folder / "approvals").pending(paused)[0]["id"]
        target = f"/ui/runs/{paused}/approvals/{request_id}"
        assert c.post(target, data={"decision": "approve", "csrf": "forged"}).status_code == 403
        assert c.post(target, data={"decision": "maybe", "csrf": csrf_token(KEY)}).status_code == 400
        missing = c.post(
            f"/ui/runs/{paused}/approvals/nope", data={"decision": "deny", "csrf": csrf_token(KEY)}
        )
        assert missing.status_code == 400
        done = c.post(target, data={"decision": "deny", "csrf": csrf_token(KEY)})
        assert done.status_code == 303 and done.headers["location"] == f"/ui/runs/{paused}"
    assert ApprovalStore(folder / "approvals").pending(paused) == []


def test_sign_in_goes_on_only_to_a_plain_path_of_the_viewer(viewer: tuple[str, str, str, Path]) -> None:
    """``next`` becomes a Location header as is: a character outside ASCII failed its encoding
    (500), a CR LF broke the response (the connection dropped)."""
    url, done, _, _ = viewer
    elsewhere = (
        "/ui/€", "/ui/runs/\r\nSet-Cookie: planted=1", "/ui/\x00", "/ui/\\evil.example", "//evil.example/",
        "https://evil.example/ui/", "/elsewhere", "/ui/ x",
    )  # fmt: skip
    with httpx2.Client(base_url=url, timeout=10) as browser:
        for target in elsewhere:
            posted = browser.post("/ui/login", data={"token": KEY, "next": target})
            assert posted.status_code == 303 and posted.headers["location"] == "/ui/", target
            linked = browser.get("/ui/login", params={"key": KEY, "next": target})
            assert linked.status_code == 303 and linked.headers["location"] == "/ui/", target
            assert "planted" not in posted.headers.get("set-cookie", "")
        kept = browser.post("/ui/login", data={"token": KEY, "next": f"/ui/runs/{done}?x=1"})
        assert kept.headers["location"] == f"/ui/runs/{done}?x=1"


async def test_the_cookie_is_secure_when_the_request_came_over_https(
    viewer: tuple[str, str, str, Path],
) -> None:
    _, _, _, folder = viewer
    source = LocalRuns(f"sqlite:///{folder / 'a.db'}", approvals=folder / "approvals")
    transport = httpx2.ASGITransport(app=local_app(source, KEY))
    try:
        for scheme, secure in (("https", True), ("http", False)):
            async with httpx2.AsyncClient(
                transport=transport, base_url=f"{scheme}://viewer.example"
            ) as browser:
                signed = await browser.post("/ui/login", data={"token": KEY})
                cookie = signed.headers["set-cookie"].lower()
                assert signed.status_code == 303 and ("; secure" in cookie) is secure, cookie
    finally:
        source.close()


def test_an_after_past_any_sequence_number_is_refused(viewer: tuple[str, str, str, Path]) -> None:
    url, done, _, _ = viewer
    with client(url) as c:
        refused = c.get(f"/ui/runs/{done}/events", params={"after": "99999999999999999999999"})
        assert refused.status_code == 422


async def test_an_approval_card_shows_bidi_and_invisible_characters_as_escapes(tmp_path: Path) -> None:
    """A run asked to run `echo "clean the build folder<RLO><LRI>"<PDI><LRI> ; rm -r src ; true
    <PDI><PDF>`: the card drew `rm -r src` as if it were inside the echoed string, the human
    approved, and src was gone. Every untrusted text on the page (the card, the timeline, the
    task, the model's name) now shows those characters as escapes."""
    rlo, lri, pdi, pdf = "\u202e", "\u2066", "\u2069", "\u202c"
    code = (
        f'mkdir -p src build; echo "clean the build folder{rlo}{lri}"{pdi}{lri} ; rm -r src ; true {pdi}{pdf}'
    )
    turns: list[object] = [tool_call("run_code", {"code": code, "language": "bash"})]
    paused = await asyncio.to_thread(record, tmp_path, "scripted-\u200bquiet", turns)
    book = ApprovalStore(tmp_path / "approvals")
    [request] = book.pending(paused)
    source = LocalRuns(f"sqlite:///{tmp_path / 'a.db'}", approvals=tmp_path / "approvals")
    transport = httpx2.ASGITransport(app=local_app(source, KEY))
    try:
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://viewer.example", cookies={"stockade_viewer": KEY}
        ) as browser:
            page = (await browser.get(f"/ui/runs/{paused}")).text
            listing = (await browser.get("/ui/")).text
    finally:
        source.close()
    card = page[page.index('<section class="card pending">') : page.index('<section class="timeline">')]
    assert "\\u202e\\u2066&#34;\\u2069\\u2066 ; rm -r src ; true \\u2069\\u202c" in card
    for shown in (page, listing):
        assert not set(shown) & {rlo, lri, pdi, pdf, "\u200b"}
    assert "scripted-\\u200bquiet" in page and "scripted-\\u200bquiet" in listing
    # the book holds the same escaped words the card shows (the API and the CLI list them)
    assert rlo not in request["action"] and "\\u202e" in request["action"]


def test_a_diffs_lines_end_at_newlines_alone() -> None:
    """A changed line that holds a form feed, a vertical tab or U+2028 stays one line of the
    diff, classed by its own first character: ``str.splitlines`` made the rest of it a line
    of its own, drawn as removed when it began with ``-``."""
    diff = "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-old\n+new\x0c-not removed\x0b+\u2028-either\n"
    lines = diff_lines(diff)
    assert [diff_class(line) for line in lines] == ["file", "file", "hunk", "del", "add"]
    assert lines[-1] == "+new\x0c-not removed\x0b+\u2028-either"
    assert diff_lines("") == [] and diff_lines("+a") == ["+a"]


async def test_a_long_runs_page_is_one_window_and_a_live_update_only_whats_new(tmp_path: Path) -> None:
    """A run of thousands of audit events: its page held every entry (at 2,475 ~1 MiB, 0.8-1.7 s to
    render) and each live update fetched and rendered the whole body again (two open tabs: ~6 s
    a render, another tenant's API calls 2.5 times slower). Now a page is the newest PAGE
    events with links back to the first; an update is what came after the last it shows."""
    done = await asyncio.to_thread(record, tmp_path, "scripted-long", ["ok"])
    db = tmp_path / "a.db"
    await asyncio.to_thread(lengthen, db, done, LONG)
    source = LocalRuns(f"sqlite:///{db}", approvals=tmp_path / "approvals")
    transport = httpx2.ASGITransport(app=local_app(source, KEY))
    seq = re.compile(r'data-seq="(\d+)"')
    try:
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://viewer.example", cookies={"stockade_viewer": KEY}
        ) as browser:
            page = await browser.get(f"/ui/runs/{done}")
            assert page.status_code == 200 and len(page.content) < 200_000
            shown = [int(s) for s in seq.findall(page.text)]
            assert (
                0 < len(shown) <= PAGE
                and f"call-{LONG - 1}" in page.text
                and f"call-{LONG - PAGE}" not in page.text
            )
            # back through the earlier pages to the run's first event
            link = re.compile(r'id="earlier-link" href="([^"]+)"')
            pages, here = 1, page.text
            while 'id="earlier" hidden' not in here:
                found = link.search(here)
                assert found is not None
                earlier = await browser.get(found.group(1).replace("&amp;", "&"))
                here = earlier.text
                assert earlier.status_code == 200 and len(earlier.content) < 200_000
                assert "later events →" in here and 'data-live="1"' not in here
                pages += 1
            assert "run started" in here and 'data-seq="1"' in here and pages >= 2 * LONG // PAGE
            assert (await browser.get(f"/ui/runs/{done}", params={"after": 0})).text.count("run started") == 1
            # a live update after the last event shown: the new entries alone
            after, step = max(shown), re.findall(r'data-step="(\d+)"', page.text)[-1]
            query = {"after": after, "step": step}
            assert not seq.findall((await browser.get(f"/ui/runs/{done}/body", params=query)).text)
            await asyncio.to_thread(lengthen, db, done, 2, start=LONG)
            update = await browser.get(f"/ui/runs/{done}/body", params=query)
            assert update.status_code == 200 and len(seq.findall(update.text)) == 2
            assert f"call-{LONG}" in update.text and f"call-{LONG - 1}" not in update.text
            assert 'id="delta-head"' in update.text and "run-status" in update.text
            assert update.headers["content-security-policy"].startswith("default-src 'none'")
    finally:
        source.close()
