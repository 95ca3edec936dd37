"""A running ``stockade serve`` follows its tenants file: a token taken out of it is refused
(and its viewer sessions end) within a couple of seconds, without a restart; a changed limit
holds for the next request; and a file that no longer loads keeps the table that did."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from tests.conftest import wait_for
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
