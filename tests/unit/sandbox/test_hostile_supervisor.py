"""The host's side of the channel against a supervisor that lies (it lives with the code)."""

from __future__ import annotations

import io
import itertools
import os
import queue
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import FileTooLarge, ProtocolError, Sandbox, SandboxCrashed
from stockade.sandbox._supervised import TRANSFER_CHUNK, Boundary, SupervisedInstance
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.kernel.protocol import FrameReader, encode
from stockade.sandbox.ops import ReadFile
from stockade.types import Enforcement, Mechanism

NONE = Enforcement(
    memory=Mechanism.NONE, cpus=Mechanism.NONE, pids=Mechanism.NONE,
    disk=Mechanism.NONE, network=Mechanism.NONE, timeout=Mechanism.NONE,
)  # fmt: skip


class EndlessFile:
    """A supervisor that answers every read with a full chunk and claims the file is huge."""

    def __init__(self) -> None:
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._requests = FrameReader(max_body=1 << 30)

    def send(self, data: bytes) -> None:
        self._requests.feed(data)
        for header, _ in self._requests.frames():
            reply = {"id": header["id"], "ev": "done", "size": 1 << 50}
            self._replies.put(encode(reply, b"\0" * TRANSFER_CHUNK))

    def recv(self) -> bytes:
        return self._replies.get()

    def close(self) -> None:
        self._replies.put(b"")


class Killed(Boundary):
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True


def test_a_read_that_never_ends_is_cut_at_the_callers_cap() -> None:
    boundary = Killed()
    instance = SupervisedInstance(
        id="liar", tier="fake", stream=EndlessFile(), boundary=boundary,
        spec=SandboxSpec(), enforcement=NONE,
    )  # fmt: skip
    with pytest.raises(ProtocolError):
        instance.execute(ReadFile(path="big", max_bytes=3 * TRANSFER_CHUNK))
    assert boundary.killed


# -- downloads ------------------------------------------------------------------------------


class ArchiveSupervisor:
    """Answers ``get_archive``: ``open`` gets a transfer id, each ``next`` what ``pieces``
    yields (a reply header and a body), ``close`` is acknowledged. ``None`` ends the stream
    (the supervisor dies)."""

    def __init__(self, pieces: Iterator[tuple[dict[str, object], bytes] | None]) -> None:
        self._pieces = pieces
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._requests = FrameReader(max_body=1 << 30)
        self.stages: list[str] = []

    def send(self, data: bytes) -> None:
        self._requests.feed(data)
        for header, _ in self._requests.frames():
            stage = str(header.get("stage"))
            self.stages.append(stage)
            reply: dict[str, object] = {"id": header["id"], "ev": "done"}
            body = b""
            if stage == "open":
                reply["tx"] = "t1"
            elif stage == "next":
                piece = next(self._pieces)
                if piece is None:
                    self._replies.put(b"")
                    return
                reply.update(piece[0])
                body = piece[1]
            self._replies.put(encode(reply, body))

    def recv(self) -> bytes:
        return self._replies.get()

    def close(self) -> None:
        self._replies.put(b"")


def tar_of(*files: tuple[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def chunks(data: bytes, size: int = 1000) -> Iterator[tuple[dict[str, object], bytes] | None]:
    for start in range(0, len(data), size):
        yield {"eof": start + size >= len(data)}, data[start : start + size]


def sandbox_of(stream: ArchiveSupervisor, boundary: Boundary) -> Sandbox:
    instance = SupervisedInstance(
        id="liar", tier="fake", stream=stream, boundary=boundary, spec=SandboxSpec(), enforcement=NONE
    )
    return Sandbox(instance)


def test_a_download_arrives_in_pieces_and_nothing_is_held_whole(tmp_path: Path) -> None:
    data = tar_of(("a.txt", b"a" * 5000), ("b.txt", b"b"))
    stream = ArchiveSupervisor(chunks(data))
    result = sandbox_of(stream, Killed()).files.download_dir(tmp_path / "out")
    assert (tmp_path / "out" / "a.txt").read_bytes() == b"a" * 5000
    assert result.files == 2
    assert stream.stages[0] == "open" and stream.stages.count("next") == -(-len(data) // 1000)


def test_a_piece_larger_than_asked_kills_the_sandbox(tmp_path: Path) -> None:
    boundary = Killed()
    pieces = iter([({"eof": False}, b"\0" * (TRANSFER_CHUNK + 1))])
    with pytest.raises(ProtocolError):
        sandbox_of(ArchiveSupervisor(pieces), boundary).files.download_dir(tmp_path / "out")
    assert boundary.killed and not (tmp_path / "out").exists()


def test_empty_pieces_forever_do_not_hold_the_host(tmp_path: Path) -> None:
    pieces = itertools.repeat(({"eof": False}, b""))
    with pytest.raises(ProtocolError):
        sandbox_of(ArchiveSupervisor(pieces), Killed()).files.download_dir(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_stream_that_never_ends_is_stopped_by_the_host_and_closed(tmp_path: Path) -> None:
    endless = itertools.repeat(({"eof": False}, b"\1" * 4096))
    stream = ArchiveSupervisor(itertools.chain([({"eof": False}, tar_of(("a.txt", b"a")))], endless))
    with pytest.raises(ProtocolError):
        sandbox_of(stream, Killed()).files.download_dir(tmp_path / "out")
    assert stream.stages[-1] == "close" and not (tmp_path / "out").exists()


def test_the_hosts_cap_stops_a_supervisor_that_ignores_it(tmp_path: Path) -> None:
    data = tar_of(*((f"f{i}", b"\0" * 100_000) for i in range(30)))
    stream = ArchiveSupervisor(chunks(data, 10_000))
    (tmp_path / "out").mkdir()
    with pytest.raises(FileTooLarge):
        sandbox_of(stream, Killed()).files.download_dir(tmp_path / "out", max_bytes=1_000_000)
    # Stopped at the eleventh file, about a third of the way: the rest is never asked for.
    assert stream.stages[-1] == "close" and stream.stages.count("next") < len(data) // 10_000 // 2
    assert os.listdir(tmp_path / "out") == []


def test_a_supervisor_dying_mid_download_leaves_nothing(tmp_path: Path) -> None:
    data = tar_of(("a.txt", b"a" * 5000), ("b.txt", b"b" * 5000))
    pieces = itertools.chain(itertools.islice(chunks(data), 6), [None])
    (tmp_path / "out").mkdir()
    with pytest.raises(SandboxCrashed):
        sandbox_of(ArchiveSupervisor(pieces), Killed()).files.download_dir(tmp_path / "out")
    assert os.listdir(tmp_path / "out") == []
