"""A running ``stockade serve`` follows its tenants file: a token taken out of it is refused
(and its viewer sessions end) within a couple of seconds, without a restart; a changed limit
holds for the next request; and a file that no longer loads keeps the table that did."""

from __future__ import annotations

import io
import json
import re
import signal
import tarfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest

from stockade import exceptions as exc
from stockade.client import Client
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import Server, Tokens, write_tenants

# the service looks at the file at most once a second: refused within two, with room for a busy host
FOLLOWED_S = 3.0


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Server, Tokens, Path]]:
    tenants, tokens = write_tenants(tmp_path)
    server = Server(tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path)
    try:
        yield server, tokens, tenants
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


def status(server: Server, token: str) -> int:
    headers = {"Authorization": f"Bearer {token}"}
    return httpx2.get(server.url + "/v1/sandboxes", headers=headers, timeout=10).status_code


def without_tenant_tokens(text: str, tenant: str) -> str:
    """The file's text with the ``[[tokens]]`` records of ``tenant`` taken out."""
    records = re.split(r"\n(?=\[\[tokens\]\])", text)
    return "\n".join(r for r in records if f'tenant = "{tenant}"' not in r)


def with_tenant_role(text: str, tenant: str, role: str) -> str:
    """The file's text with the ``[[tokens]]`` records of ``tenant`` given ``role``."""
    records = re.split(r"\n(?=\[\[tokens\]\])", text)
    changed = [re.sub(r'role = "[^"]*"', f'role = "{role}"', r) if f'tenant = "{tenant}"' in r else r
               for r in records]  # fmt: skip
    assert changed != records
    return "\n".join(changed)


# What ends a token's standing: the token taken out, or its role changed (dev to viewer: a
# role's sandboxes, runs and data classes are its own; a stream opened as dev read on as
# dev, 15 s after, and its final result line carried the whole output: found from outside),
# with what the SDK raises for a stream so cut.
CHANGES: dict[str, tuple[Callable[[str], str], str]] = {
    "taken out": (lambda text: without_tenant_tokens(text, "other"), "not one this service knows"),
    "role changed": (
        lambda text: with_tenant_role(text, "other", "viewer"),
        "no longer stands for tenant 'other' under role 'dev'",
    ),
}


def signed_in(server: Server, token: str) -> httpx2.Client:
    """A browser signed in to the viewer with ``token``."""
    same_site = {"Sec-Fetch-Site": "same-origin"}
    with httpx2.Client(base_url=server.url, timeout=10, headers=same_site) as form:
        signed = form.post("/ui/login", data={"token": token})
        assert signed.status_code == 303 and form.cookies.get("stockade_viewer"), signed.text
        cookies = {"stockade_viewer": form.cookies["stockade_viewer"]}
    return httpx2.Client(base_url=server.url, timeout=10, cookies=cookies, headers=same_site)


def test_a_token_taken_out_of_the_tenants_file_is_refused_and_its_sessions_end(
    service: tuple[Server, Tokens, Path],
) -> None:
    server, tokens, tenants = service
    assert status(server, tokens.other) == 200
    with signed_in(server, tokens.other) as browser:
        assert browser.get("/ui/").status_code == 200

        tenants.write_text(without_tenant_tokens(tenants.read_text(), "other"))  # in place, no restart

        wait_for(lambda: status(server, tokens.other) == 401, what="the removed token to be refused",
                 timeout_s=FOLLOWED_S)  # fmt: skip
        ended = browser.get("/ui/")  # its viewer session ended with it
        assert ended.status_code == 303 and ended.headers["location"].startswith("/ui/login")
    assert status(server, tokens.acme) == 200  # the others' tokens are untouched
    assert "tokens refused from now on" in server.output()


def events(stream: httpx2.Response) -> list[tuple[str, str]]:
    """The (event, data) pairs of a Server-Sent Events response, read until it closes."""
    found, kind = [], ""
    for line in stream.iter_lines():
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            found.append((kind, line[5:].strip()))
    return found


@pytest.mark.parametrize("change", CHANGES)
def test_a_token_taken_out_or_given_another_role_ends_the_streams_it_opened(
    service: tuple[Server, Tokens, Path], change: str
) -> None:
    require_tier("process")
    server, tokens, tenants = service
    good = tenants.read_text()
    changed, message = CHANGES[change]
    auth = {"Authorization": f"Bearer {tokens.other}"}
    sleep = {"name": "run_code", "args": {"code": "import time; time.sleep(60)", "language": "python"}}
    with (
        httpx2.Client(base_url=server.url, timeout=10, headers=auth) as api,
        signed_in(server, tokens.other) as ui,
        Client(server.url, tokens.other) as sdk,
    ):
        run_id = api.post("/v1/runs", json={"task": "sleep", "scripted": [sleep, "never"]}).json()["run_id"]
        wait_for(lambda: api.get(f"/v1/runs/{run_id}").json()["status"] == "running", what="the run to start",
                 timeout_s=30, interval_s=0.1)  # fmt: skip
        # both open before the token goes; the run sleeps a minute: only the check ends them
        with api.stream("GET", f"/v1/runs/{run_id}/events") as through_api, \
                ui.stream("GET", f"/ui/runs/{run_id}/events") as through_ui:  # fmt: skip
            assert through_api.status_code == 200 and through_ui.status_code == 200
            watched = sdk.runs.get(run_id).events()
            assert next(watched).kind  # the SDK's stream is open too
            tenants.write_text(changed(good))
            started = time.monotonic()
            sent, shown = events(through_api), events(through_ui)
            took = time.monotonic() - started
        assert took < FOLLOWED_S + 5, took
        kind, data = sent[-1]
        assert kind == "error", sent
        problem = json.loads(data)
        assert problem["status"] == 401 and problem["error"] == "AuthenticationError", problem
        assert ("status", json.dumps({"run_id": run_id, "status": "running"})) in sent  # it was open, reading
        kind, data = shown[-1]
        assert kind == "end" and json.loads(data)["signed_out"] is True, shown
        with pytest.raises(exc.AuthenticationError, match=message):
            list(watched)  # the SDK raises what the cut stream says, not a quiet end

        tenants.write_text(good)  # back, to stop the run
        wait_for(lambda: api.get(f"/v1/runs/{run_id}").status_code == 200, what="the token back",
                 timeout_s=FOLLOWED_S)  # fmt: skip
        assert api.post(f"/v1/runs/{run_id}/kill", json={"reason": "done"}).status_code == 200
        wait_for(lambda: api.get(f"/v1/runs/{run_id}").json()["status"] == "killed", what="the run killed",
                 timeout_s=30, interval_s=0.1)  # fmt: skip


@pytest.mark.parametrize("change", CHANGES)
def test_a_token_taken_out_or_given_another_role_ends_its_streamed_commands_and_gets_no_late_result(
    service: tuple[Server, Tokens, Path], change: str
) -> None:
    """A command's output streamed to a token reads no further once the token is taken out
    or given another role, printing or silent; a call that was running gets a 401, not its
    result. The sandboxes are the tenant's role's: back with the token, they still work."""
    require_tier("process")
    server, tokens, tenants = service
    good = tenants.read_text()
    changed, message = CHANGES[change]
    auth = {"Authorization": f"Bearer {tokens.other}"}
    with httpx2.Client(base_url=server.url, timeout=30, headers=auth) as api, ThreadPoolExecutor(1) as pool:
        ids = []
        for _ in range(3):  # one call at a time a sandbox
            made = api.post("/v1/sandboxes", json={"tier": "process"})
            assert made.status_code in (200, 201), made.text
            ids.append(made.json()["id"])
        code = "import time\nfor i in range(600):\n    print('line', i, flush=True)\n    time.sleep(0.1)"
        printing = {"code": code, "stream": True, "timeout_s": 120}
        silent = {"cmd": "sleep 60", "stream": True, "timeout_s": 120}
        late = pool.submit(
            api.post, f"/v1/sandboxes/{ids[2]}/commands", json={"cmd": "sleep 4", "timeout_s": 60}
        )
        with api.stream("POST", f"/v1/sandboxes/{ids[0]}/code", json=printing) as out, \
                api.stream("POST", f"/v1/sandboxes/{ids[1]}/commands", json=silent) as quiet:  # fmt: skip
            assert out.status_code == 200 and quiet.status_code == 200
            lines = out.iter_lines()
            first = json.loads(next(lines))
            assert first["type"] == "stdout", first  # open, and reading
            tenants.write_text(changed(good))
            started = time.monotonic()
            printed = [json.loads(line) for line in lines]
            said = [json.loads(line) for line in quiet.iter_lines()]
            took = time.monotonic() - started
        assert took < FOLLOWED_S + 5, took
        for stream in (printed, said):
            assert stream[-1]["type"] == "error", stream[-3:]
            assert stream[-1]["problem"]["error"] == "AuthenticationError", stream[-1]
            assert message in stream[-1]["problem"]["detail"], stream[-1]
            assert not any(said["type"] == "result" for said in stream), stream[-3:]
        assert len(printed) < 100, len(printed)  # not the 600 lines of its whole minute
        refused = late.result(timeout=60)
        assert refused.status_code == 401 and "stdout" not in refused.text, refused.text

        tenants.write_text(good)
        wait_for(lambda: api.get(f"/v1/sandboxes/{ids[2]}").status_code == 200, what="the token back",
                 timeout_s=FOLLOWED_S)  # fmt: skip
        again = api.post(f"/v1/sandboxes/{ids[2]}/commands", json={"cmd": "echo still", "timeout_s": 60})
        assert again.status_code == 200 and again.json()["stdout"] == "still\n", again.text
        for sid in ids:  # the two cut calls run on in theirs: closing ends them
            assert api.delete(f"/v1/sandboxes/{sid}").status_code in (200, 204)


def test_a_changed_limit_holds_for_the_next_requests(service: tuple[Server, Tokens, Path]) -> None:
    server, tokens, tenants = service
    assert all(status(server, tokens.other) == 200 for _ in range(3))
    text = tenants.read_text().replace("[tenants.other]\n", "[tenants.other]\nrate_per_minute = 1\n")
    tenants.write_text(text)
    # one call a minute now: the first after the change passes, the next is refused
    wait_for(lambda: status(server, tokens.other) == 429, what="other's new rate limit", timeout_s=FOLLOWED_S)
    assert status(server, tokens.acme) == 200


def test_a_tenants_file_that_no_longer_loads_keeps_the_last_table(
    service: tuple[Server, Tokens, Path],
) -> None:
    server, tokens, tenants = service
    good = tenants.read_text()
    removed = without_tenant_tokens(good, "other")
    tenants.write_text(removed)
    wait_for(lambda: status(server, tokens.other) == 401, what="the removed token to be refused",
             timeout_s=FOLLOWED_S)  # fmt: skip

    # a broken edit that would bring "other" back, and an emptied file (no tenants left, as a
    # file being written in place may be): neither loads
    for broken in (good + "\n[tenants.acme\n", ""):
        logged = server.output().count("does not load")
        tenants.write_text(broken)

        def looked(count: int = logged) -> bool:  # the file is looked at on a request's way
            return status(server, tokens.acme) == 200 and server.output().count("does not load") > count

        wait_for(looked, what=lambda: f"the broken file to be logged: {server.output()[-2000:]}",
                 timeout_s=FOLLOWED_S)  # fmt: skip
        assert status(server, tokens.acme) == 200  # the last table that loaded: acme still in,
        assert status(server, tokens.other) == 401  # other still out

    logged = server.output().count("does not load")
    server.proc.send_signal(signal.SIGHUP)  # load it now, changed or not: the server lives on
    wait_for(lambda: status(server, tokens.acme) == 200 and server.output().count("does not load") > logged,
             what="SIGHUP to load the file again", timeout_s=FOLLOWED_S)  # fmt: skip

    tenants.write_text(good)  # fixed: loaded again
    wait_for(lambda: status(server, tokens.other) == 200, what="the fixed file to be loaded",
             timeout_s=FOLLOWED_S)  # fmt: skip


def test_an_upload_whose_token_is_taken_out_before_its_body_ends_is_refused(
    service: tuple[Server, Tokens, Path],
) -> None:
    # The token is asked at the head, and again once the body has come: an upload takes as
    # long as its sender makes it (a workspace sent slowly landed 3 s after its token was
    # refused everywhere else: found from outside).
    server, tokens, tenants = service
    good = tenants.read_text()
    folder = io.BytesIO()
    with tarfile.open(fileobj=folder, mode="w") as tar:
        content = b"x" * 8192
        info = tarfile.TarInfo("app.py")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    data = folder.getvalue()

    def body() -> Iterator[bytes]:
        yield data[:1024]
        tenants.write_text(without_tenant_tokens(good, "other"))  # mid-body
        wait_for(lambda: status(server, tokens.other) == 401, what="the removed token to be refused",
                 timeout_s=FOLLOWED_S)  # fmt: skip
        yield data[1024:]

    auth = {"Authorization": f"Bearer {tokens.other}", "Content-Type": "application/x-tar"}
    refused = httpx2.post(server.url + "/v1/workspaces", content=body(), headers=auth, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"] == "AuthenticationError", refused.text
    tenants.write_text(good)
    wait_for(lambda: status(server, tokens.other) == 200, what="the token back", timeout_s=FOLLOWED_S)
    listed = httpx2.get(server.url + "/v1/workspaces", headers=auth, timeout=10)
    assert listed.status_code == 200 and listed.json() == [], listed.text  # nothing was stored
