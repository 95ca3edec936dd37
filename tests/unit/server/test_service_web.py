"""The service's face to browsers and to followers of runs, through the real application
(``create_app``) under uvicorn on 127.0.0.1 in a thread, on a real SQLite database: the
interactive docs (a CDN's scripts on the viewer's origin) only when asked for; the event
streams (the API's and the viewer's) ending when their run pauses, and held by a tenant a few
at a time, given back when they end or their client goes; the viewer's ``after`` bounded; the
viewer's cookie a signed session, never the API token."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
import uvicorn
from typer.testing import CliRunner

from stockade.cli.main import app
from stockade.exceptions import AuthenticationError
from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Tenant, Tenants, new_token
from stockade.server.viewer.sessions import Sessions
from tests.conftest import wait_for
from tests.unit.server.test_run_controls import Recorded

STREAMS = 2  # each tenant's event streams at once, here


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


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serving(tmp_path, max_streams=STREAMS) as found:
        yield found


def add_run(served: Served, run_id: str, status: str, tenant: str = "acme") -> str:
    store = served.service.store
    assert store.add_run(
        run_id=run_id, tenant=tenant, role=None, spec={"task": "t"}, labels={}, max_active=99
    )
    if status != "queued":
        assert store.set_status(run_id, status)
    return run_id


def api(served: Served, token: str) -> httpx2.Client:
    return httpx2.Client(base_url=served.url, timeout=10, headers={"Authorization": f"Bearer {token}"})


def viewer(served: Served, token: str) -> httpx2.Client:
    """A browser signed in to the viewer with ``token``, through its form."""
    same_site = {"Sec-Fetch-Site": "same-origin"}
    with httpx2.Client(base_url=served.url, timeout=10, headers=same_site) as form:
        signed = form.post("/ui/login", data={"token": token})
        assert signed.status_code == 303 and form.cookies.get("stockade_viewer"), signed.text
        cookies = {"stockade_viewer": form.cookies["stockade_viewer"]}
    return httpx2.Client(
        base_url=served.url, timeout=10, cookies=cookies, headers={"Sec-Fetch-Site": "same-origin"}
    )


def events(response: httpx2.Response) -> list[tuple[str, str]]:
    """(event, data) of a whole stream: it has to end for this to return."""
    found, kind = [], ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            found.append((kind, line.removeprefix("data: ")))
    return found


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


# -- the viewer's session --------------------------------------------------------------------------


def test_the_viewers_cookie_holds_a_session_never_the_api_token(served: Served) -> None:
    """The cookie held the API token itself: one copied off a shared machine reached the
    whole API for as long as the token lived. It holds a signed session now."""
    add_run(served, "acme-done", "success")
    with viewer(served, served.acme) as browser:
        cookie = browser.cookies["stockade_viewer"]
        assert served.acme not in cookie and served.acme.split("_")[-1] not in cookie
        assert "acme-done" in browser.get("/ui/").text
    with api(served, cookie) as copied:  # the cookie is no API token
        assert copied.get("/v1/runs").status_code == 401


def test_every_window_of_another_tenants_run_is_no_run(served: Served) -> None:
    """A run's page reads one window of its trail (``?before=``, ``?after=``, a live page's
    ``body?after=&step=``): each asks whose run it is first."""
    mine, theirs = add_run(served, "acme-queued", "queued"), add_run(served, "other-run", "success", "other")
    windows = ("", "?before=5", "?after=0", "/body", "/body?after=0&step=1", "/body?after=3&verified=1")
    with viewer(served, served.acme) as browser:
        for window in windows:
            assert browser.get(f"/ui/runs/{theirs}{window}").status_code == 404, window
            page = browser.get(f"/ui/runs/{mine}{window}")
            assert page.status_code == 200 and "other-run" not in page.text, window
        assert "Nothing recorded yet" in browser.get(f"/ui/runs/{mine}").text
        assert browser.get(f"/ui/runs/{mine}", params={"before": 0}).status_code == 422


def test_signing_out_ends_the_session_for_every_copy_of_the_cookie(served: Served) -> None:
    with viewer(served, served.acme) as browser:
        cookie = browser.cookies["stockade_viewer"]
        assert browser.post("/ui/logout").status_code == 303
    copy = httpx2.Client(base_url=served.url, timeout=10, cookies={"stockade_viewer": cookie})
    with copy:
        assert copy.get("/ui/").headers["location"].startswith("/ui/login")


def test_a_session_holds_only_while_its_token_does_and_is_every_processs(tmp_path: Path) -> None:
    token, record = new_token("acme")
    tenants = Tenants(tenants={"acme": Tenant(id="acme")}, tokens={record.id: record})
    database = f"sqlite:///{tmp_path / 'service.db'}"
    sessions = Sessions(tenants, ServiceStore(open_database(database)))
    cookie = sessions.start(token)
    # another API process on the same database checks it with the same key
    assert (
        Sessions(tenants, ServiceStore(open_database(database))).check(cookie).principal.tenant.id == "acme"
    )

    head, mac = cookie.rsplit(".", 1)
    longer = head.split(".")
    longer[2] = str(int(longer[2]) + 3600)  # a holder giving itself more time
    for forged in (f"{head}.{'0' * 64}", ".".join(longer) + f".{mac}", token, ""):
        with pytest.raises(AuthenticationError):
            sessions.check(forged)
    revoked = Tenants(tenants={"acme": Tenant(id="acme")}, tokens={})
    rotated_token, rotated = new_token("acme")
    renewed = Tenants(tenants=tenants.tenants, tokens={record.id: dataclasses.replace(rotated, id=record.id)})
    for changed in (revoked, renewed):  # the token taken out of the tenants file, or given a new secret
        with pytest.raises(AuthenticationError):
            Sessions(changed, ServiceStore(open_database(database))).check(cookie)
    with pytest.raises(AuthenticationError):
        sessions.start(rotated_token)  # not a token of this service's file


# -- the viewer's stream ---------------------------------------------------------------------------


def test_the_viewers_stream_ends_when_its_run_pauses(served: Served) -> None:
    """A paused run may wait for days: its stream no longer polls the database meanwhile (the
    page comes back for it now and then); a finished run's ends as before."""
    paused = add_run(served, "acme-paused", "paused")
    done = add_run(served, "acme-done", "success")
    with viewer(served, served.acme) as c:
        with c.stream("GET", f"/ui/runs/{paused}/events") as stream:
            got = events(stream)
        assert [kind for kind, _ in got] == ["changed", "end"]
        assert json.loads(got[-1][1]) == {"seq": 0, "status": "paused", "waits": True}
        # the page says where it is: nothing new, so only the end
        with c.stream("GET", f"/ui/runs/{paused}/events", params={"status": "paused"}) as stream:
            assert [kind for kind, _ in events(stream)] == ["end"]
        with c.stream("GET", f"/ui/runs/{done}/events") as stream:
            ended = events(stream)
        assert json.loads(ended[-1][1])["waits"] is False
    wait_for(lambda: served.service.streams.held("acme") == 0, what="the ended streams given back")


def test_the_viewers_after_is_bounded_like_the_apis(served: Served) -> None:
    run = add_run(served, "acme-r", "success")
    with viewer(served, served.acme) as c:
        for after in ("99999999999999999999999", "-1", str(2**62 + 1)):
            refused = c.get(f"/ui/runs/{run}/events", params={"after": after})
            assert refused.status_code == 422, (after, refused.text)
        with c.stream("GET", f"/ui/runs/{run}/events", params={"after": str(2**62)}) as stream:
            assert [kind for kind, _ in events(stream)] == ["changed", "end"]


# -- streams held at once --------------------------------------------------------------------------


def test_a_tenant_holds_a_few_streams_at_once_and_gets_them_back(served: Served) -> None:
    """Each open stream polls the database: one tenant's thousands of them slowed everyone's
    requests. The API's and the viewer's count together; one more is answered 429."""
    running = [add_run(served, f"acme-{n}", "running") for n in range(3)]
    theirs = add_run(served, "other-1", "running", tenant="other")
    with contextlib.ExitStack() as held, api(served, served.acme) as c, viewer(served, served.acme) as ui:
        first = held.enter_context(c.stream("GET", f"/v1/runs/{running[0]}/events"))
        held.enter_context(ui.stream("GET", f"/ui/runs/{running[1]}/events"))
        assert first.status_code == 200
        wait_for(lambda: served.service.streams.held("acme") == STREAMS, what="acme's two streams")

        refused = c.get(f"/v1/runs/{running[2]}/events")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"] == "RateLimited" and "event streams open" in refused.json()["detail"]
        on_page = ui.get(f"/ui/runs/{running[2]}/events")
        assert on_page.status_code == 429 and on_page.headers["retry-after"] == "5"
        with api(served, served.other) as them, them.stream("GET", f"/v1/runs/{theirs}/events") as stream:
            assert stream.status_code == 200  # another tenant's are its own

        first.close()  # the client goes: its stream is given back
        wait_for(lambda: served.service.streams.held("acme") == 1, what="the closed stream given back")
        with c.stream("GET", f"/v1/runs/{running[2]}/events") as again:
            assert again.status_code == 200

        # a stream that ends by itself gives its slot back too
        served.service.store.set_status(running[1], "paused")
        wait_for(lambda: served.service.streams.held("acme") == 0, what="the paused run's stream to end")
