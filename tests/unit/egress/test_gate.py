"""What a sandbox's proxy decides and records (egress/_gate.py, _rules.py), its event loop
(_loop.py) and its byte streams (_streams.py), apart from any request."""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import socket
import ssl
import threading
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from stockade import SandboxStartError
from stockade.egress import EgressProxy, EnvSecret, Judge, NetworkPolicy, SystemResolver, _attach, _loop
from stockade.egress._gate import Gate
from stockade.egress._resolve import MAX_LOOKUPS
from stockade.egress._rules import KEPT
from stockade.egress._streams import CHUNK, Plain, wrap
from stockade.egress._tls import CONTEXTS_KEPT
from stockade.sandbox.base import SandboxSpec
from stockade.types import Credential, EgressRecord, HostRule
from tests.conftest import require
from tests.egress_servers import TOKEN, servers

T = TypeVar("T")


def test_a_judge_keeps_its_verdicts_and_no_more_than_it_may() -> None:
    judge = Judge(NetworkPolicy(allow_hosts=("pkg.test", "*.example.com"), allow_addresses=("10.0.0.0/8",)))
    first = judge.request("pkg.test", 443, "GET")
    assert first.allowed and judge.request("pkg.test", 443, "GET") is first
    assert not judge.request("other.test", 443, "GET").allowed  # each question its own answer
    assert not judge.request("pkg.test", 8080, "GET").allowed
    assert judge.addresses("pkg.test", ["10.1.2.3"]) == (["10.1.2.3"], None)
    allowed, refusal = judge.addresses("pkg.test", ["10.1.2.3", "169.254.169.254"])
    assert not allowed and refusal is not None and "169.254.169.254" in refusal.reason
    kept, _ = judge.addresses("pkg.test", ["10.1.2.3"])
    kept.append("8.8.8.8")  # a caller's list is its own: the kept answer does not change
    assert judge.addresses("pkg.test", ["10.1.2.3"]) == (["10.1.2.3"], None)
    for i in range(KEPT + 10):  # code asking about ever new names does not grow the judge
        judge.request(f"n{i}.example.com", 443, "GET")
    assert len(judge._requests) <= KEPT


@pytest.mark.parametrize(
    ("spelled", "asked"),
    [("API.GitHub.com", "api.github.com"), ("api.github.com.", "api.github.com"), ("0:0::1", "[::1]")],
)
def test_a_credential_goes_to_its_host_however_the_policy_spells_it(spelled: str, asked: str) -> None:
    gh = Credential(name="gh", hosts=(spelled,), source=EnvSecret("GH_TOKEN"))
    verdict = Judge(NetworkPolicy(allow_hosts=(spelled,), credentials=(gh,))).request(asked, 443, "CONNECT")
    assert verdict.allowed and verdict.credential is gh and verdict.intercept


@pytest.mark.parametrize(
    "address",
    [
        "::7f00:1",  # IPv4-compatible (::/96) loopback
        "::a9fe:a9fe",  # IPv4-compatible metadata service
        "::808:808",  # IPv4-compatible, even of a public address: deprecated, routed oddly
        "64:ff9b:1::a9fe:a9fe",  # local-use NAT64 (RFC 8215): a network's own translator
        "64:ff9b:1::808:808",
        "64:ff9b::a9fe:a9fe",  # well-known NAT64 of the metadata service
        "64:ff9b::a00:1",  # ... of a private address
        "2002:a9fe:a9fe::1",  # 6to4 of the metadata service
        "2001:0:4136:e378:8000:63bf:f5ff:fffe",  # Teredo, client 10.0.0.1
        "fec0::1",  # site-local
        "::ffff:7f00:1",
    ],
)
def test_ipv6_forms_of_addresses_that_are_not_public_are_refused(address: str) -> None:
    judge = Judge(NetworkPolicy(allow_hosts=("pkg.test",)))
    verdict = judge.address(ipaddress.ip_address(address))
    assert verdict is not None and verdict.rule == "addresses (not public)"
    assert judge.addresses("pkg.test", [address])[1] is not None


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "2001:4860:4860::8888", "64:ff9b::808:808", "2002:808:808::1"]
)
def test_public_addresses_and_their_ipv6_forms_are_reached(address: str) -> None:
    assert Judge(NetworkPolicy(allow_hosts=("pkg.test",))).address(ipaddress.ip_address(address)) is None


def test_an_allowed_network_lets_its_ipv6_forms_through() -> None:
    judge = Judge(NetworkPolicy(allow_hosts=("pkg.test",), allow_addresses=("10.0.0.0/8", "fec0::/10")))
    for address in ("10.1.2.3", "::ffff:10.1.2.3", "64:ff9b::a01:203", "fec0::1"):
        assert judge.address(ipaddress.ip_address(address)) is None, address


def test_the_tls_contexts_of_opened_hosts_are_bounded_and_dropped_at_renew() -> None:
    """Code naming ever new hosts under a wildcard rule with methods (each a certificate of
    the sandbox's CA, about 30 KB) holds no more than ``CONTEXTS_KEPT`` of them; the next
    user of the sandbox starts with none."""
    proxy = EgressProxy(NetworkPolicy(rules=(HostRule(host="*.example.com", methods=("GET",)),)))
    ca = proxy.ca
    assert ca is not None
    try:
        first = ca.context("h0.example.com")
        for i in range(1, CONTEXTS_KEPT + 20):
            ca.context(f"h{i}.example.com")
            assert ca.context("h0.example.com") is first  # the host used last is kept
        assert len(ca._contexts) == CONTEXTS_KEPT
        assert "h1.example.com" not in ca._contexts  # the one used least lately was dropped
        _loop.call(proxy.renew())
        assert len(ca._contexts) == 0
    finally:
        _loop.call(proxy.close())


def test_a_renew_gives_the_next_user_the_whole_accept_budget() -> None:
    """A user who spent the connections its budget accepts at once left the next user of
    the sandbox its own connects waiting in the backlog until the budget refilled."""
    proxy = EgressProxy(NetworkPolicy(allow_hosts=("pkg.test",)))
    try:
        burst = proxy.accepts.burst
        for _ in range(burst):
            proxy.accepts.spend()
        assert proxy.accepts.wait_s(burst) > 0  # the next user's connects would wait
        _loop.call(proxy.renew())
        assert proxy.accepts.wait_s(burst) == 0.0  # a whole burst accepted at once
    finally:
        _loop.call(proxy.close())


class Rotating:
    """A secret source the test rotates, or makes unreadable (a vault down)."""

    def __init__(self, value: str) -> None:
        self.value: str | None = value

    def read(self) -> str:
        if self.value is None:
            raise ConnectionError("the vault is down")
        return self.value


def test_a_renew_reads_the_credentials_again_and_holds_none_it_could_not_read() -> None:
    """A pool's member kept the value read at its start for every later user: a secret
    rotated (the old one revoked) was still sent."""
    source = Rotating("OLD-SECRET")
    api = Credential(name="api", hosts=("api.test",), source=source)
    proxy = EgressProxy(NetworkPolicy(allow_hosts=("api.test",), credentials=(api,)))
    try:
        assert proxy.gate.secrets == {"api": "OLD-SECRET"}
        old = proxy.gate.forms_for(api)  # the answers' scrub, as its first user's answers made it
        assert old is not None and old.holds(b"echo: OLD-SECRET")
        source.value = "NEW-SECRET"
        _loop.call(proxy.renew())
        assert proxy.gate.secrets == {"api": "NEW-SECRET"}
        assert proxy.gate.secrets_for(api)[1][1] == b"Bearer NEW-SECRET"  # scrubbed as sent now
        scrub = proxy.gate.forms_for(api)  # the new value scrubbed from answers, not the old one
        assert scrub is not None and scrub.holds(b"echo: NEW-SECRET")
        source.value = None
        with pytest.raises(SandboxStartError, match=r"credential 'api'.*ConnectionError"):
            _loop.call(proxy.renew())
        assert proxy.gate.secrets == {} and proxy.gate.secrets_for(api) == (None, [])
    finally:
        _loop.call(proxy.close())


class Hanging:
    """A secret source that does not answer (a vault that accepts and never replies)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def read(self) -> str:
        self.released.wait(5)
        return "LATE-SECRET"


def test_a_credential_source_that_hangs_fails_the_start_within_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start read the sources on the caller's thread with no deadline, as a reset does
    not (10 s): a source that hung held the sandbox's start, and a pool's one refill
    thread, for ever. Now it is a ``SandboxStartError`` (retryable) once the deadline
    passed, nothing left of the proxy; the read's thread ends on its own."""
    monkeypatch.setattr(_attach, "SECRETS_TIMEOUT_S", 0.2)
    source = Hanging()
    api = Credential(name="api", hosts=("api.test",), source=source)
    spec = SandboxSpec(network=NetworkPolicy(allow_hosts=("api.test",), credentials=(api,)))
    try:
        with pytest.raises(SandboxStartError, match=r"credential 'api'.* not read in 0.2 s") as raised:
            _attach.attach(spec, tmp_path / "egress")
        assert raised.value.retryable
        assert not (tmp_path / "egress").exists()
    finally:
        source.released.set()


class Stuck:
    """A secret source that hangs while the test holds it (a vault that stopped replying,
    then came back), counting its reads."""

    def __init__(self) -> None:
        self.answers = threading.Event()
        self.answers.set()
        self.reads = 0

    def read(self) -> str:
        self.reads += 1
        self.answers.wait(30)
        return f"SECRET-{self.reads}"


def _readers() -> set[threading.Thread]:
    """The credential reads' threads alive now (a set: an earlier test's may end meanwhile,
    which a count taken before and after counted as this test's thread gone)."""
    return {t for t in threading.enumerate() if t.name == "stockade-egress-secrets"}


def test_a_source_that_hangs_is_read_once_however_often_starts_and_resets_ask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each start started a read of its own and left it at the deadline, and a pool retries
    a failed start every half second: a hung vault cost a host thread (and a read of the
    vault) more every 10.5 s, without bound (9 threads, then 14 after 45 s), and each
    reset's renew another. A read still running is now waited on again, by starts and
    renews alike; once the source answers, it is read afresh."""
    monkeypatch.setattr(_attach, "SECRETS_TIMEOUT_S", 0.05)
    source = Stuck()
    api = Credential(name="api", hosts=("api.test",), source=source)
    spec = SandboxSpec(network=NetworkPolicy(allow_hosts=("api.test",), credentials=(api,)))
    before = _readers()
    running = _attach.attach(spec, tmp_path / "running")
    try:
        assert running.proxy.gate.secrets == {"api": "SECRET-1"}
        source.answers.clear()  # the vault stops answering
        for attempt in range(10):  # a pool's refill, retrying
            with pytest.raises(SandboxStartError, match=r"'api'.* not read in 0.05 s"):
                _attach.attach(spec, tmp_path / f"egress-{attempt}")
        assert (source.reads, len(_readers() - before)) == (2, 1), "a read and a thread for each start"
        for _ in range(10):  # the resets of a pool's members
            with pytest.raises(SandboxStartError, match=r"'api'.* not read in 0.05 s"):
                running.renew()
            assert running.proxy.gate.secrets == {}  # the last user's value is not kept
        assert (source.reads, len(_readers() - before)) == (2, 1), "a read and a thread for each reset"
        source.answers.set()  # the vault is back: the next start and reset read it again
        _attach.attach(spec, tmp_path / "egress").close()
        running.renew()
        assert running.proxy.gate.secrets == {"api": f"SECRET-{source.reads}"} and source.reads >= 3
    finally:
        source.answers.set()
        running.close()


def test_the_next_user_gets_a_resolver_that_knows_nothing_of_the_last_ones_names() -> None:
    """Its cache told by timing which allowed names the last user resolved (for 15 s), and
    the last user's lookups stuck in a slow DNS held every slot of the next user's."""
    asked: list[str] = []
    stuck_ended: list[str] = []
    release = threading.Event()

    def ask(name: str, port: int) -> list[str]:
        asked.append(name)
        if name.startswith("stuck-"):
            release.wait(10)  # a DNS server that answers late
            stuck_ended.append(name)
            raise OSError("timed out")
        return ["93.184.216.34"]

    async def two_users() -> None:
        proxy = EgressProxy(NetworkPolicy(allow_hosts=("*.example.com",)), resolver=SystemResolver(ask=ask))
        await proxy.resolver.resolve("user1-private.example.com", 443)
        names = [f"stuck-{i}.example.com" for i in range(MAX_LOOKUPS)]
        stuck = [asyncio.create_task(proxy.resolver.resolve(name, 443)) for name in names]
        while len(asked) < 1 + MAX_LOOKUPS:  # every slot held
            await asyncio.sleep(0.01)
        for task in stuck:
            task.cancel()  # the reset cuts the last user's requests...
        await proxy.renew()  # ...and renews its proxy
        await proxy.resolver.resolve("user2-own.example.com", 443)
        assert stuck_ended == [], "the next user's lookup waited for the last user's to end"
        await proxy.resolver.resolve("user1-private.example.com", 443)
        assert asked.count("user1-private.example.com") == 2, "answered from the last user's cache"

    try:
        asyncio.run(two_users())
    finally:
        release.set()


def _gate(told: list[EgressRecord]) -> Gate:
    return Gate(NetworkPolicy(allow_hosts=("pkg.test",)), observer=told.append, resolver=SystemResolver())


def test_records_reach_the_observer_after_the_loop_is_done_and_none_is_lost_at_close() -> None:
    told: list[EgressRecord] = []
    gate = _gate(told)

    async def requests() -> list[EgressRecord]:
        gate.emit(EgressRecord(host="pkg.test", port=443, method="GET", path="/1", status=200))
        gate.emit(EgressRecord(host="pkg.test", port=443, method="GET", path="/2", status=404))
        before = list(told)  # still the request's turn of the loop: nothing told yet
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        gate.emit(EgressRecord(host="pkg.test", port=443, method="GET", path="/3", status=200))
        gate.close()  # the sandbox ends before the loop comes back: told now, not dropped
        return before

    assert asyncio.run(requests()) == []
    assert [(r.path, r.status) for r in told] == [("/1", 200), ("/2", 404), ("/3", 200)]


def test_an_observer_that_fails_is_counted_and_the_rest_still_told() -> None:
    told: list[EgressRecord] = []

    def observer(record: EgressRecord) -> None:
        if record.path == "/bad":
            raise RuntimeError("the audit store is down")
        told.append(record)

    gate = Gate(NetworkPolicy(allow_hosts=("pkg.test",)), observer=observer, resolver=SystemResolver())

    async def requests() -> None:
        for path in ("/a", "/bad", "/b"):
            gate.emit(EgressRecord(host="pkg.test", port=80, method="GET", path=path))
        gate.close()

    asyncio.run(requests())
    assert [r.path for r in told] == ["/a", "/b"] and gate.observer_failures == 1


def test_the_standard_loop_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOCKADE_EGRESS_LOOP", "asyncio")
    loop = _loop.new_loop()
    try:
        assert isinstance(loop, asyncio.BaseEventLoop)  # uvloop's is not one
    finally:
        loop.close()


def test_a_stream_holds_at_most_a_chunk_unread_and_gives_everything_in_order() -> None:
    """A fast sender and a reader that waits: the stream stops reading the socket (the
    sender's kernel buffers fill), and every byte still arrives, in order."""

    async def run() -> None:
        ours, theirs = socket.socketpair()
        stream: Plain = await wrap(ours)
        payload = bytes(range(256)) * (4 * CHUNK // 256)
        loop = asyncio.get_running_loop()
        theirs.setblocking(False)
        sending = loop.create_task(loop.sock_sendall(theirs, payload))
        await asyncio.sleep(0.05)
        assert len(stream._data) <= 2 * CHUNK and stream._reading_paused
        got = bytearray()
        while len(got) < len(payload):
            got += await stream.recv()
        await sending
        theirs.close()
        assert await stream.recv() == b"" and bytes(got) == payload
        stream.close()
        await asyncio.sleep(0)

    asyncio.run(run())


def test_the_proxy_on_uvloop_forwards_tunnels_and_brokers_as_on_asyncio(tmp_path: Path) -> None:
    """With the egress-fast extra the proxies run on uvloop's loop: the same requests, the
    same records. (Its other tests ran on both loops when it was added; this one keeps a
    check where uvloop is installed.)"""
    require(
        "uvloop", importlib.util.find_spec("uvloop") is not None, "the egress-fast extra (dev installs it)"
    )
    import uvloop

    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    try:
        with servers(tmp_path) as local:
            records: list[EgressRecord] = []
            proxy = EgressProxy(local.policy(), observer=records.append)
            url = f"http://127.0.0.1:{call(proxy.start_tcp())}"
            ca = proxy.ca_pem
            assert ca is not None
            tls = ssl.create_default_context(cafile=str(local.ca_file))
            tls.load_verify_locations(cadata=ca.decode())
            opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({"http": url, "https": url}),
                urllib.request.HTTPSHandler(context=tls),
            )
            try:
                plain = opener.open(f"http://pkg.test:{local.http_port}/page", timeout=10).read()
                brokered = opener.open(f"https://api.test:{local.https_port}/auth", timeout=10).read()
            finally:
                call(proxy.close())
            assert TOKEN in " ".join(local.https_seen.authorizations)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert (plain, brokered) == (b"http hello /page", b"https authorized=True")
    assert [(r.method, r.status, r.credential) for r in records] == [("GET", 200, ""), ("GET", 200, "api")]
