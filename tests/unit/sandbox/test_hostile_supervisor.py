"""The host's side of the channel against a supervisor that lies (it lives with the code)."""

from __future__ import annotations

import io
import itertools
import json
import os
import queue
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import FileTooLarge, ProtocolError, Sandbox, SandboxCrashed, SnapshotError, SnapshotStore
from stockade import exceptions as exc
from stockade.sandbox._supervised import MAX_FRAME, TRANSFER_CHUNK, Boundary, SupervisedInstance
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.ops import ReadFile, RunCode
from stockade.sandbox.supervisor.protocol import MAX_RESULT_COUNT, FrameReader, encode
from stockade.types import Enforcement, Execution, Mechanism

NONE = Enforcement(
    memory=Mechanism.NONE, cpus=Mechanism.NONE, pids=Mechanism.NONE,
    disk=Mechanism.NONE, network=Mechanism.NONE, timeout=Mechanism.NONE,
)  # fmt: skip


class EndlessFile:
    """A supervisor that answers every read with a full chunk and claims the file is huge."""

    def __init__(self) -> None:
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._requests = FrameReader(max_body=1 << 30)

    def send(self, data: bytes, deadline: float | None = None) -> None:
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

    def _kill(self) -> None:
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
    """Answers ``get_archive``: ``open`` gets a transfer id, each ``next`` the next piece of
    ``data`` as long as asked, or what ``pieces`` yields (a reply header and a body; ``None``
    ends the stream, as a dying supervisor does); ``close`` is acknowledged."""

    def __init__(
        self, data: bytes = b"", pieces: Iterator[tuple[dict[str, object], bytes] | None] | None = None
    ) -> None:
        self._data = data
        self._pieces = pieces
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._requests = FrameReader(max_body=1 << 30)
        self.stages: list[str] = []

    def send(self, data: bytes, deadline: float | None = None) -> None:
        self._requests.feed(data)
        for header, _ in self._requests.frames():
            reply: dict[str, object] = {"id": header["id"], "ev": "done"}
            if header.get("op") == "ping":  # the host's check that we are alive
                self._replies.put(encode(reply))
                continue
            stage = str(header.get("stage"))
            self.stages.append(stage)
            body = b""
            if stage == "open":
                reply["tx"] = "t1"
            elif stage == "next" and self._pieces is not None:
                piece = next(self._pieces)
                if piece is None:
                    self._replies.put(b"")
                    return
                reply.update(piece[0])
                body = piece[1]
            elif stage == "next":
                body, self._data = self._data[: header["length"]], self._data[header["length"] :]
                reply["eof"] = not self._data
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


def sandbox_of(stream: ArchiveSupervisor, boundary: Boundary) -> Sandbox:
    instance = SupervisedInstance(
        id="liar", tier="fake", stream=stream, boundary=boundary, spec=SandboxSpec(), enforcement=NONE
    )
    return Sandbox(instance)


def test_a_download_arrives_in_pieces_of_the_size_asked(tmp_path: Path) -> None:
    data = tar_of(("a.bin", os.urandom(3 * TRANSFER_CHUNK)), ("b.txt", b"b"))
    stream = ArchiveSupervisor(data)
    result = sandbox_of(stream, Killed()).files.download_dir(tmp_path / "out")
    assert (tmp_path / "out" / "b.txt").read_bytes() == b"b"
    assert result.files == 2 and result.bytes_written == 3 * TRANSFER_CHUNK + 1
    assert stream.stages == ["open"] + ["next"] * 4


@pytest.mark.parametrize(
    "piece",
    [
        pytest.param(({"eof": False}, b"\0" * (TRANSFER_CHUNK + 1)), id="more-than-asked"),
        pytest.param(({"eof": False}, b""), id="nothing-but-not-the-end"),
        pytest.param(({"eof": False}, b"\0" * 512), id="a-trickle"),
    ],
)
def test_a_piece_not_as_asked_kills_the_sandbox(
    tmp_path: Path, piece: tuple[dict[str, object], bytes]
) -> None:
    boundary = Killed()
    stream = ArchiveSupervisor(pieces=itertools.repeat(piece))
    with pytest.raises(ProtocolError):
        sandbox_of(stream, boundary).files.download_dir(tmp_path / "out")
    assert boundary.killed and not (tmp_path / "out").exists()
    assert stream.stages.count("next") == 1


def test_a_stream_that_never_ends_is_stopped_by_the_host_and_closed(tmp_path: Path) -> None:
    head = tar_of(("a.txt", b"a"))
    endless = ArchiveSupervisor(head + b"\1" * (64 * TRANSFER_CHUNK))
    with pytest.raises(ProtocolError, match="after its end"):
        sandbox_of(endless, Killed()).files.download_dir(tmp_path / "out")
    assert endless.stages[-1] == "close" and endless.stages.count("next") == 1
    assert not (tmp_path / "out").exists()


def test_the_hosts_cap_stops_a_supervisor_that_ignores_it(tmp_path: Path) -> None:
    data = tar_of(*((f"f{i}", b"\0" * 1_000_000) for i in range(30)))
    stream = ArchiveSupervisor(data)
    (tmp_path / "out").mkdir()
    with pytest.raises(FileTooLarge):
        sandbox_of(stream, Killed()).files.download_dir(tmp_path / "out", max_bytes=10_000_000)
    # Stopped at the eleventh file, a third of the way: the rest is never asked for.
    assert stream.stages[-1] == "close" and stream.stages.count("next") == 3
    assert os.listdir(tmp_path / "out") == []


def test_a_supervisor_dying_mid_download_leaves_nothing(tmp_path: Path) -> None:
    data = tar_of(("a.bin", b"a" * TRANSFER_CHUNK), ("b.bin", b"b" * TRANSFER_CHUNK))
    pieces: Iterator[tuple[dict[str, object], bytes] | None] = iter(
        [({"eof": False}, data[:TRANSFER_CHUNK]), None]
    )
    (tmp_path / "out").mkdir()
    with pytest.raises(SandboxCrashed):
        sandbox_of(ArchiveSupervisor(pieces=pieces), Killed()).files.download_dir(tmp_path / "out")
    assert os.listdir(tmp_path / "out") == []


def test_a_snapshot_stops_a_supervisor_that_ignores_the_stores_room(tmp_path: Path) -> None:
    # The store's cap was checked only after the archive was whole on the host's disk: a
    # supervisor sending more than asked (or a sparse file's zeros) filled it well past the cap.
    store = SnapshotStore(tmp_path / "store", max_bytes=3 * TRANSFER_CHUNK)
    stream = ArchiveSupervisor(tar_of(*((f"f{i}", os.urandom(TRANSFER_CHUNK)) for i in range(16))))
    with pytest.raises(SnapshotError, match="is full"):
        sandbox_of(stream, Killed()).snapshot(memory=False, store=store)
    # Three chunks fill the store: the fourth is refused before it is written, the rest are
    # never asked for, and nothing is kept.
    assert stream.stages.count("next") == 4 and stream.stages[-1] == "close"
    kept = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and p.stat().st_size]
    assert [p.name for p in kept] == [".stockade-snapshot-store"]  # the store's own mark alone


# -- run_code reports ------------------------------------------------------------------------


class ForgedReport:
    """A supervisor passing on a run_code report that code in the sandbox wrote itself."""

    def __init__(self, report: bytes) -> None:
        self.report = report
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._requests = FrameReader(max_body=1 << 30)

    def send(self, data: bytes, deadline: float | None = None) -> None:
        self._requests.feed(data)
        for header, _ in self._requests.frames():
            self._replies.put(encode({"id": header["id"], "ev": "result", "duration": 0.1}, self.report))

    def recv(self) -> bytes:
        return self._replies.get()

    def close(self) -> None:
        self._replies.put(b"")


def test_a_forged_run_code_report_closes_the_sandbox_without_parsing_it() -> None:
    report = b'{"results":[' + b"{}," * 2_000_000 + b'{}],"error":null}'  # 6 MB: 2M empty results
    boundary = Killed()
    instance = SupervisedInstance(
        id="forger", tier="fake", stream=ForgedReport(report), boundary=boundary,
        spec=SandboxSpec(), enforcement=NONE,
    )  # fmt: skip
    with pytest.raises(ProtocolError, match="oversized run_code report"):
        instance.execute(RunCode(code="1"))
    assert boundary.killed


def test_a_report_over_the_byte_cap_never_reaches_the_parser() -> None:
    report = b'{"results":[{"text/plain":"' + b"x" * MAX_FRAME + b'"}]}'
    instance = SupervisedInstance(
        id="forger", tier="fake", stream=ForgedReport(report), boundary=Killed(),
        spec=SandboxSpec(), enforcement=NONE,
    )  # fmt: skip
    with pytest.raises(SandboxCrashed, match="frame too large"):
        instance.execute(RunCode(code="1"))
    assert not instance.alive


def test_a_legitimate_report_at_the_caps_is_accepted() -> None:
    bundle = {"text/plain": "'x'", "text/html": "<b>x</b>"}
    report = json.dumps({"results": [bundle] * MAX_RESULT_COUNT, "error": None}).encode()
    instance = SupervisedInstance(
        id="honest", tier="fake", stream=ForgedReport(report), boundary=Killed(),
        spec=SandboxSpec(), enforcement=NONE,
    )  # fmt: skip
    result = instance.execute(RunCode(code="1"))
    assert isinstance(result, Execution) and len(result.results) == MAX_RESULT_COUNT


# -- start ----------------------------------------------------------------------------------


class WrongGreeting(EndlessFile):
    """A supervisor whose first answer is not ``ready``."""

    def send(self, data: bytes, deadline: float | None = None) -> None:
        self._requests.feed(data)
        for header, _ in self._requests.frames():
            self._replies.put(encode({"id": header["id"], "ev": "done"}, b""))


def test_a_sandbox_that_does_not_start_is_closed_and_its_tiers_log_is_in_the_error() -> None:
    boundary = Killed()
    instance = SupervisedInstance(
        id="mute", tier="fake", stream=WrongGreeting(), boundary=boundary,
        spec=SandboxSpec(), enforcement=NONE,
    )  # fmt: skip
    with pytest.raises(exc.SandboxStartError, match=r"unexpected first reply.*: bwrap: no permission"):
        instance.start(dict, 5.0, None, log=lambda: "bwrap: no permission")
    assert boundary.killed and not instance.alive


def test_a_config_that_cannot_be_made_closes_the_sandbox_too() -> None:
    boundary = Killed()
    instance = SupervisedInstance(
        id="mute", tier="fake", stream=WrongGreeting(), boundary=boundary,
        spec=SandboxSpec(), enforcement=NONE,
    )  # fmt: skip

    def config() -> dict[str, object]:
        raise exc.LimitNotEnforceable("no such limit here")

    with pytest.raises(exc.LimitNotEnforceable):
        instance.start(config, 5.0, None, log=lambda: "")
    assert boundary.killed
