"""The egress proxy on its own, on the host: what it lets through, what it refuses and why.

The clients are the standard library's (urllib, ssl, sockets) against local servers on
127.0.0.x under made-up names; the sandbox tiers run the same proxy behind their relay
(tests/integration/test_egress.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import logging
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.egress import EgressProxy, HostRule, NetworkPolicy, SystemResolver, _loop
from stockade.types import EgressRecord
from tests.conftest import wait_for
from tests.egress_servers import (
    HEADER_NAME_ECHOES,
    HTTP_ADDRESS,
    MIXED_TOKEN,
    REFUSED_ECHOES,
    TOKEN,
    Servers,
    encoded,
    servers,
)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with servers(tmp_path_factory.mktemp("egress")) as found:
        yield found


class Running:
    def __init__(self, policy: NetworkPolicy) -> None:
        self.records: list[EgressRecord] = []
        self.proxy = EgressProxy(policy, observer=self.records.append)
        self.port = _loop.call(self.proxy.start_tcp())

    def opener(self, trust: list[Path | bytes] | None = None) -> urllib.request.OpenerDirector:
        ctx = ssl.create_default_context()
        for item in trust or []:
            if isinstance(item, bytes):
                ctx.load_verify_locations(cadata=item.decode())
            else:
                ctx.load_verify_locations(str(item))
        url = f"http://127.0.0.1:{self.port}"
        return urllib.request.build_opener(
            urllib.request.ProxyHandler({"http": url, "https": url}), urllib.request.HTTPSHandler(context=ctx)
        )

    def close(self) -> None:
        _loop.call(self.proxy.close())


@contextlib.contextmanager
def running(policy: NetworkPolicy) -> Iterator[Running]:
    proxy = Running(policy)
    try:
        yield proxy
    finally:
        proxy.close()


def refused(opener: urllib.request.OpenerDirector, url: str | urllib.request.Request) -> tuple[int, str]:
    with pytest.raises(urllib.error.HTTPError) as info:
        opener.open(url, timeout=10).read()
    return info.value.code, info.value.read().decode()


def test_an_allowed_host_is_reached_and_recorded(local: Servers) -> None:
    with running(local.policy()) as proxy:
        body = proxy.opener().open(f"http://pkg.test:{local.http_port}/page?q=1", timeout=10).read()
    assert body == b"http hello /page"
    (record,) = proxy.records
    assert (record.host, record.method, record.path, record.status, record.decision) == (
        "pkg.test", "GET", "/page?q=1", 200, "allow",
    )  # fmt: skip
    assert record.rule == f"allow: pkg.test:{local.http_port}" and record.bytes_in == len(body)


@pytest.mark.parametrize(
    ("host", "rule"),
    [
        ("other.test", "allow (no rule)"),  # a name no rule allows
        ("127.0.0.2", "allow (no rule)"),  # an IP literal, even of an allowed address
        ("169.254.169.254", "allow (no rule)"),  # the metadata service
        ("[::ffff:169.254.169.254]", "allow (no rule)"),
        ("[::1]", "allow (no rule)"),
    ],
)
def test_names_and_addresses_not_allowed_are_refused(local: Servers, host: str, rule: str) -> None:
    with running(local.policy()) as proxy:
        code, body = refused(proxy.opener(), f"http://{host}:{local.http_port}/")
    assert code == 403 and f"(rule: {rule})" in body
    assert proxy.records[-1].decision == "deny" and proxy.records[-1].rule == rule


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("metadata.test", "link-local"),
        ("loopback.test", "loopback"),
        ("private.test", "private"),
        ("mixed.test", "private"),  # one public answer and one private: a rebinding, refused
        ("v6.test", "loopback"),
    ],
)
def test_allowed_names_that_resolve_to_private_addresses_are_refused(
    local: Servers, name: str, kind: str
) -> None:
    policy = local.policy(allow_hosts=(f"{name}:{local.http_port}",))
    with running(policy) as proxy:
        code, body = refused(proxy.opener(), f"http://{name}:{local.http_port}/")
    assert code == 403 and f"is a {kind} address" in body and "(rule: addresses (not public))" in body


def test_a_port_not_allowed_is_refused(local: Servers) -> None:
    with running(local.policy()) as proxy:
        code, body = refused(proxy.opener(), f"http://pkg.test:{local.http_port + 1}/")
    assert code == 403 and "port" in body


def test_methods_are_held_where_a_rule_names_them(local: Servers) -> None:
    policy = local.policy(
        allow_hosts=(), rules=(HostRule(host="pkg.test", ports=(local.http_port,), methods=("GET",)),)
    )
    with running(policy) as proxy:
        opener = proxy.opener()
        assert opener.open(f"http://pkg.test:{local.http_port}/", timeout=10).read() == b"http hello /"
        request = urllib.request.Request(f"http://pkg.test:{local.http_port}/", data=b"x" * 10, method="POST")
        code, body = refused(opener, request)
    assert code == 403 and "POST to pkg.test is not allowed" in body


@pytest.mark.parametrize("name", ["X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"])
def test_a_method_override_header_is_held_to_the_rules_methods(local: Servers, name: str) -> None:
    policy = local.policy(
        allow_hosts=(), rules=(HostRule(host="pkg.test", ports=(local.http_port,), methods=("GET",)),)
    )
    url = f"http://pkg.test:{local.http_port}/"
    with running(policy) as proxy:
        opener = proxy.opener()
        same = urllib.request.Request(url, headers={name: "get"})
        assert opener.open(same, timeout=10).read() == b"http hello /"  # a method the rule names
        code, body = refused(opener, urllib.request.Request(url, headers={name: "DELETE"}))
    assert code == 403 and f"DELETE (said by {name.lower()}) to pkg.test is not allowed" in body
    assert f"(rule: allow: pkg.test:{local.http_port} GET)" in body
    last = proxy.records[-1]
    assert (last.method, last.status, last.decision) == ("GET", 403, "deny")


def test_a_redirect_to_a_denied_host_is_refused(local: Servers) -> None:
    with running(local.policy()) as proxy:
        url = f"http://pkg.test:{local.http_port}/redirect?to=http://169.254.169.254/latest/meta-data"
        code, body = refused(proxy.opener(), url)
    assert code == 403 and "redirect" in body
    assert proxy.records[-1].rule.startswith("redirect")


def test_the_requests_per_minute_are_a_limit(local: Servers) -> None:
    with running(local.policy(max_requests_per_minute=2)) as proxy:
        opener = proxy.opener()
        for _ in range(2):
            opener.open(f"http://pkg.test:{local.http_port}/", timeout=10).read()
        code, body = refused(opener, f"http://pkg.test:{local.http_port}/")
    assert code == 429 and "max_requests_per_minute" in body


def test_the_bytes_per_minute_are_a_limit(local: Servers) -> None:
    with running(local.policy(max_bytes_per_minute=100_000)) as proxy:
        opener = proxy.opener()
        with pytest.raises((http.client.HTTPException, OSError)):  # cut mid-body
            opener.open(f"http://pkg.test:{local.http_port}/big?n=1000000", timeout=10).read()
    assert proxy.records[-1].rule == "max_bytes_per_minute"


def test_the_bytes_per_minute_count_request_heads(local: Servers) -> None:
    """A header carries as much as a body: the heads sent and received count too."""
    with running(local.policy(max_bytes_per_minute=10_000)) as proxy:
        opener = proxy.opener()
        url = f"http://pkg.test:{local.http_port}/"
        heavy = urllib.request.Request(url, headers={"X-Data": "a" * 6000})
        opener.open(heavy, timeout=10).read()  # its body is a few bytes; its head 6 KB
        code, body = refused(opener, heavy)
    assert code == 429 and "max_bytes_per_minute" in body


def test_refused_requests_count_against_the_rate_and_past_it_are_one_record(local: Servers) -> None:
    """Each refusal is a record, so it is a request: past the rate the sandbox gets 429s,
    the first recorded and the rest told as one record, not one each."""
    with running(local.policy(max_requests_per_minute=3)) as proxy:
        opener = proxy.opener()
        for _ in range(3):
            assert refused(opener, f"http://other.test:{local.http_port}/")[0] == 403
        assert refused(opener, f"http://pkg.test:{local.http_port}/")[0] == 429  # allowed, but past it
        for i in range(50):
            assert refused(opener, f"http://other.test:{local.http_port}/{i}")[0] == 429
    assert [(r.host, r.status, r.decision) for r in proxy.records[:3]] == [("other.test", 403, "deny")] * 3
    assert [(r.host, r.status, r.rule) for r in proxy.records[3:]] == [
        ("pkg.test", 429, "max_requests_per_minute"),
        ("", 429, "max_requests_per_minute"),
    ]
    assert proxy.records[-1].reason.startswith("50 more refused past the rate")


def test_https_with_a_credential_reaches_the_server_and_the_secret_never_comes_back(local: Servers) -> None:
    with running(local.policy()) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        opener = proxy.opener([ca])  # the client trusts the sandbox's CA only (and the system's)
        body = opener.open(f"https://api.test:{local.https_port}/auth", timeout=10).read()
        echoed = opener.open(f"https://api.test:{local.https_port}/echo-auth", timeout=10)
        echoed_body = echoed.read().decode()
        echoed_header = echoed.headers["X-Echo"]
    assert body == b"https authorized=True"
    assert f"Bearer {TOKEN}" in local.https_seen.authorizations
    assert TOKEN not in echoed_body and TOKEN not in echoed_header and "[REDACTED]" in echoed_body
    assert all(TOKEN not in repr(r) for r in proxy.records)
    assert [r.credential for r in proxy.records if r.method == "GET"] == ["api", "api"]


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_credential_hosts_reply_in_a_coding_not_asked_for_is_decoded_and_scrubbed(
    local: Servers, coding: str
) -> None:
    """The proxy asks for no coding; a server that compresses anyway would carry the echoed
    secret past the scrub: the proxy undoes the coding and scrubs what it reads."""
    with running(local.policy()) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        reply = proxy.opener([ca]).open(
            f"https://api.test:{local.https_port}/echo-auth-as?as={coding}", timeout=10
        )
        body, encoding = reply.read(), reply.headers["Content-Encoding"]
    assert encoding is None and body == b"you sent: [REDACTED]"


def test_a_credential_hosts_reply_in_a_coding_the_proxy_cannot_undo_is_a_502(local: Servers) -> None:
    with running(local.policy()) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        code, body = refused(proxy.opener([ca]), f"https://api.test:{local.https_port}/echo-auth-as?as=br")
    assert code == 502 and "rule: reply (encoding)" in body
    assert [(r.status, r.decision, r.rule) for r in proxy.records if r.method == "GET"] == [
        (502, "allow", "reply (encoding)")  # the request reached the server: not a "deny"
    ]


@pytest.mark.parametrize("how", ["identity-then-gzip", "gzip-then-identity", "identity-gzip-listed"])
def test_a_reply_that_names_one_coding_among_identities_is_decoded_and_scrubbed(
    local: Servers, how: str
) -> None:
    """A client applies every Content-Encoding listed (in one header or several): the proxy
    reads them all, not the first only, so an ``identity`` first hides no gzip from the scrub."""
    with running(local.policy()) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        reply = proxy.opener([ca]).open(
            f"https://api.test:{local.https_port}/echo-auth-as?as={how}", timeout=10
        )
        body, encodings = reply.read(), reply.headers.get_all("Content-Encoding")
    assert encodings is None and body == b"you sent: [REDACTED]"


@pytest.mark.parametrize("how", ["gzip-twice", "gzip-twice-listed"])
def test_a_reply_in_two_codings_is_a_502(local: Servers, how: str) -> None:
    with running(local.policy()) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        code, body = refused(proxy.opener([ca]), f"https://api.test:{local.https_port}/echo-auth-as?as={how}")
    assert code == 502 and "rule: reply (encoding)" in body
    assert [(r.status, r.rule) for r in proxy.records if r.method == "GET"] == [(502, "reply (encoding)")]


@pytest.mark.parametrize("how", ["gzip-members", "gzip-members-padded"])
def test_a_reply_of_several_gzip_members_is_decoded_whole_and_scrubbed(local: Servers, how: str) -> None:
    """gzip members one after another are one body (RFC 1952), zeros between them skipped as
    Python's ``gzip`` does: the proxy decoded the first member only, and the rest was cut
    without a word (here the member that holds the echo)."""
    with running(local.policy()) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        reply = proxy.opener([ca]).open(
            f"https://api.test:{local.https_port}/echo-auth-as?as={how}", timeout=10
        )
        body = reply.read()
    assert body == b"you sent: [REDACTED]"
    assert [(r.status, r.decision) for r in proxy.records if r.method == "GET"] == [(200, "allow")]


@pytest.mark.parametrize("how", ["lower", "upper"])
def test_the_secret_echoed_in_another_letter_case_is_scrubbed(local: Servers, how: str) -> None:
    """A server that lowercases or uppercases what it echoes passed a case-sensitive scrub."""
    with running(local.policy(MIXED_TOKEN)) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        reply = proxy.opener([ca]).open(
            f"https://api.test:{local.https_port}/echo-auth-as?as={how}", timeout=10
        )
        body, echo = reply.read(), reply.headers["X-Echo"]
    said = "you sent: [REDACTED]" if how == "lower" else "YOU SENT: [REDACTED]"
    assert body == said.encode() and echo == said, (body, echo)


def test_a_folded_header_line_from_a_credential_host_is_a_502(local: Servers) -> None:
    """h11 joins a folded line to the one before with a space: a value folded inside the
    secret ("Bearer Tok", then " -Zq9x...") matched no form and reached the code. An
    answer head with a folded line is refused, as RFC 9112 (5.2) lets a proxy do."""
    with running(local.policy(MIXED_TOKEN)) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        code, body = refused(
            proxy.opener([ca]), f"https://api.test:{local.https_port}/echo-auth-as?as=folded"
        )
    half = MIXED_TOKEN[len(MIXED_TOKEN) - len(MIXED_TOKEN) // 2 :]
    assert code == 502 and "rule: reply (syntax)" in body and half not in body and "Zq9x" not in body
    assert [(r.status, r.decision, r.rule) for r in proxy.records if r.method == "GET"] == [
        (502, "allow", "reply (syntax)")
    ]


@pytest.mark.parametrize("how", sorted(HEADER_NAME_ECHOES))
@pytest.mark.parametrize("token", [TOKEN, MIXED_TOKEN])
def test_a_header_whose_name_holds_the_secret_is_dropped(local: Servers, how: str, token: str) -> None:
    """A name cannot be scrubbed in place (``[REDACTED]`` is no header name) and comes
    lowercased from h11: a header whose name holds any form of the secret, in any case,
    never reaches the code."""
    with running(local.policy(token)) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        reply = proxy.opener([ca]).open(
            f"https://api.test:{local.https_port}/echo-auth-as?as={how}", timeout=10
        )
        body, names = reply.read(), [name.lower() for name in reply.headers]
    echoed = HEADER_NAME_ECHOES[how](token).lower()
    assert body == b"ok" and names and echoed not in names
    assert not any(form in name for name in names for form in (token.lower(), token.encode().hex()))


@pytest.mark.parametrize("how", ["b64", "b64url", "hex", "pct"])
def test_the_common_encodings_of_the_secret_are_scrubbed_too(local: Servers, how: str) -> None:
    with running(local.policy()) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        body = (
            proxy.opener([ca])
            .open(f"https://api.test:{local.https_port}/echo-auth-as?as={how}", timeout=10)
            .read()
        )
    assert encoded(how, TOKEN.encode()) not in body and b"[REDACTED]" in body
    assert encoded(how, f"you sent: Bearer {TOKEN}".encode()) not in body


def test_the_reason_phrase_is_scrubbed(local: Servers) -> None:
    with running(local.policy()) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        with pytest.raises(urllib.error.HTTPError) as info:
            proxy.opener([ca]).open(f"https://api.test:{local.https_port}/echo-auth-as?as=reason", timeout=10)
    info.value.close()
    assert info.value.code == 401 and TOKEN not in info.value.reason and "[REDACTED]" in info.value.reason


@pytest.mark.parametrize("how", sorted(REFUSED_ECHOES))
def test_a_refusal_of_a_reply_that_echoes_the_secret_names_the_field_not_its_value(
    local: Servers, how: str
) -> None:
    """A coding the proxy cannot undo and a redirect it refuses are answered by the proxy
    itself: its status line, headers and body, and the record, carry no form of the secret
    the server put there (in any letter case), and the record names the credential sent."""
    forms = (MIXED_TOKEN, MIXED_TOKEN.lower(), MIXED_TOKEN.upper())
    with running(local.policy(MIXED_TOKEN)) as proxy:
        ca = proxy.proxy.ca_pem
        assert ca is not None
        with pytest.raises(urllib.error.HTTPError) as info:
            proxy.opener([ca]).open(f"https://api.test:{local.https_port}/echo-auth-as?as={how}", timeout=10)
        body = info.value.read().decode()
        head = f"{info.value.code} {info.value.reason}\n{info.value.headers}"
    assert info.value.code in (403, 502) and body.startswith("stockade egress:")
    assert not any(form in text for form in forms for text in (head, body)), head + body
    [record] = [r for r in proxy.records if r.method == "GET"]
    assert record.decision == "allow" and record.credential == "api"  # it went, with the credential
    assert not any(form in repr(record) for form in forms), record


def test_what_the_proxy_composes_is_redacted_in_every_form_and_case(local: Servers) -> None:
    """A message or record that quotes a server's words anyway (lowercased, uppercased, the
    header value sent, an encoded form) loses every form of every credential's value."""
    with running(local.policy(MIXED_TOKEN)) as proxy:
        gate = proxy.proxy.gate
        quoted = [MIXED_TOKEN, MIXED_TOKEN.lower(), MIXED_TOKEN.upper(), f"bearer {MIXED_TOKEN.lower()}"]
        quoted += [MIXED_TOKEN.encode().hex(), MIXED_TOKEN.encode().hex().upper()]
        for text in quoted:
            assert gate.redact(f"to {text}.evil.test") == "to [REDACTED].evil.test", text
        assert gate.redact("nothing of it here") == "nothing of it here"


def test_https_without_a_credential_is_a_tunnel_to_the_server_itself(local: Servers) -> None:
    with running(local.policy(credentials=())) as proxy:
        assert proxy.proxy.ca_pem is None  # nothing to open: no CA at all
        body = (
            proxy.opener([local.ca_file]).open(f"https://api.test:{local.https_port}/auth", timeout=10).read()
        )
    assert body == b"https authorized=False"
    opened, record = proxy.records  # as the tunnel opened, then as it ended
    assert (opened.phase, record.phase, record.tunnel) == ("open", "end", opened.tunnel)
    assert (record.method, record.sni, record.status) == ("CONNECT", "api.test", 200)


def test_a_tunnel_held_open_is_recorded_as_it_opens_then_as_it_ends(local: Servers) -> None:
    """A tunnel may stay open for the sandbox's whole life: the trail has it from its start
    (allowed, to where), not only once it ends (a host that dies first would have left no
    record of it at all); its end record says what it carried, under the same id."""
    with running(local.policy(credentials=())) as proxy:
        sock = _tunnel(proxy.port, f"api.test:{local.https_port}")
        ctx = ssl.create_default_context(cafile=str(local.ca_file))
        with ctx.wrap_socket(sock, server_hostname="api.test") as tls:
            wait_for(lambda: proxy.records, what="the open tunnel's record", timeout_s=5)
            (opened,) = proxy.records  # the tunnel still open
            assert (opened.host, opened.port, opened.method, opened.sni, opened.phase) == (
                "api.test", local.https_port, "CONNECT", "api.test", "open",
            )  # fmt: skip
            assert (opened.decision, opened.status, opened.bytes_out, opened.bytes_in) == ("allow", 200, 0, 0)
            assert opened.rule == f"allow: api.test:{local.https_port}" and len(opened.tunnel) == 16
            tls.sendall(b"GET /auth HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := tls.recv(4096):
                answer += chunk
        assert answer.endswith(b"https authorized=False")
        wait_for(lambda: len(proxy.records) == 2, what="the tunnel's end record", timeout_s=5)
    ended = proxy.records[1]
    assert (ended.phase, ended.tunnel, ended.decision, ended.status) == ("end", opened.tunnel, "allow", 200)
    assert ended.bytes_out > 0 and ended.bytes_in > len(answer)  # the TLS records, both ways


def _tunnel(port: int, target: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def test_a_tunnel_whose_sni_differs_from_its_host_is_closed(local: Servers) -> None:
    with running(local.policy(credentials=())) as proxy:
        sock = _tunnel(proxy.port, f"api.test:{local.https_port}")
        ctx = ssl.create_default_context(cafile=str(local.ca_file))
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            ctx.wrap_socket(sock, server_hostname="other.test")  # served there, but not allowed
        sock.close()
    assert proxy.records[-1].rule == "tls (sni)" and proxy.records[-1].sni == "other.test"


def test_a_tunnel_must_carry_tls(local: Servers) -> None:
    with running(local.policy(credentials=())) as proxy:
        sock = _tunnel(proxy.port, f"api.test:{local.https_port}")
        sock.sendall(b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")
        assert sock.recv(100) == b""
        sock.close()
    assert proxy.records[-1].rule == "tls (sni)" and "TLS" in proxy.records[-1].reason


def test_closing_cuts_open_tunnels(local: Servers) -> None:
    proxy = Running(local.policy(credentials=()))
    sock = _tunnel(proxy.port, f"api.test:{local.https_port}")
    ctx = ssl.create_default_context(cafile=str(local.ca_file))
    tls = ctx.wrap_socket(sock, server_hostname="api.test")
    proxy.close()
    tls.settimeout(5)
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        tls.sendall(b"GET /auth HTTP/1.1\r\nHost: api.test\r\n\r\n")
        if not tls.recv(100):
            raise ConnectionError("closed")
    tls.close()


def test_closing_cuts_a_credentialed_request_mid_answer_and_records_it(
    local: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """What a killed run's sandbox does to its proxy: the answer streaming with the credential
    stops at once, the trail keeps the request as cut (with the server's status the client got,
    the bytes relayed and the credential), and the close is no error of the loop."""
    proxy = Running(local.policy())
    ca = proxy.proxy.ca_pem
    assert ca is not None
    answer = proxy.opener([ca]).open(
        f"https://api.test:{local.https_port}/stream?chunks=100&every=0.05", timeout=10
    )
    assert answer.readline() == b"chunk 0\n"
    cut_before = len(local.https_seen.cut)
    proxy.close()
    with pytest.raises((http.client.IncompleteRead, ConnectionError, ssl.SSLError, OSError)):
        while answer.readline():  # what the proxy had relayed already, then the cut
            pass
        raise ConnectionError("the answer ended without its last chunk")
    answer.close()
    (record,) = [r for r in proxy.records if r.method == "GET"]
    assert (record.status, record.credential) == (200, "api") and "closed mid-request" in record.reason
    assert record.bytes_in >= len(b"chunk 0\n")  # what the client got of the answer before the cut
    assert proxy.proxy.ca is None and not proxy.proxy.gate.secrets
    # the upstream connection was cut too: the server notices at its next writes (one every 0.05 s)
    wait_for(
        lambda: len(local.https_seen.cut) > cut_before, what="the server to see its answer cut", timeout_s=5
    )
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]


# A request that went out and ended early is recorded with what went: the body bytes each
# way, the credential its head carried, the server's status, and "allow" (the server had it),
# whatever ended it (before, each of these was "0 bytes", most without the credential).
MIB = 1024 * 1024


def _post(url: str, size: int) -> urllib.request.Request:
    return urllib.request.Request(url, data=b"x" * size, method="POST")


def _one(records: list[EgressRecord], method: str) -> EgressRecord:
    (record,) = [r for r in records if r.method == method]
    return record


def test_a_redirect_refused_after_the_body_went_records_the_body_and_the_credential(local: Servers) -> None:
    before = len(local.https_seen.received)
    with running(local.policy()) as proxy:
        assert proxy.proxy.ca_pem is not None
        url = f"https://api.test:{local.https_port}/redirect?to=https://other.test/next"
        code, _ = refused(proxy.opener([proxy.proxy.ca_pem]), _post(url, MIB))
    assert code == 403 and local.https_seen.received[before:] == [MIB]
    record = _one(proxy.records, "POST")
    assert (record.status, record.decision, record.credential, record.bytes_out) == (403, "allow", "api", MIB)
    assert record.rule.startswith("redirect") and record.reason.startswith("the server answered 302, then")


def test_an_upload_the_client_cuts_records_the_bytes_that_went_and_the_credential(local: Servers) -> None:
    before = len(local.https_seen.received)
    with running(local.policy()) as proxy:
        assert proxy.proxy.ca_pem is not None
        ctx = ssl.create_default_context(cadata=proxy.proxy.ca_pem.decode())
        tls = ctx.wrap_socket(_tunnel(proxy.port, f"api.test:{local.https_port}"), server_hostname="api.test")
        tls.sendall(f"POST /upload HTTP/1.1\r\nHost: api.test\r\nContent-Length: {2 * MIB}\r\n\r\n".encode())
        tls.sendall(b"x" * MIB)
        tls.close()  # half the body: the code gave up, or was killed
        wait_for(lambda: any(r.method == "POST" for r in proxy.records), what="the cut upload's record")
    wait_for(lambda: len(local.https_seen.received) > before, what="the server to see the body cut")
    (got,) = local.https_seen.received[before:]
    record = _one(proxy.records, "POST")
    assert (record.decision, record.credential) == ("allow", "api"), record
    assert 0 < got <= record.bytes_out <= MIB, (got, record)
    assert proxy.proxy.gate.bytes.total >= record.bytes_out  # the budget counted what went


def test_a_download_the_client_cuts_records_the_servers_status_and_the_bytes_that_came(
    local: Servers,
) -> None:
    size = 32 * MIB  # more than the sockets between the server and the code hold
    with running(local.policy()) as proxy:
        assert proxy.proxy.ca_pem is not None
        answer = proxy.opener([proxy.proxy.ca_pem]).open(
            f"https://api.test:{local.https_port}/big?n={size}", timeout=10
        )
        assert len(answer.read(MIB)) == MIB
        answer.close()  # the rest unread
        wait_for(lambda: any(r.method == "GET" for r in proxy.records), what="the cut download's record")
    record = _one(proxy.records, "GET")
    assert (record.status, record.decision, record.credential) == (200, "allow", "api"), record
    assert MIB <= record.bytes_in < size and "the client went away" in record.reason, record


def test_a_byte_limit_hit_mid_upload_records_the_bytes_that_went_and_the_credential(local: Servers) -> None:
    before = len(local.https_seen.received)
    with running(local.policy(max_bytes_per_minute=MIB)) as proxy:
        assert proxy.proxy.ca_pem is not None
        url = f"https://api.test:{local.https_port}/upload"
        with pytest.raises((OSError, http.client.HTTPException)):  # a 429, or the body's write cut
            proxy.opener([proxy.proxy.ca_pem]).open(_post(url, 4 * MIB), timeout=10).read()
    wait_for(lambda: len(local.https_seen.received) > before, what="the server to see the body cut")
    (got,) = local.https_seen.received[before:]
    record = _one(proxy.records, "POST")
    assert (record.status, record.decision, record.rule) == (429, "allow", "max_bytes_per_minute"), record
    assert record.credential == "api" and 0 < got <= record.bytes_out <= MIB, (got, record)
    assert proxy.proxy.gate.bytes.total >= record.bytes_out


def _head(sock: socket.socket) -> bytes:
    """The next head ``sock`` gets (up to its blank line), read a byte at a time."""
    head = b""
    while not head.endswith(b"\r\n\r\n") and (piece := sock.recv(1)):
        head += piece
    return head


EXPECTING = (
    "POST http://{host}:{port}/upload HTTP/1.1\r\nHost: {host}\r\nContent-Length: 5\r\n"
    "Expect: 100-continue\r\nConnection: close\r\n\r\n"
)


def test_a_client_that_expects_100_continue_gets_it_before_it_sends_its_body(local: Servers) -> None:
    """``Expect: 100-continue`` (curl sends it for bodies over 1 MiB; some clients wait for
    the 100 without end): answered once the request is judged and its server reached."""
    with (
        running(local.policy()) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client,
    ):
        client.sendall(EXPECTING.format(host="pkg.test", port=local.http_port).encode())
        interim = _head(client)  # the body is not sent yet: the proxy answers without it
        client.sendall(b"hello")
        final = _head(client) + client.recv(100)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert final.startswith(b"HTTP/1.1 200 ") and final.endswith(b"got 5 bytes")
    assert [(r.method, r.status, r.bytes_out) for r in proxy.records] == [("POST", 200, 5)]


def test_a_refused_request_that_expects_100_continue_is_refused_without_its_body(local: Servers) -> None:
    with (
        running(local.policy()) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client,
    ):
        client.sendall(EXPECTING.format(host="other.test", port=local.http_port).encode())
        answer = _head(client)
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert [(r.method, r.status, r.decision) for r in proxy.records] == [("POST", 403, "deny")]


def test_a_server_that_cannot_be_reached_is_an_allowed_request_with_nothing_sent(local: Servers) -> None:
    with socket.socket() as probe:  # a port of the allowed address that nothing listens on
        probe.bind((HTTP_ADDRESS, 0))
        closed = probe.getsockname()[1]
    with running(local.policy(allow_hosts=(f"pkg.test:{closed}",))) as proxy:
        code, _ = refused(proxy.opener(), f"http://pkg.test:{closed}/")
    record = _one(proxy.records, "GET")
    assert (code, record.status, record.decision, record.bytes_out, record.credential) == (
        502,
        502,
        "allow",
        0,
        "",
    )
    assert record.reason.startswith(f"cannot reach pkg.test:{closed}")


class StuckResolver(SystemResolver):
    """Pinned names as the policy says; any other lookup never ends (``asked`` counts them)."""

    def __init__(self, policy: NetworkPolicy) -> None:
        super().__init__(policy.resolve)
        self.asked = 0

    async def lookup(self, host: str, port: int) -> list[str]:
        self.asked += 1
        await asyncio.Event().wait()
        return []


def client_hello(name: str) -> bytes:
    """A TLS ClientHello for ``name``, as a client's first bytes in a tunnel."""
    out = ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), out, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def test_closing_records_each_request_once_at_whatever_await_it_was_cut(local: Servers) -> None:
    """Every request the proxy took is one record, however it ends: here the proxy closes
    (the sandbox killed) while one waits at each await of a CONNECT (the name's lookup, the
    TLS hello, the server's connect, the splice, the opened TLS's handshake), of a plain
    request (the lookup) and of a refusal (its body drained before the 403 is sent)."""
    full = socket.socket()  # a listener whose queue is full: a connect to it hangs (SYN dropped)
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fillers = [socket.socket() for _ in range(2)]
    quiet = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    hang_port, quiet_port = full.getsockname()[1], quiet.getsockname()[1]
    for filler in fillers:
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", hang_port))
    base = local.policy()
    policy = local.policy(
        allow_hosts=("slow.test:443", "slow.test:80", f"idle.test:{quiet_port}", f"hang.test:{hang_port}",
                     f"quiet.test:{quiet_port}"),
        allow_addresses=(*base.allow_addresses, "127.0.0.1/32"),
        resolve={**base.resolve, **{n: ("127.0.0.1",) for n in ("idle.test", "hang.test", "quiet.test")}},
    )  # fmt: skip
    records: list[EgressRecord] = []
    resolver = StuckResolver(policy)
    proxy = EgressProxy(policy, observer=records.append, resolver=resolver)
    port = _loop.call(proxy.start_tcp())
    clients: list[socket.socket] = []

    def send(data: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        clients.append(sock)
        sock.sendall(data)
        return sock

    def tunnel(target: str, hello: bytes) -> socket.socket:
        sock = send(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(hello)
        return sock

    upstream = None
    try:
        send(b"CONNECT slow.test:443 HTTP/1.1\r\nHost: slow.test:443\r\n\r\n")  # at the lookup
        send(b"GET http://slow.test/ HTTP/1.1\r\nHost: slow.test\r\n\r\n")  # at the lookup
        wait_for(lambda: resolver.asked == 2, what="both lookups to start", timeout_s=5)
        tunnel(f"idle.test:{quiet_port}", b"")  # at the hello
        tunnel(f"hang.test:{hang_port}", client_hello("hang.test"))  # at the connect
        hello = client_hello("quiet.test")
        tunnel(f"quiet.test:{quiet_port}", hello)  # at the splice
        upstream, _ = quiet.accept()
        upstream.settimeout(10)
        assert upstream.recv(len(hello), socket.MSG_WAITALL) == hello
        opened = tunnel(f"api.test:{local.https_port}", client_hello("api.test"))  # at the handshake
        assert opened.recv(4096)  # the proxy's ServerHello: it waits for the client's answer
        send(  # refused, at its body's drain
            f"POST http://other.test:{local.http_port}/ HTTP/1.1\r\nHost: other.test\r\n"
            "Content-Length: 100\r\n\r\nten bytes.".encode()
        )
        wait_for(lambda: len(proxy._tasks) == 7, what="seven connections served", timeout_s=5)
        _loop.call(asyncio.sleep(0.3))  # the connect and the drain, under way on the proxy's loop
        # None ended; the spliced one is recorded as it opened (before its hello went).
        assert [(r.host, r.phase) for r in records] == [("quiet.test", "open")]
    finally:
        _loop.call(proxy.close())
        for sock in [*clients, *fillers, full, quiet, *([upstream] if upstream else [])]:
            sock.close()
    at_open = records.pop(0)
    told = {(r.host, r.method): r for r in records}
    assert len(records) == len(told) == 7, records  # each once
    for key in [("slow.test", "CONNECT"), ("slow.test", "GET"), ("idle.test", "CONNECT"),
                ("hang.test", "CONNECT"), ("api.test", "CONNECT")]:  # fmt: skip
        record = told[key]
        assert (record.status, record.decision) == (0, "allow"), record
        assert record.reason == "cut: the sandbox's proxy was closed mid-request" and record.rule.startswith(
            "allow"
        )
    assert (told["idle.test", "CONNECT"].sni, told["hang.test", "CONNECT"].sni) == ("", "hang.test")
    spliced = told["quiet.test", "CONNECT"]
    assert (spliced.status, spliced.bytes_out, spliced.sni) == (200, len(hello), "quiet.test")
    assert (spliced.phase, spliced.tunnel) == ("end", at_open.tunnel)
    assert "closed mid-request" in spliced.reason
    refused = told["other.test", "POST"]
    assert (refused.status, refused.decision, refused.rule) == (403, "deny", "allow (no rule)")


class ScriptedResolver(SystemResolver):
    """The system resolver's cache over answers the test gives, one per lookup."""

    def __init__(self, answers: list[list[str]]) -> None:
        self.now = 0.0
        super().__init__(ttl_s=15.0, clock=lambda: self.now)
        self.answers = answers
        self.asked = 0

    async def lookup(self, host: str, port: int) -> list[str]:
        self.asked += 1
        return self.answers.pop(0)


def test_the_resolver_keeps_answers_for_its_ttl_and_never_failures() -> None:
    resolver = ScriptedResolver([[], ["93.184.216.34"], ["93.184.216.35"]])
    assert _loop.call(resolver.resolve("example.test", 443)) == []  # not kept: asked again
    for _ in range(3):
        assert _loop.call(resolver.resolve("example.test", 443)) == ["93.184.216.34"]
    assert resolver.asked == 2
    resolver.now += 16.0
    assert _loop.call(resolver.resolve("example.test", 443)) == ["93.184.216.35"]
    assert resolver.asked == 3


def test_a_cached_name_that_rebinds_to_a_private_address_is_refused(local: Servers) -> None:
    """The cache changes when the resolver is asked, not what is checked: every answer, kept
    or fresh, is judged before the proxy connects to it."""
    resolver = ScriptedResolver([["127.0.0.2"], ["169.254.169.254"]])
    policy = local.policy(allow_hosts=(f"rebind.test:{local.http_port}",), allow_addresses=("127.0.0.2/32",))
    proxy = EgressProxy(policy, resolver=resolver)
    port = _loop.call(proxy.start_tcp())
    url = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": url}))
    try:
        for _ in range(2):
            assert (
                opener.open(f"http://rebind.test:{local.http_port}/r", timeout=10).read() == b"http hello /r"
            )
        resolver.now += 16.0
        code, body = refused(opener, f"http://rebind.test:{local.http_port}/r")
    finally:
        _loop.call(proxy.close())
    assert resolver.asked == 2
    assert code == 403 and "is a link-local address" in body


def test_connections_that_arrive_as_the_proxy_closes_are_closed_at_once(tmp_path: Path) -> None:
    """What the relay's warm connections do to a sandbox closed right after it started: the
    proxy has accepted them but not yet set them up when it closes. Each is closed then (the
    client reads the end), not left to the garbage collector (a ResourceWarning)."""
    proxy = EgressProxy(NetworkPolicy(allow_hosts=("pkg.test",)))
    path = str(tmp_path / "proxy.sock")
    _loop.call(proxy.start(path))

    async def connect_then_close() -> list[socket.socket]:
        clients = []
        for _ in range(4):
            client = socket.socket(socket.AF_UNIX)
            client.setblocking(False)
            client.connect(path)
            clients.append(client)
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the proxy's accept ran in between, its connections not set up
        await proxy.close()
        return clients

    clients = _loop.call(connect_then_close())
    for client in clients:
        with client:
            client.settimeout(5)
            while client.recv(4096):  # a 503 at most, then the end
                pass
    gc.collect()  # a connection dropped half-made would warn here
