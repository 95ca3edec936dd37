"""The proxy's name lookups: a name that is no DNS name, and a host whose DNS is slow.

Whatever name the code sends, the proxy answers it and records it; one sandbox asking for
names its host's DNS is slow to answer neither stalls another sandbox's lookups (they
shared the event loop's few resolver threads) nor keeps its own requests without an answer
(there was no deadline), and the host's process exits cleanly with lookups still blocked
(uvloop's were libuv's threads, which crashed the interpreter at its exit).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from stockade.egress import EgressProxy, NetworkPolicy, SystemResolver, _loop
from stockade.egress._resolve import LookupsStuck
from stockade.types import EgressRecord
from tests.conftest import require, wait_for


def ask_proxy(port: int, head: bytes, timeout_s: float = 10.0) -> bytes:
    """The proxy's answer's first bytes to one request head (b"" for a connection closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as client:
        client.sendall(head)
        answer = b""
        while b"\r\n" not in answer:
            chunk = client.recv(4096)
            if not chunk:
                break
            answer += chunk
        return answer


@pytest.mark.parametrize(
    "head",
    [
        b"CONNECT a..good.test:8443 HTTP/1.1\r\nHost: a..good.test:8443\r\n\r\n",
        b"CONNECT " + b"x" * 64 + b".good.test:8443 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET http://a..good.test:8443/ HTTP/1.1\r\nHost: a..good.test:8443\r\n\r\n",
    ],
    ids=["empty-label", "long-label", "absolute-url"],
)
def test_a_name_a_wildcard_allows_that_is_no_dns_name_is_refused_and_recorded(
    head: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    records: list[EgressRecord] = []
    proxy = EgressProxy(NetworkPolicy(allow_hosts=("*.good.test:8443",)), observer=records.append)
    port = _loop.call(proxy.start_tcp())
    try:
        answer = ask_proxy(port, head)
        wait_for(lambda: records, what="the refusal's record")
    finally:
        _loop.call(proxy.close())
    assert answer.startswith(b"HTTP/1.1 400 ") and b"is not a DNS name" in answer, answer
    (record,) = records
    assert (record.status, record.decision, record.rule) == (400, "deny", "dns")
    assert record.host.endswith(".good.test") and "not a DNS name" in record.reason
    gc.collect()  # a task that died of the name would log "Task exception was never retrieved"
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]


class SlowDNS:
    """The host's resolver as a test needs it: names under ``.slow.test`` are not answered
    until ``release``; any other is ``127.0.0.1``. Counts the lookups in it at once."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.now = self.most = self.asked = 0

    def __call__(self, host: str, port: int) -> Sequence[str]:
        with self.lock:
            self.asked += 1
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            if host.endswith(".slow.test"):
                self.released.wait(30)
                return []
            return ["127.0.0.1"]
        finally:
            with self.lock:
                self.now -= 1


@pytest.fixture
def slow_dns() -> Iterator[SlowDNS]:
    dns = SlowDNS()
    yield dns
    dns.released.set()  # no thread of the test's left waiting


def test_a_sandbox_flooding_slow_names_neither_stalls_another_nor_goes_unanswered(slow_dns: SlowDNS) -> None:
    flooding: list[EgressRecord] = []
    other: list[EgressRecord] = []
    a = EgressProxy(
        NetworkPolicy(allow_hosts=("*.slow.test:443",)),
        observer=flooding.append,
        resolver=SystemResolver(ask=slow_dns, max_lookups=4),
    )
    b = EgressProxy(
        NetworkPolicy(allow_hosts=("near.test:9",), allow_addresses=("127.0.0.0/8",)),
        observer=other.append,
        resolver=SystemResolver(ask=slow_dns, max_lookups=4),
    )
    a.gate.lookup_timeout_s = 2.0
    a_port, b_port = _loop.call(a.start_tcp()), _loop.call(b.start_tcp())
    clients = []
    try:
        for i in range(100):
            client = socket.create_connection(("127.0.0.1", a_port))
            client.sendall(f"CONNECT n{i}.slow.test:443 HTTP/1.1\r\nHost: n{i}.slow.test\r\n\r\n".encode())
            clients.append(client)
        wait_for(lambda: slow_dns.now >= 4, what="the flood's lookups to block")
        started = time.monotonic()
        answer = ask_proxy(b_port, b"CONNECT near.test:9 HTTP/1.1\r\nHost: near.test:9\r\n\r\n")
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert took < 1.0, took  # before: no answer in 90 s (0.02 s with no flood)
        # Each of the flood's requests is answered (a 502) and recorded once its deadline passed.
        for client in clients:
            client.settimeout(10)
            assert client.recv(4096).startswith(b"HTTP/1.1 502 ")
        wait_for(lambda: len(flooding) == 100, what="a record for each of the flood's requests")
    finally:
        for client in clients:
            client.close()
        _loop.call(a.close())
        _loop.call(b.close())
    assert {(r.status, r.decision, r.rule) for r in flooding} == {(502, "deny", "dns")}
    assert "no answer for" in flooding[0].reason
    # The flood held its own 4 threads, B one of its own: never the threads of a pool they share.
    assert slow_dns.most == 5 and slow_dns.asked == 5


CHILD = r"""
import os, socket, sys, time
from stockade.egress import EgressProxy, NetworkPolicy, _loop

hole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
hole.bind((os.environ["NAMESERVER"], 53))  # the nameserver: never answers
records = []
a = EgressProxy(NetworkPolicy(allow_hosts=("*.slow.test:443",)), observer=records.append)
a.gate.lookup_timeout_s = 1.0
b = EgressProxy(NetworkPolicy(allow_hosts=("localhost:9",), allow_addresses=("127.0.0.0/8",)))
a_port, b_port = _loop.call(a.start_tcp()), _loop.call(b.start_tcp())
clients = []
for i in range(20):
    client = socket.create_connection(("127.0.0.1", a_port))
    client.sendall(f"CONNECT n{i}.slow.test:443 HTTP/1.1\r\nHost: n{i}.slow.test\r\n\r\n".encode())
    clients.append(client)
time.sleep(0.2)
started = time.monotonic()
with socket.create_connection(("127.0.0.1", b_port)) as client:  # from /etc/hosts: no DNS
    client.settimeout(5)
    client.sendall(b"CONNECT localhost:9 HTTP/1.1\r\nHost: localhost:9\r\n\r\n")
    print("other", client.recv(12).decode(), round(time.monotonic() - started, 3), flush=True)
for client in clients:
    client.settimeout(10)
    print("flood", client.recv(12).decode(), flush=True)
deadline = time.monotonic() + 5
while len(records) < 20 and time.monotonic() < deadline:
    time.sleep(0.05)
print("records", len(records), flush=True)
# and the interpreter exits with the flood's lookups still blocked in getaddrinfo
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_hosts_own_slow_dns_and_an_exit_with_lookups_blocked(tmp_path: Path, loop: str) -> None:
    """The real resolver, in a child whose private mount namespace has a resolv.conf that
    names a nameserver that never answers (the machine's own is not touched)."""
    require(
        "a private mount namespace (unshare as root)",
        os.geteuid() == 0 and shutil.which("unshare") is not None,
    )
    if loop == "uvloop":
        require("uvloop", _has_uvloop(), "the egress-fast extra (dev installs it)")
    # Each run its own address: the network namespace is the machine's, and the two loops'
    # runs can be at the same time on two workers (both on 127.0.0.9: "Address already in use").
    nameserver = {"asyncio": "127.0.0.9", "uvloop": "127.0.0.10"}[loop]
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {nameserver}\noptions timeout:30 attempts:1\n")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    shell = f'mount --bind "{resolv}" /etc/resolv.conf && exec "{sys.executable}" "{script}"'
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "STOCKADE_EGRESS_LOOP": loop}
    env["NAMESERVER"] = nameserver
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)  # before: -11 (SIGSEGV)
    lines = done.stdout.splitlines()
    other = lines[0].split()
    assert other[:3] == ["other", "HTTP/1.1", "200"] and float(other[3]) < 1.0, lines
    assert [line for line in lines if line.startswith("flood")] == ["flood HTTP/1.1 502"] * 20
    assert lines[-1] == "records 20"
    assert "Traceback" not in done.stderr, done.stderr


def _has_uvloop() -> bool:
    import importlib.util

    return importlib.util.find_spec("uvloop") is not None


def test_resets_in_a_loop_of_slow_names_hold_a_bounded_number_of_the_hosts_threads(slow_dns: SlowDNS) -> None:
    """A user may reset its sandbox as often as it likes (``Gate.renew``: the resolver
    ``forget``s). Each next user gets its 4 lookup slots afresh, but the threads of earlier
    users' lookups still blocked count against 8 in all: past them a lookup is refused at
    once (its request a ``502``), until they end (before: 4 more threads each reset)."""
    resolver = SystemResolver(ask=slow_dns, max_lookups=4)

    async def users(count: int) -> int:
        refused = 0
        for _ in range(count):
            asks = [asyncio.ensure_future(resolver.resolve(f"n{i}.slow.test", 443)) for i in range(4)]
            for _ in range(3):  # each has its slot, and its thread or its refusal
                await asyncio.sleep(0)
            for ask in asks:
                if ask.done():
                    assert isinstance(ask.exception(), LookupsStuck)
                    refused += 1
                else:
                    ask.cancel()  # the user gives up: its thread stays in getaddrinfo
            resolver.forget()
        return refused

    assert _loop.call(users(5)) == 3 * 4
    wait_for(lambda: slow_dns.now == 8, what="the first two users' lookups to block")
    assert slow_dns.asked == 8
    slow_dns.released.set()
    wait_for(lambda: slow_dns.now == 0, what="the stuck lookups to end")
    assert _loop.call(resolver.resolve("near.test", 9)) == ["127.0.0.1"]
