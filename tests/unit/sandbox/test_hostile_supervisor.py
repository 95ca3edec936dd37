"""The host's side of the channel against a supervisor that lies (it lives with the code)."""

from __future__ import annotations

import json
import queue

import pytest

from stockade import ProtocolError, SandboxCrashed
from stockade.sandbox._supervised import MAX_FRAME, TRANSFER_CHUNK, Boundary, SupervisedInstance
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.kernel.protocol import MAX_RESULT_COUNT, FrameReader, encode
from stockade.sandbox.ops import ReadFile, RunCode
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


class ForgedReport:
    """A supervisor passing on a run_code report that code in the sandbox wrote itself."""

    def __init__(self, report: bytes) -> None:
        self.report = report
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._requests = FrameReader(max_body=1 << 30)

    def send(self, data: bytes) -> None:
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
