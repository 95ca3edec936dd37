"""The host never trusts what the in-sandbox supervisor says (it lives with the code)."""

from __future__ import annotations

import queue
import time

import pytest

from stockade import ProtocolError, SandboxCrashed
from stockade.sandbox._channel import Channel, JSONTooLarge, json_values, loads_bounded
from stockade.sandbox.supervisor.protocol import (
    MAX_EXEC_ARGV,
    MAX_EXEC_RECORDS,
    PREFIX,
    FrameError,
    FrameReader,
    encode,
    text_width,
)


class FakeStream:
    """A supervisor that answers with whatever the test scripts."""

    def __init__(self) -> None:
        self.incoming: queue.Queue[bytes] = queue.Queue()
        self.sent: list[bytes] = []

    def recv(self) -> bytes:
        return self.incoming.get()

    def send(self, data: bytes, deadline: float | None = None) -> None:
        self.sent.append(data)

    def close(self) -> None:
        self.incoming.put(b"")


def test_frames_round_trip_including_raw_bodies() -> None:
    reader = FrameReader(max_body=1024)
    body = bytes(range(256))
    reader.feed(encode({"id": 1, "name": "é\udcff"}, body)[:5])
    assert reader.frames() == []
    reader.feed(encode({"id": 1, "name": "é\udcff"}, body)[5:])
    [(header, got)] = reader.frames()
    assert header["id"] == 1 and got == body


@pytest.mark.parametrize(
    "evil",
    [
        PREFIX.pack(10, (1 << 32) - 1),  # a body larger than anything we accept
        PREFIX.pack(1 << 30, 0),  # a header larger than anything we accept
        PREFIX.pack(3, 0) + b"{{{",  # not JSON
        PREFIX.pack(2, 0) + b"[]",  # JSON, but not an object
        PREFIX.pack(4, 0) + b"\xff\xfe{}",  # not UTF-8
    ],
)
def test_malformed_frames_are_protocol_errors(evil: bytes) -> None:
    reader = FrameReader(max_body=1 << 20)
    reader.feed(evil)
    with pytest.raises(FrameError):
        reader.frames()


def test_a_lying_supervisor_kills_the_channel_not_the_host() -> None:
    stream = FakeStream()
    channel = Channel(stream, max_body=1024, name="test")
    call = channel.call({"op": "ping"})
    stream.incoming.put(PREFIX.pack(10, 1 << 30))  # claims a 1 GiB body
    with pytest.raises(SandboxCrashed, match="protocol violation"):
        call.result(time.monotonic() + 5)
    assert not channel.open
    with pytest.raises(SandboxCrashed):
        channel.call({"op": "ping"})


def test_frames_for_unknown_requests_are_ignored() -> None:
    stream = FakeStream()
    channel = Channel(stream, max_body=1024, name="test")
    call = channel.call({"op": "ping"})
    stream.incoming.put(encode({"id": 999, "ev": "done"}))  # forged answer to nobody
    stream.incoming.put(encode({"id": call.rid, "ev": "done", "pid": 7}))
    header, _ = call.result(time.monotonic() + 5)
    assert header["pid"] == 7


def test_a_silent_supervisor_times_out() -> None:
    channel = Channel(FakeStream(), max_body=1024, name="test")
    with pytest.raises(TimeoutError):
        channel.call({"op": "ping"}).result(time.monotonic() + 0.05)


def test_protocol_errors_are_not_retryable() -> None:
    assert not ProtocolError.retryable


# -- JSON bounded before it is parsed ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "values"),
    [
        (b'"a, b: [c] {d}"', 1),  # structure inside a string is text
        (b'"\\\\", ",", ","', 5),  # three strings, two commas: an escaped backslash ends no string early
        (b'"\\", [", 1', 2),  # an escaped quote opens none
        (b"[[],[],[]]", 6),
        (b'{"a":1,"b":[2,3]}', 8),
    ],
)
def test_json_values_are_counted_outside_strings(text: bytes, values: int) -> None:
    assert json_values(text, limit=values) <= values  # exactly as many: allowed
    assert json_values(text, limit=values - 1) > values - 1  # one fewer: refused


def test_a_flood_of_tiny_values_is_refused_before_parsing() -> None:
    flood = b'{"results":[' + b"{}," * 3_000_000 + b'{}],"error":null}'  # ~9 MB, 3M objects
    started = time.process_time()
    with pytest.raises(JSONTooLarge):
        loads_bounded(flood, max_bytes=1 << 30, max_values=100_000)
    assert time.process_time() - started < 1.0


@pytest.mark.parametrize(
    "flood",
    [
        b"[" + b'"ab",' * 1_000_000 + b'"ab"]',  # short strings, 1M of them
        b"[" + b"[]," * 1_000_000 + b"[]]",  # empty lists
        b"[" + b"1.5," * 1_000_000 + b"1]",  # floats
        b'["' + b"\\\\" * 1_000 + b'",' + b"[]," * 1_000_000,  # escapes, then invalid JSON
    ],
)
def test_every_kind_of_flood_is_refused(flood: bytes) -> None:
    with pytest.raises(JSONTooLarge):
        loads_bounded(flood, max_bytes=1 << 30, max_values=100_000)


def test_large_legitimate_payloads_pass_quickly() -> None:
    import base64
    import json

    image = base64.b64encode(bytes(range(256)) * 200_000).decode()  # ~68 MB of base64
    html = '<td class="x">a, b: [c]</td>\n' * 1_000_000  # commas, colons, quotes escaped
    for payload in (
        {"results": [{"text/plain": "x", "image/png": image}]},
        {"results": [{"text/html": html}]},
    ):
        raw = json.dumps(payload).encode()
        started = time.process_time()
        assert json_values(raw, limit=1_000) < 1_000
        assert time.process_time() - started < 1.0  # parsing itself takes longer
        assert loads_bounded(raw, max_bytes=1 << 30, max_values=1_000) == payload


def test_non_ascii_json_is_refused() -> None:
    # The supervisor escapes every non-ASCII character: anything else is not its output.
    with pytest.raises(ValueError):
        loads_bounded('["é"]'.encode(), max_bytes=100, max_values=10)
    with pytest.raises(ValueError):
        loads_bounded('["a"]'.encode("utf-16"), max_bytes=100, max_values=10)


def test_a_header_of_a_million_values_kills_the_channel() -> None:
    stream = FakeStream()
    channel = Channel(stream, max_body=1024, name="test")
    call = channel.call({"op": "ping"})
    head = b'{"id":' + str(call.rid).encode() + b',"ev":"done","x":[' + b"[]," * 300_000 + b"[]]}"
    stream.incoming.put(PREFIX.pack(len(head), 0) + head)
    with pytest.raises(SandboxCrashed, match="protocol violation"):
        call.result(time.monotonic() + 5)


def test_the_largest_exec_report_a_command_can_make_is_read() -> None:
    # A command that runs many programs under the policy's rules: its exit reports as many
    # exec records as the supervisor keeps, each with as many arguments as it keeps.
    stream = FakeStream()
    channel = Channel(stream, max_body=1024, name="test")
    call = channel.call({"op": "exec"})
    record = {"path": "/usr/bin/ls", "argv": ["a,b"] * MAX_EXEC_ARGV, "verdict": "allow", "rule": ""}
    execs = [record] * MAX_EXEC_RECORDS
    stream.incoming.put(encode({"id": call.rid, "ev": "exit", "execs": execs, "exec_count": 5000}))
    header, _ = call.result(time.monotonic() + 5)
    assert len(header["execs"]) == MAX_EXEC_RECORDS and channel.open


def test_an_escape_that_widens_the_text_counts_as_the_text_it_makes() -> None:
    # One escape past U+FFFF makes Python hold the whole string at four bytes a character:
    # 30 MB of JSON under a 100 MB cap would have been 120 MB of text.
    flood = b'["' + b"a" * 30_000_000 + b'\\ud83d\\ude00"]'
    with pytest.raises(JSONTooLarge):
        loads_bounded(flood, max_bytes=100_000_000, max_values=10)
    wide = b'["' + b"a" * 30_000_000 + b'\\u4e2d"]'  # two bytes a character: 60 MB, under it
    assert len(loads_bounded(wide, max_bytes=100_000_000, max_values=10)[0]) == 30_000_001
    # escapes themselves shrink when parsed: 6 bytes of JSON, one character
    cjk = b'["' + b"\\u4e2d" * 8_000_000 + b'"]'
    assert len(loads_bounded(cjk, max_bytes=100_000_000, max_values=10)[0]) == 8_000_000


@pytest.mark.parametrize(
    ("raw", "width"),
    [(b'"abc"', 1), (b'"\\u00e9"', 1), (b'"\\u0100"', 2), (b'"\\uffff"', 2), (b'"\\uD83D\\uDE00"', 4)],
)
def test_the_width_of_a_text_is_its_widest_escape(raw: bytes, width: int) -> None:
    assert text_width(raw) == width


def test_escaped_backslashes_do_not_pass_for_escapes_that_shrink_the_text() -> None:
    # `\\u` in JSON is a backslash and a "u" (two characters), no escape: counted as one, 45 MB
    # of them and an emoji passed for no text at all, and made 120 MB of it.
    flood = b'["' + b"\\\\u" * 15_000_000 + b'\\ud83d\\ude00"]'
    with pytest.raises(JSONTooLarge):
        loads_bounded(flood, max_bytes=100_000_000, max_values=10)
