"""The host's end of the microVM's egress port (egress/_mux.py) against a guest that does not
keep to the protocol: the real ``Mux`` on the egress loop, one half of a socketpair standing
in for the VM's port (the test writes the guest's frames into the other half by hand) and a
proxy socket that accepts connections and reads only when the test says so.

A guest supervisor is not trusted (guest root after a guest-kernel bug is enough to replace
it): the host holds at most a window of each stream, and a guest that breaks the rules
loses its port; a guest that floods frames without reading the host's answers stalls."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stockade.egress import _loop
from stockade.egress._mux import ACK, CHUNK, CLOSE, DATA, EOF, HEADER, OPEN, WINDOW, Mux, _frame


@dataclass(frozen=True)
class Port:
    mux: Mux
    guest: socket.socket  # the guest's end of the port
    accepted: queue.Queue[socket.socket]  # the proxy's ends of the streams, unread
    held: list[socket.socket]  # every one of them, closed at the end

    def open_stream(self, sid: int) -> socket.socket:
        self.guest.sendall(_frame(OPEN, sid))
        return self.accepted.get(timeout=5)

    def ended_by_host(self) -> bool:
        """Reads the guest's end (what the host answered) until the host closes it."""
        self.guest.settimeout(10)
        try:
            while self.guest.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        return not self.mux.streams


async def _start(mux: Mux) -> None:
    mux.start()


@pytest.fixture
def port(tmp_path: Path) -> Iterator[Port]:
    target = str(tmp_path / "proxy.sock")
    accepted: queue.Queue[socket.socket] = queue.Queue()
    held: list[socket.socket] = []
    server = socket.socket(socket.AF_UNIX)
    server.bind(target)
    server.listen(16)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            held.append(conn)
            accepted.put(conn)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    host_end, guest_end = socket.socketpair()
    mux = Mux(host_end, target)
    _loop.call(_start(mux))
    try:
        yield Port(mux, guest_end, accepted, held)
    finally:
        _loop.call(mux.close())
        guest_end.close()
        server.shutdown(socket.SHUT_RDWR)
        acceptor.join(5)
        server.close()
        for conn in held:
            conn.close()


def _flood(guest: socket.socket, frame: bytes, total: int) -> int:
    """Sends ``frame`` until ``total`` bytes went or the host stops taking them (closed the
    port, or stopped reading it for a second); returns how many bytes went."""
    guest.settimeout(1)
    sent = 0
    while sent < total:
        try:
            sent += guest.send(frame)  # whole frames or a part: the count is what matters
        except (TimeoutError, OSError):
            break
    return sent


def test_a_guest_sending_past_its_window_loses_its_port_and_the_host_holds_no_more(
    port: Port,
) -> None:
    """A stream whose proxy connection does not read, and a guest that sends on regardless:
    before, the host queued all of it (512 MiB took its RSS from 26 to 562 MiB in 2 s)."""
    port.open_stream(1)
    flood = 64 * 1024 * 1024
    sent = _flood(port.guest, _frame(DATA, 1, b"A" * CHUNK), flood)
    # What went is one window and what the socketpair's buffers hold, not the flood.
    assert sent < 8 * 1024 * 1024
    assert port.ended_by_host()
    assert port.mux.violation is not None and f"past a window of {WINDOW}" in port.mux.violation


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([_frame(EOF, 1), _frame(EOF, 1)], "a second EOF"),
        ([_frame(EOF, 1), _frame(DATA, 1, b"late")], "data after its EOF"),
        ([_frame(ACK, 1, (1).to_bytes(4, "big"))], "credit for bytes never sent"),
    ],
    ids=["second-eof", "data-after-eof", "ack-for-nothing"],
)
def test_frames_an_honest_relay_never_sends_end_the_port(port: Port, frames: list[bytes], why: str) -> None:
    """Each would be queued (an EOF each) or believed (credit) without end otherwise."""
    port.open_stream(1)
    port.guest.sendall(b"".join(frames))
    assert port.ended_by_host()
    assert port.mux.violation == f"stream 1: {why}"


def test_a_guest_that_keeps_to_its_window_keeps_its_port(port: Port) -> None:
    """A whole window in flight to a proxy that reads late is what the window allows: it
    goes through, every byte acknowledged, and the next window with it."""
    proxy_end = port.open_stream(1)
    for _ in range(2):
        port.guest.sendall(b"".join(_frame(DATA, 1, b"B" * CHUNK) for _ in range(WINDOW // CHUNK)))
        got = 0
        while got < WINDOW:
            got += len(proxy_end.recv(1 << 16))
        acked = 0
        while acked < WINDOW:
            header = port.guest.recv(HEADER + 4, socket.MSG_WAITALL)
            assert header[0] == ACK
            acked += int.from_bytes(header[HEADER:], "big")
    assert port.mux.violation is None and set(port.mux.streams) == {1}


def test_a_guest_that_floods_frames_and_never_reads_stalls_instead_of_filling_the_host(
    port: Port,
) -> None:
    """Each OPEN of a stream already open is answered with a CLOSE: before, the host wrote
    every answer into its buffer for a guest that never read them (9 bytes per 9 bytes
    sent, without end); now it reads the next frame only once the guest has taken the last
    answer, so the guest's sends stop at what the sockets buffer."""
    port.open_stream(1)
    flood = 32 * 1024 * 1024
    sent = _flood(port.guest, _frame(OPEN, 1) * 1000, flood)
    assert sent < 8 * 1024 * 1024
    assert port.mux.violation is None and set(port.mux.streams) == {1}


async def _tasks() -> int:
    return len(asyncio.all_tasks())


def test_a_flood_of_streams_opened_and_closed_leaves_no_pile_of_tasks(tmp_path: Path) -> None:
    """Each OPEN starts a task (its proxy connection) that its CLOSE cancels: frames already
    buffered were read without a turn of the loop, so a megabyte of OPEN/CLOSE pairs left
    some 50 000 tasks (and their streams) waiting for one, 80 MiB for a moment, while the
    loop (every sandbox's) served nothing else. The proxy's socket is absent here: each
    stream that got to its task fails at once, as quickly as can be."""
    host_end, guest_end = socket.socketpair()
    mux = Mux(host_end, str(tmp_path / "absent.sock"))
    _loop.call(_start(mux))

    def read() -> None:
        with contextlib.suppress(OSError):
            while guest_end.recv(1 << 16):
                pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pairs = b"".join(_frame(OPEN, sid) + _frame(CLOSE, sid) for sid in range(1, 60_001))
    sender = threading.Thread(target=guest_end.sendall, args=(pairs * 2,), daemon=True)
    sender.start()
    most = 0
    try:
        while sender.is_alive():
            most = max(most, _loop.call(_tasks()))
        sender.join()
    finally:
        _loop.call(mux.close())
        guest_end.close()
        reader.join(5)
    assert most < 100
    assert mux.violation is None
