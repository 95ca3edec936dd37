"""The remote SDK against a service that lies (a real HTTP server in this process, answering
each path with what a test gives it): whatever it sends, nothing is written outside the
destination of ``artifacts()``, what is written is capped, the client's memory and time stay
bounded, and every failure is a ``StockadeError`` that says whether retrying helps."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import tarfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from stockade import exceptions as exc
from stockade.client import AsyncClient, AsyncRemoteSandbox, Client, RemoteSandbox
from stockade.client._http import PACE_BYTES
from stockade.client.client import EventLines, RunEvent
from stockade.runs.seeds import pack_workspace
from stockade.types import ExecRecord
from tests.hostile_archives import escaping_tar

TOKEN = "stk_" + "a" * 40
RUN = json.dumps({"run_id": "r1", "status": "success"}).encode()

Answer = Callable[[BaseHTTPRequestHandler], None]


@dataclass
class Service:
    """What the fake service answers, by path (the query left out); ``sent``: the bytes of
    bodies it got out to the client, ``done``: set when an answer ended."""

    url: str = ""
    answers: dict[str, Answer] = field(default_factory=dict)
    hits: list[str] = field(default_factory=list)
    sent: int = 0
    done: threading.Event = field(default_factory=threading.Event)


def body(data: bytes, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> Answer:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    return answer


def chunked(pieces: Iterator[bytes], service: Service, status: int = 200) -> Answer:
    """A body sent in chunks as ``pieces`` yields them, counted in ``service.sent``, until the
    client hangs up."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        try:
            for piece in pieces:
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                handler.wfile.flush()
                service.sent += len(piece)
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client hung up: what it is meant to do
        finally:
            service.done.set()

    return answer


@pytest.fixture
def service() -> Iterator[Service]:
    found = Service()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            found.hits.append(path)
            found.answers.get(path, body(b'{"error": "ResourceNotFound"}', 404))(self)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.do_GET()

    class Quiet(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a client that hung up on a hostile answer, as the tests make it: no traceback

    server = Quiet(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    found.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield found
    server.shutdown()
    server.server_close()


def artifacts(
    service: Service, dest: Path, *, use_async: bool, timeout_s: float = 120.0, **limits: int
) -> Path:
    """``client.runs.get("r1").artifacts(dest)``, on the sync or the async client."""
    service.answers.setdefault("/v1/runs/r1", body(RUN))
    if not use_async:
        with Client(service.url, TOKEN, timeout_s=timeout_s) as client:
            return client.runs.get("r1").artifacts(dest, **limits)

    async def fetch() -> Path:
        client = AsyncClient(service.url, TOKEN, timeout_s=timeout_s)
        try:
            return await (await client.runs.get("r1")).artifacts(dest, **limits)
        finally:
            await client.aclose()

    import asyncio

    return asyncio.run(fetch())


both = pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])


@both
def test_an_archive_that_beats_tarfiles_filter_writes_nothing_outside_dest(
    service: Service, tmp_path: Path, use_async: bool
) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "flag").write_text("original\n")
    dest = tmp_path / "dest"
    service.answers["/v1/runs/r1/artifacts"] = body(escaping_tar(dest))
    with pytest.raises(exc.StockadeError):
        artifacts(service, dest, use_async=use_async)
    assert (tmp_path / "outside" / "flag").read_text() == "original\n"
    assert sorted(os.listdir(tmp_path / "outside")) == ["flag"]
    assert not dest.exists()  # all or nothing: the folder it made is gone again


@both
def test_two_runs_unpacked_into_one_folder_cannot_combine_into_a_way_out(
    service: Service, tmp_path: Path, use_async: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 1's code leaves a symlink chain that climbs out of its workspace, past PATH_MAX
    once its links are expanded; run 2's code a folder of the same name with a file in it.
    The service packs both as it packs any run's; the client unpacks them into one folder."""
    monkeypatch.chdir(tmp_path)  # the workspaces by short names: their long paths fit PATH_MAX
    first, second = Path("w1"), Path("w2")
    first.mkdir()
    here, steps, long = first, "abcdefghijklmnop", "d" * 239
    for step in steps:
        (here / long).mkdir()
        (here / step).symlink_to(long)
        here = here / long
    climb = os.path.join(*steps, "l" * 220)
    os.symlink(os.path.join(*[".."] * len(steps)), first / climb)
    os.symlink(os.path.join(climb, "..", ".."), first / "escape")
    (second / "escape" / "outside").mkdir(parents=True)
    (second / "escape" / "outside" / "pwned").write_text("run 2's code\n")
    (tmp_path / "outside").mkdir()
    dest = tmp_path / "client" / "out"
    for workspace in (first, second):
        service.answers["/v1/runs/r1/artifacts"] = body(pack_workspace(workspace).data)
        artifacts(service, dest, use_async=use_async)
    assert os.listdir(tmp_path / "outside") == []
    assert (dest / "escape" / "outside" / "pwned").read_text() == "run 2's code\n"
    assert not (dest / "escape").is_symlink()  # run 1's link out was left out


def gzip_bomb(megabytes: int) -> bytes:
    """A tar.gz of one file of zeros: about a thousandth of its size on the wire."""
    info = tarfile.TarInfo("bomb.bin")
    info.size = megabytes << 20
    squeeze = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [squeeze.compress(info.tobuf(tarfile.GNU_FORMAT))]
    out += [squeeze.compress(bytes(1 << 20)) for _ in range(megabytes)]
    out += [squeeze.compress(bytes(1024)), squeeze.flush()]
    return b"".join(out)


@both
def test_a_compressed_bomb_stops_at_max_bytes_with_nothing_left_behind(
    service: Service, tmp_path: Path, use_async: bool
) -> None:
    bomb = gzip_bomb(16)
    assert len(bomb) < 64 * 1024
    service.answers["/v1/runs/r1/artifacts"] = body(bomb)
    with pytest.raises(exc.FileTooLarge):
        artifacts(service, tmp_path / "out", use_async=use_async, max_bytes=1 << 20)
    assert not (tmp_path / "out").exists()


@both
def test_a_runs_artifacts_as_the_service_packs_them_come_through(
    service: Service, tmp_path: Path, use_async: bool
) -> None:
    workspace = tmp_path / "ws"
    (workspace / "src").mkdir(parents=True)
    (workspace / "src" / "app.py").write_text("print('v2')\n")
    (workspace / "venv-python").symlink_to("/usr/bin/python3")  # a link out: left out
    service.answers["/v1/runs/r1/artifacts"] = body(pack_workspace(workspace).data)
    out = artifacts(service, tmp_path / "out", use_async=use_async)
    assert (out / "src" / "app.py").read_text() == "print('v2')\n"
    assert not os.path.lexists(out / "venv-python")


@both
def test_a_gzip_cut_short_is_the_services_answer_refused(
    service: Service, tmp_path: Path, use_async: bool
) -> None:
    """The service packed the artifacts: the error names it, not a sandbox."""
    whole = gzip.compress(pack_workspace(tmp_path).data)  # any gzip, cut in the middle
    service.answers["/v1/runs/r1/artifacts"] = body(whole[: len(whole) // 2])
    with pytest.raises(exc.ServiceError, match=r"^the service at .* a malformed archive: the gzip") as raised:
        artifacts(service, tmp_path / "out", use_async=use_async)
    assert not raised.value.retryable  # the same request gets the same archive
    assert "sandbox" not in str(raised.value)
    assert not (tmp_path / "out").exists()


# -- answers that would grow the client's memory, or hold it forever ---------------------


def endless(piece: bytes, total: int) -> Iterator[bytes]:
    """``total`` bytes in pieces: far more than the client may gather."""
    for _ in range(total // len(piece)):
        yield piece


def get_run(service: Service, *, use_async: bool, timeout_s: float = 120.0) -> object:
    if not use_async:
        with Client(service.url, TOKEN, timeout_s=timeout_s) as client:
            return client.runs.get("r1")

    async def fetch() -> object:
        client = AsyncClient(service.url, TOKEN, timeout_s=timeout_s)
        try:
            return await client.runs.get("r1")
        finally:
            await client.aclose()

    import asyncio

    return asyncio.run(fetch())


@both
def test_an_error_whose_body_never_ends_is_read_only_as_far_as_a_problem_goes(
    service: Service, use_async: bool
) -> None:
    service.answers["/v1/runs/r1"] = chunked(endless(b"x" * 65536, 256 << 20), service, status=500)
    with pytest.raises(exc.ServiceUnavailable) as raised:
        get_run(service, use_async=use_async)
    assert raised.value.retryable
    assert service.done.wait(30)
    assert service.sent < 64 << 20  # the client hung up: what it took is in socket buffers


@both
def test_a_body_that_drips_ends_at_the_clients_timeout(service: Service, use_async: bool) -> None:
    """httpx's read timeout is per piece: a byte every 0.1 s never trips a 1 s one."""
    service.answers["/v1/runs/r1"] = chunked(drip(), service)
    with pytest.raises(exc.ServiceUnavailable, match=r"did not answer within 1\.0 s"):
        get_run(service, use_async=use_async, timeout_s=1.0)


def drip(pieces: int = 100, piece: bytes = b" ", every_s: float = 0.1) -> Iterator[bytes]:
    """``pieces`` pieces, one every ``every_s``: ten seconds of a byte at a time by default."""
    for _ in range(pieces):
        time.sleep(every_s)
        yield piece


def trickle(data: bytes) -> Iterator[bytes]:
    """``data``, a byte every 0.1 s."""
    for at in range(len(data)):
        time.sleep(0.1)
        yield data[at : at + 1]


def read_file(service: Service, *, use_async: bool, timeout_s: float) -> bytes:
    """``sbx.files.read("a.txt", format="bytes")`` on the sync or the async client."""
    info = {"id": "sbx_1", "tier": "process", "state": "running"}
    if not use_async:
        with Client(service.url, TOKEN, timeout_s=timeout_s) as client:
            return RemoteSandbox(client, info).files.read("a.txt", format="bytes")

    async def fetch() -> bytes:
        client = AsyncClient(service.url, TOKEN, timeout_s=timeout_s)
        try:
            return await AsyncRemoteSandbox(client, info).files.read("a.txt", format="bytes")
        finally:
            await client.aclose()

    import asyncio

    return asyncio.run(fetch())


CONTENT = "/v1/sandboxes/sbx_1/files/content"


@both
def test_a_file_whose_content_drips_ends_at_the_clients_timeout(service: Service, use_async: bool) -> None:
    """A file's content may take longer than ``timeout_s``, not a byte at a time: it must
    keep coming at ``PACE_BYTES`` per ``timeout_s``."""
    service.answers[CONTENT] = chunked(drip(), service)
    with pytest.raises(exc.ServiceUnavailable, match=r"less than 65,536 bytes in 1\.0 s") as raised:
        read_file(service, use_async=use_async, timeout_s=1.0)
    assert raised.value.retryable
    assert service.done.wait(30)
    assert service.sent < 100  # it ended while the service still had bytes to send


@both
def test_a_file_that_keeps_coming_is_read_past_the_timeout(service: Service, use_async: bool) -> None:
    """A large body on a slow link is no drip: twelve pieces of ``PACE_BYTES``, 0.2 s apart,
    take longer than a 1 s ``timeout_s`` and are read whole."""
    service.answers[CONTENT] = chunked(drip(12, b"x" * PACE_BYTES, every_s=0.2), service)
    assert read_file(service, use_async=use_async, timeout_s=1.0) == b"x" * PACE_BYTES * 12


@both
def test_artifacts_that_drip_end_at_the_clients_timeout_with_nothing_left_behind(
    service: Service, tmp_path: Path, use_async: bool
) -> None:
    stored = gzip.compress(bytes(400), compresslevel=0)  # a gzip stream, sent a byte at a time
    service.answers["/v1/runs/r1/artifacts"] = chunked(trickle(stored), service)
    with pytest.raises(exc.ServiceUnavailable, match="less than 65,536 bytes"):
        artifacts(service, tmp_path / "out", use_async=use_async, timeout_s=1.0)
    assert service.done.wait(30)
    assert service.sent < len(stored)  # it ended while the service still had bytes to send
    assert not (tmp_path / "out").exists()


def dripped_head(service: Service, length: int = 200) -> Answer:
    """A status line and headers a byte every 0.05 s: ten seconds of a head."""
    head = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * length + b"\r\nContent-Length: 2\r\n\r\n{}"

    def answer(handler: BaseHTTPRequestHandler) -> None:
        try:
            for byte in head:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                service.sent += 1
                time.sleep(0.05)
        except OSError:
            pass
        finally:
            service.done.set()

    return answer


@both
def test_a_head_that_drips_ends_at_the_clients_timeout(service: Service, use_async: bool) -> None:
    """httpx's read timeout is per piece on the head too; sync and async end it by ``timeout_s``."""
    service.answers["/v1/runs/r1"] = dripped_head(service)
    with pytest.raises(exc.ServiceUnavailable, match=r"did not answer within 1\.0 s"):
        get_run(service, use_async=use_async, timeout_s=1.0)
    assert service.done.wait(30)
    assert service.sent < 200  # of its 249 bytes: it ended while the service still had more to send


def zeros(megabytes: int) -> bytes:
    """``[0,0,...]``: parsed, each two bytes a list item (a 256 MiB one took 1.5 GiB)."""
    return b"[" + b"0," * ((megabytes << 19) - 1) + b"0]"


@both
def test_a_json_answer_is_refused_past_a_few_mib_not_parsed(service: Service, use_async: bool) -> None:
    service.answers["/v1/runs/r1"] = chunked(iter([zeros(1)] * 64), service)
    with pytest.raises(exc.ServiceError, match="a body over 8,388,608 bytes"):
        get_run(service, use_async=use_async)
    assert service.done.wait(30)
    assert service.sent < 64 << 20  # the client hung up at the cap: what it took is in socket buffers


def run_command(service: Service, *, use_async: bool, output_bytes: int, stream: bool) -> Any:
    """``sbx.commands.run("make")`` on a sandbox whose ``output_bytes`` the service gave."""
    info = {"id": "sbx_1", "tier": "process", "state": "running", "limits": {"output_bytes": output_bytes}}
    seen: list[str] = []
    on_stdout = seen.append if stream else None
    if not use_async:
        with Client(service.url, TOKEN) as client:
            return RemoteSandbox(client, info).commands.run("make", on_stdout=on_stdout)

    async def call() -> Any:
        client = AsyncClient(service.url, TOKEN)
        try:
            return await AsyncRemoteSandbox(client, info).commands.run("make", on_stdout=on_stdout)
        finally:
            await client.aclose()

    import asyncio

    return asyncio.run(call())


def command_answer(stdout: str, *, stream: bool) -> bytes:
    result = {"exit_code": 0, "stdout": stdout, "stderr": stdout, "duration_s": 0.1}
    if stream:
        return json.dumps({"type": "result", "result": result}).encode() + b"\n"
    return json.dumps(result).encode()


@both
@pytest.mark.parametrize("stream", [False, True], ids=["answer", "ndjson"])
def test_a_commands_result_may_be_as_large_as_the_sandboxs_output_bytes_make_it(
    service: Service, use_async: bool, stream: bool
) -> None:
    """Its stdout and stderr are each up to ``output_bytes``, six bytes of JSON a byte at
    worst (``\\u0000``): past ``ANSWER_MAX_BYTES``, and read whole."""
    stdout = "\x00" * (1 << 20)  # 6 MiB of JSON each
    service.answers["/v1/sandboxes/sbx_1/commands"] = body(command_answer(stdout, stream=stream))
    result = run_command(service, use_async=use_async, output_bytes=1 << 20, stream=stream)
    assert result.stdout == stdout


@both
@pytest.mark.parametrize("stream", [False, True], ids=["answer", "ndjson"])
def test_a_commands_result_past_what_output_bytes_allows_is_refused(
    service: Service, use_async: bool, stream: bool
) -> None:
    service.answers["/v1/sandboxes/sbx_1/commands"] = body(command_answer("x" * (9 << 20), stream=stream))
    with pytest.raises(exc.ServiceError, match="over 8,407,040 bytes"):  # 8 MiB and 18 x 1 KiB
        run_command(service, use_async=use_async, output_bytes=1024, stream=stream)


def test_a_line_of_a_stream_is_refused_past_its_limit_not_gathered() -> None:
    from stockade.client._http import Lines  # what every stream's lines go through

    lines = Lines("http://service", limit=1024)
    assert lines.feed(b"data: {}\r\n\ndata: [") == ["data: {}", ""]
    with pytest.raises(exc.ServiceError, match="a line of a stream over 1,024 bytes"):
        for _ in range(10):
            lines.feed(b"x" * 200)


def test_an_event_of_many_data_lines_is_refused_past_its_limit() -> None:
    events = EventLines("http://service", limit=1024)
    with pytest.raises(exc.ServiceError, match="an event over 1,024 bytes"):
        for _ in range(10):
            events.feed("data: " + "x" * 200)


def test_an_event_split_over_many_tiny_data_lines_comes_whole() -> None:
    """200,000 data lines of one character each: one event, its data as sent (gathered, and
    joined once at its end: added to a string line by line, a million such lines took
    minutes of the client's CPU)."""
    text = json.dumps({"pad": "x" * 199_990})
    events = EventLines("http://service", max_lines=len(text))
    assert all(events.feed(f"data: {char}") is None for char in text)
    event = events.feed("")
    assert event is not None and event.data == {"pad": "x" * 199_990}
    assert events.feed('data: {"next": 1}') is None and events.feed("") == RunEvent(
        kind="message", seq=0, data={"next": 1}
    )  # nothing of the one before left over


def test_an_event_of_more_data_lines_than_any_of_the_service_is_refused() -> None:
    """Empty data lines add no byte against the event's limit, yet each is held: past the
    number of lines an event may have, the stream is refused, as one over its bytes is."""
    events = EventLines("http://service")
    with pytest.raises(exc.ServiceError, match="an event of more than 65,536 data lines") as raised:
        for _ in range(1_000_000):
            events.feed("data:")
    assert raised.value.retryable is False


@both
def test_a_run_id_the_service_gives_stays_one_segment_of_the_runs_paths(
    service: Service, use_async: bool
) -> None:
    """A run's id comes from the service: one that holds ``/`` and ``..`` names that run still,
    percent-encoded, never another resource (a sandbox's kill)."""
    hostile = "../sandboxes/sbx_1"
    service.answers["/v1/runs/r1"] = body(json.dumps({"run_id": hostile, "status": "running"}).encode())
    service.answers["/v1/sandboxes/sbx_1/kill"] = body(
        json.dumps({"run_id": "r1", "status": "killed"}).encode()
    )

    async def kill_async() -> None:
        client = AsyncClient(service.url, TOKEN)
        try:
            await (await client.runs.get("r1")).kill()
        finally:
            await client.aclose()

    with pytest.raises(exc.ResourceNotFound):
        if use_async:
            asyncio.run(kill_async())
        else:
            with Client(service.url, TOKEN) as client:
                client.runs.get("r1").kill()
    assert service.hits == ["/v1/runs/r1", "/v1/runs/..%2Fsandboxes%2Fsbx_1/kill"]


@both
def test_a_sandbox_id_the_service_gives_stays_one_segment_of_its_paths(
    service: Service, use_async: bool
) -> None:
    service.answers["/v1/runs/r1/kill"] = body(RUN)  # what the id would reach, as a path

    async def kill_async() -> None:
        client = AsyncClient(service.url, TOKEN)
        try:
            await AsyncRemoteSandbox(client, {"id": "../runs/r1"}).kill()
        finally:
            await client.aclose()

    with pytest.raises(exc.ResourceNotFound):
        if use_async:
            asyncio.run(kill_async())
        else:
            with Client(service.url, TOKEN) as client:
                RemoteSandbox(client, {"id": "../runs/r1"}).kill()
    assert service.hits == ["/v1/sandboxes/..%2Fruns%2Fr1/kill"]


@pytest.mark.parametrize(
    "line", ["id: 1e9999", "data: [1]", "data: {not json"], ids=["id", "not-an-object", "not-json"]
)
def test_an_event_that_is_not_one_is_a_service_error(line: str) -> None:
    events = EventLines("http://service")
    with pytest.raises(exc.ServiceError, match="cannot use"):
        events.feed(line)
        events.feed("data: {}" if line.startswith("id") else "")
        events.feed("")


# -- answers that are not what the call expects -----------------------------------------


ODD = {
    "429 with a 5,000-digit Retry-After": (
        body(b"{}", 429, (("Retry-After", "9" * 5000),)), exc.RateLimited, True,
    ),
    "retry_after 1e400": (
        body(b'{"error": "RateLimited", "detail": "slow down", "retry_after": 1' + b"0" * 400 + b"}", 429),
        exc.RateLimited, True,
    ),
    "200 that is not JSON": (body(b"{not json"), exc.ServiceError, False),
    "307 to another host": (
        body(b"", 307, (("Location", "http://127.0.0.1:9/v1/x"),)), exc.ServiceError, False,
    ),
    "a run without its run_id": (body(b'{"status": "success"}'), exc.ServiceError, False),
    "a run that is a list": (body(b"[1, 2]"), exc.ServiceError, False),
}  # fmt: skip


@both
@pytest.mark.parametrize("case", list(ODD))
def test_an_odd_answer_is_a_typed_error_that_says_whether_retrying_helps(
    service: Service, case: str, use_async: bool
) -> None:
    answer, expected, retryable = ODD[case]
    service.answers["/v1/runs/r1"] = answer
    with pytest.raises(exc.StockadeError) as raised:
        get_run(service, use_async=use_async)
    assert type(raised.value) is expected
    assert raised.value.retryable is retryable
    assert raised.value.retry_after is None  # no wait a caller could sleep
    assert service.hits == ["/v1/runs/r1"]  # the redirect was not followed


@both
@pytest.mark.parametrize(
    "result",
    [{"exit_code": 0, "stdout": ""}, []],
    ids=["fields left out", "not an object"],
)
def test_a_commands_result_the_client_cannot_use_is_a_service_error(
    service: Service, use_async: bool, result: object
) -> None:
    """A hostile or broken service's result: a typed error, not the TypeError or KeyError of
    building the value from it."""
    service.answers["/v1/sandboxes/sbx_1/commands"] = body(json.dumps(result).encode())
    with pytest.raises(exc.ServiceError, match="cannot use") as raised:
        run_command(service, use_async=use_async, output_bytes=1024, stream=False)
    assert raised.value.retryable is False


@both
def test_the_execs_a_result_lists_come_back_as_exec_records(service: Service, use_async: bool) -> None:
    """A command's result lists what the sandbox's rules judged: as the local SDK gives them
    (``ExecRecord``s, argv a tuple), not the JSON's dicts and lists."""
    judged = {
        "path": "/usr/bin/rm",
        "argv": ["rm", "-r", "x"],
        "verdict": "refuse",
        "rule": "commands.approve: rm -r",
    }
    result = {
        "exit_code": 126,
        "stdout": "",
        "stderr": "",
        "duration_s": 0.1,
        "execs": [judged],
        "execs_omitted": 2,
    }
    service.answers["/v1/sandboxes/sbx_1/commands"] = body(json.dumps(result).encode())
    got = run_command(service, use_async=use_async, output_bytes=1024, stream=False)
    assert got.execs == (ExecRecord(path="/usr/bin/rm", argv=("rm", "-r", "x"), verdict="refuse",
                                    rule="commands.approve: rm -r"),)  # fmt: skip
    assert got.execs_omitted == 2
