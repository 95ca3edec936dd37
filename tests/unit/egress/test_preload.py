"""The connect shortcut (egress/connect.c): a program that connects to the relay's port
reaches the proxy's socket instead, and sees a TCP connection to that port; every other
connect is the C library's own, and one the shortcut cannot make goes to the port.

Built for the test with a port and a socket of its own, and preloaded into a child python
(the sandbox's programs are children of the supervisor, LD_PRELOAD in their environment).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stockade.egress import _preload
from tests.conftest import require

CLIENT = """
import json, socket, sys
port, how = int(sys.argv[1]), sys.argv[2]
seen = {}
if how == "udp":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("127.0.0.1", port))
    seen["peer"] = list(s.getpeername())
    print(json.dumps(seen)); sys.exit()
s = socket.create_connection(("127.0.0.1", port)) if how == "blocking" else socket.socket()
if how == "nonblocking":
    s.setblocking(False)
    try:
        s.connect(("127.0.0.1", port))
        seen["connected"] = "at once"
    except BlockingIOError:
        seen["connected"] = "in progress"
    s.setblocking(True)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
seen["nodelay"] = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
seen["peer"] = list(s.getpeername())
seen["name"] = list(s.getsockname())
s.sendall(b"GET http://example.test/ HTTP/1.1\\r\\n\\r\\n")
s.shutdown(socket.SHUT_WR)
seen["answer"] = s.recv(100).decode()
print(json.dumps(seen))
"""


@dataclass
class Shortcut:
    library: Path
    port: int
    socket_path: Path


@pytest.fixture
def shortcut(tmp_path: Path) -> Iterator[Shortcut]:
    # A port nobody listens on, for the test's life (bound, never listening: kept ours).
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    path = tmp_path / "proxy.sock"
    built = _preload.library(port, str(path), folder=tmp_path / "cache")
    require("the connect shortcut (a C compiler, x86_64)", built is not None, "gVisor takes the relay")
    assert built is not None
    library = tmp_path / _preload.LIBRARY
    library.write_bytes(built)
    try:
        yield Shortcut(library, port, path)
    finally:
        holder.close()


def _serve_once(listener: socket.socket, answer: bytes, got: list[bytes]) -> threading.Thread:
    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            got.append(data)
            conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _run(shortcut: Shortcut, how: str, *, port: int | None = None) -> dict[str, object]:
    env = {**os.environ, "LD_PRELOAD": str(shortcut.library)}
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, str(port or shortcut.port), how],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize("how", ["blocking", "nonblocking"])
def test_a_connect_to_the_relays_port_reaches_the_proxys_socket_and_looks_like_tcp(
    shortcut: Shortcut, how: str
) -> None:
    got: list[bytes] = []
    with socket.socket(socket.AF_UNIX) as proxy:
        proxy.bind(str(shortcut.socket_path))
        proxy.listen(1)
        server = _serve_once(proxy, b"HTTP/1.1 200 OK\r\n\r\n", got)
        seen = _run(shortcut, how)
        server.join(10)
    assert got == [b"GET http://example.test/ HTTP/1.1\r\n\r\n"]
    assert seen["answer"] == "HTTP/1.1 200 OK\r\n\r\n"
    # What a TCP client checks of its socket: options accepted, its peer the port it asked.
    assert seen["nodelay"] == 0
    assert seen["peer"] == ["127.0.0.1", shortcut.port]
    assert seen["name"] == ["127.0.0.1", 0]
    if how == "nonblocking":
        assert seen["connected"] == "at once"  # a Unix socket's connect never half-way


def test_without_the_proxys_socket_the_connect_goes_to_the_port(shortcut: Shortcut) -> None:
    # What the shortcut cannot take (here: no socket at its path) reaches the relay.
    got: list[bytes] = []
    with socket.socket() as relay:
        relay.bind(("127.0.0.1", 0))
        relay.listen(1)
        port = relay.getsockname()[1]
        other = _preload.library(port, str(shortcut.socket_path), folder=shortcut.library.parent / "cache")
        assert other is not None
        shortcut.library.write_bytes(other)
        server = _serve_once(relay, b"relayed", got)
        seen = _run(shortcut, "blocking", port=port)
        server.join(10)
    assert seen["answer"] == "relayed"
    assert seen["peer"] == ["127.0.0.1", port]
    assert got and got[0].startswith(b"GET ")


def test_other_connects_are_untouched(shortcut: Shortcut) -> None:
    with socket.socket(socket.AF_UNIX) as proxy, socket.socket() as elsewhere:
        proxy.bind(str(shortcut.socket_path))
        proxy.listen(1)
        # Another port (bound, not listening: refused): the C library's connect.
        elsewhere.bind(("127.0.0.1", 0))
        env = {**os.environ, "LD_PRELOAD": str(shortcut.library)}
        refused = subprocess.run(
            [sys.executable, "-c", CLIENT, str(elsewhere.getsockname()[1]), "blocking"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert refused.returncode != 0
        assert "ConnectionRefusedError" in refused.stderr
        # A datagram socket to the relay's port stays a datagram socket to that port.
        seen = _run(shortcut, "udp")
    assert seen["peer"] == ["127.0.0.1", shortcut.port]


def test_the_library_is_built_only_for_a_port_and_an_absolute_socket_path() -> None:
    for port, path in [(0, "/run/x.sock"), (70000, "/run/x.sock"), (3128, "relative.sock"), (3128, '/a"b')]:
        with pytest.raises(ValueError):
            _preload.flags(port, path)
