"""Sealed frames (``protocol.Seal``): where code in the sandbox can open the supervisor's
pipes (gVisor's /proc), a frame it writes, replays, reorders or cuts never passes for one the
peer sent. The seal itself, then the host's channel over a supervisor that seals."""

from __future__ import annotations

import os
import queue
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from stockade import SandboxCrashed
from stockade.sandbox._channel import Channel
from stockade.sandbox.supervisor import protocol
from stockade.sandbox.supervisor.protocol import (
    BLAKE2B,
    HMAC_SHA256,
    MACS,
    PREFIX,
    FrameError,
    FrameReader,
    Seal,
    best_mac,
    encode,
)

KEY = secrets.token_bytes(Seal.SIZE)


@pytest.fixture(params=MACS)
def mac(request: pytest.FixtureRequest) -> str:
    """Every test of a seal holds for each MAC a supervisor may name."""
    return str(request.param)


def sealed(
    frames: list[tuple[dict[str, object], bytes]], key: bytes = KEY, count: int = 0, mac: str = BLAKE2B
) -> list[bytes]:
    seal = Seal(key, b"S", count, head=True, mac=mac)
    return [encode(header, body, seal) for header, body in frames]


def reader(count: int = 0, mac: str = BLAKE2B) -> FrameReader:
    r = FrameReader(max_body=1 << 20)
    r.seal = Seal(KEY, b"S", count, head=True, mac=mac)
    return r


def test_sealed_frames_round_trip_whatever_the_chunks(mac: str) -> None:
    stream = b"".join(sealed([({"id": n, "ev": "out"}, os.urandom(n * 7)) for n in range(1, 6)], mac=mac))
    r = reader(mac=mac)
    got = []
    for i in range(0, len(stream), 13):  # a pipe hands bytes over in any pieces
        r.feed(stream[i : i + 13])
        got += r.frames()
    assert [h["id"] for h, _ in got] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda f: encode({"id": 1, "ev": "exit", "exit_code": 0}), id="unsealed"),
        pytest.param(lambda f: f[0][:-1] + bytes([f[0][-1] ^ 1]), id="a tag changed"),
        pytest.param(lambda f: f[0][:12] + b"X" + f[0][13:], id="a header changed"),
        pytest.param(lambda f: f[1], id="the second first (reordered or the first dropped)"),
        pytest.param(
            lambda f: sealed([({"id": 1, "ev": "exit"}, b"")], key=secrets.token_bytes(32))[0],
            id="another key",
        ),
        pytest.param(
            lambda f: encode({"id": 1, "ev": "exit"}, b"", Seal(KEY, b"H", mac=BLAKE2B)),
            id="the other direction",
        ),
        pytest.param(
            lambda f: sealed([({"id": 1, "ev": "exit"}, b"")], mac=HMAC_SHA256)[0],
            id="the other MAC",
        ),
    ],
)
def test_a_frame_the_peer_did_not_send_is_refused(forge: object) -> None:
    genuine = sealed([({"id": 1, "ev": "out"}, b"a"), ({"id": 1, "ev": "exit"}, b"")])
    r = reader()
    r.feed(forge(genuine) + b"".join(genuine))  # type: ignore[operator]  # ahead of the peer's
    with pytest.raises(FrameError, match="seal does not match"):
        r.frames()


def test_a_replayed_frame_is_refused(mac: str) -> None:
    first, second = sealed([({"id": 1, "ev": "out"}, b"a"), ({"id": 2, "ev": "out"}, b"b")], mac=mac)
    r = reader(mac=mac)
    r.feed(first + second)
    assert len(r.frames()) == 2
    r.feed(first)
    with pytest.raises(FrameError):
        r.frames()


def test_a_forged_prefix_is_refused_before_its_body_is_waited_for(mac: str) -> None:
    """Code that opened the supervisor's pipe (gVisor's /proc) wrote a prefix saying 128 MiB,
    then the body short of its end: the host held it all, per sandbox, for as long as the
    sandbox lived, since only the whole frame's tag was checked (found from outside). The
    prefix has its own tag: a forged one ends the channel at once, nothing buffered."""
    r = FrameReader(max_body=128 << 20)
    r.seal = Seal(KEY, b"S", head=True, mac=mac)
    r.feed(PREFIX.pack(2, (128 << 20) - 1) + os.urandom(Seal.SIZE) + b"{}")
    with pytest.raises(FrameError, match="prefix's seal"):
        r.frames()
    # a true prefix is waited on as before, and its frame then checked whole
    frame = sealed([({"id": 1, "ev": "out"}, b"x" * 100)], mac=mac)[0]
    r = reader(mac=mac)
    r.feed(frame[: PREFIX.size + Seal.SIZE + 10])
    assert r.frames() == []
    r.feed(frame[PREFIX.size + Seal.SIZE + 10 :])
    assert [h["id"] for h, _ in r.frames()] == [1]


class SealingSupervisor:
    """The supervisor's side over an in-memory stream: answers ``ready``, takes the key the host
    sends, then answers every request sealed; ``forge`` goes in ahead of its answer."""

    def __init__(self, mac: str) -> None:
        self.mac = mac
        self.replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.requests = FrameReader(max_body=1 << 20)
        self.key = b""
        self.seal: Seal | None = None
        self.forge = b""

    def send(self, data: bytes, deadline: float | None = None) -> None:
        if not self.key:  # the first bytes the host sends here: the key, raw
            self.key = data
            self.seal = Seal(self.key, b"S", head=True, mac=self.mac)
            self.requests.seal = Seal(self.key, b"H", mac=self.mac)
            return
        self.requests.feed(data)
        for header, _ in self.requests.frames():
            reply = {"id": header["id"], "ev": "done"}
            self.replies.put(self.forge + encode(reply, b"", self.seal))

    def recv(self) -> bytes:
        return self.replies.get()

    def close(self) -> None:
        self.replies.put(b"")


def test_the_channel_seals_both_ways_and_ends_at_a_forged_frame(mac: str) -> None:
    supervisor = SealingSupervisor(mac)
    channel = Channel(supervisor, max_body=1 << 20, name="sealed")
    try:
        channel.seal(KEY, mac=mac)
        assert supervisor.key == KEY
        assert channel.call({"op": "stat"}).result(None)[0]["ev"] == "done"
        assert channel.seal_state() == (KEY, 1, 1, mac)  # what a memory snapshot keeps
        supervisor.forge = encode({"id": 2, "ev": "done"})  # what code wrote into the pipe
        with pytest.raises(
            SandboxCrashed, match="something in the sandbox wrote to the supervisor's channel"
        ):
            channel.call({"op": "stat"}).result(None)
        assert not channel.open
    finally:
        channel.close()


def test_an_unknown_mac_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown seal"):
        Seal(KEY, b"S", mac="md5")


CHECK_FIRST_FRAME = """
import sys
from protocol import FrameReader, Seal, best_mac, encode
key = bytes(range(32))
frame = encode({"id": 1, "op": "code"}, b"print(1)", Seal(key, b"H", mac=best_mac()))
reader = FrameReader(max_body=1 << 20)
reader.seal = Seal(key, b"H", mac=best_mac())
reader.feed(frame)
assert reader.frames()[0][0] == {"id": 1, "op": "code"}
print(best_mac(), "_hashlib" in sys.modules)
"""


def test_the_supervisor_checks_its_first_sealed_request_without_loading_openssl() -> None:
    """On gVisor the supervisor checks the host's first sealed request (the first
    ``run_code``'s) on that call's critical path: importing hmac loaded OpenSSL (``_hashlib``,
    with hashlib and warnings), 13-38 ms of the call inside gVisor. Where its Python has
    BLAKE2 (built in), it seals with that and loads no library; run as the supervisor is
    (``-S -E -s``, a fresh interpreter, its own folder on the path)."""
    folder = Path(protocol.__file__).parent
    done = subprocess.run(
        [sys.executable, "-S", "-E", "-s", "-B", "-c", CHECK_FIRST_FRAME],
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == [best_mac(), "False"]
    assert best_mac() == (BLAKE2B if sys.version_info < (3, 14) else HMAC_SHA256)


TAKE_KEY = """
import os, sys
# before it trims sys.path
import _ctypes, baseline, files, fileops, jobs, libc, proctree, protocol, reaper, runcode, zygote
import supervisor
from protocol import FrameReader
r, w = os.pipe()
os.write(w, bytes(range(32)))
sup = supervisor.Supervisor(0, 1)
sup.take_seal(r, FrameReader(max_body=1 << 20))
pid = os.fork()
if pid == 0:
    bytes(sup.seal.key)  # not in the fork: touching it kills the fork
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(bytes(sup.seal.key) == bytes(range(32)), os.WIFSIGNALED(status), "mmap" in sys.modules)
"""


def test_the_key_is_read_into_a_page_forks_leave_out_without_the_mmap_module() -> None:
    """The supervisor takes the key right before it reads the first request (the first
    ``run_code``'s, on gVisor): importing the mmap module for its page took 5-12 ms of that
    call. The page comes from libc now, still left out of every fork. (Its modules imported
    first: run as root, the supervisor keeps no stdlib folder on its path, root can write them.)"""
    done = subprocess.run(
        [sys.executable, "-S", "-E", "-s", "-B", "-c", TAKE_KEY],
        cwd=Path(protocol.__file__).parent,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["True", "True", "False"]
