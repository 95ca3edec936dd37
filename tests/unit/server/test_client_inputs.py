"""The service's clients check what they are given before any request, as the local SDK does:
a wrong value is a typed ``StockadeError`` naming the argument (never a ``UnicodeEncodeError``,
a JSON ``ValueError`` or an ``InvalidURL`` from the HTTP library), a caller's mistake is never
``ServiceUnavailable`` (retryable), and what the local SDK takes (``bytearray`` and
``memoryview`` data and stdin) is sent. The service is a recording ``httpx2.MockTransport``:
what is refused must not reach it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stockade import exceptions as exc
from stockade.client import AsyncClient, Client, RemoteSandbox

URL = "http://service"
TOKEN = "stk_0123456789ab_secret"
SANDBOX = {"id": "sbx-1", "tier": "process", "enforcement": {}, "state": "running"}


@dataclass
class Service:
    """Answers like the service where a test needs an answer, 404 elsewhere; keeps what came."""

    seen: list[httpx2.Request] = field(default_factory=list)

    def answer(self, request: httpx2.Request) -> httpx2.Response:
        body = request.read()  # as a socket would: a body that cannot be read fails here
        self.seen.append(request)
        path = request.url.path
        if request.method == "POST" and path == "/v1/sandboxes":
            return httpx2.Response(200, json=SANDBOX)
        if request.method == "POST" and path.endswith("/commands"):
            stdin = json.loads(body).get("stdin") or ""
            return httpx2.Response(
                200, json={"exit_code": 0, "stdout": stdin, "stderr": "", "duration_s": 0.0}
            )
        if request.method == "PUT" and path.endswith("/files/content"):
            entry = {"path": "f", "name": "f", "type": "file", "size": len(body), "mode": 420, "mtime": 0.0}
            return httpx2.Response(200, json=entry)
        if request.method == "DELETE" and path.startswith("/v1/sandboxes/"):
            return httpx2.Response(204)
        return httpx2.Response(404, json={"error": "ResourceNotFound", "detail": "nothing here"})

    def client(self, url: object = URL, token: object = TOKEN, **options: Any) -> Client:
        return Client(url, token, transport=httpx2.MockTransport(self.answer), **options)  # type: ignore[arg-type]

    def async_client(self) -> AsyncClient:
        return AsyncClient(URL, TOKEN, transport=httpx2.MockTransport(self.answer))


@pytest.fixture
def service() -> Service:
    return Service()


@pytest.fixture
def sbx(service: Service) -> RemoteSandbox:
    sandbox = service.client().sandbox("process")
    service.seen.clear()
    return sandbox


# -- each case the fuzzer found: refused, typed, before any request ---------------------------

S = "\udc80"  # a lone surrogate: a str Python holds, and no UTF-8 can carry
NAN, INF = float("nan"), float("inf")
LONG = "a/" * (32 * 1024)  # a workspace path of 64 KiB

Call = Callable[[RemoteSandbox], object]
REFUSED: dict[str, tuple[Call, str]] = {
    "run timeout_s=nan": (lambda s: s.commands.run("true", timeout_s=NAN), "timeout_s"),
    "run timeout_s=inf": (lambda s: s.commands.run("true", timeout_s=INF), "timeout_s"),
    "run_code timeout_s=nan": (lambda s: s.run_code("1", timeout_s=NAN), "timeout_s"),
    "run_code timeout_s=inf": (lambda s: s.run_code("1", timeout_s=INF), "timeout_s"),
    "read a surrogate path": (lambda s: s.files.read(S), "path"),
    "write a surrogate path": (lambda s: s.files.write(S, "x"), "path"),
    "list a surrogate path": (lambda s: s.files.list(S), "path"),
    "remove a surrogate path": (lambda s: s.files.remove(S), "path"),
    "stat a surrogate path": (lambda s: s.files.stat(S), "path"),
    "make_dir a surrogate path": (lambda s: s.files.make_dir(S), "path"),
    "read_range a surrogate path": (lambda s: s.files.read_range(S, 0, 1), "path"),
    "download_dir a surrogate source": (lambda s: s.files.download_dir(tempfile.gettempdir(), S), "path"),
    "a surrogate in argv": (lambda s: s.commands.run(["echo", S]), "cmd[1]"),
    "a surrogate in a shell line": (lambda s: s.commands.run(f"echo {S}"), "cmd"),
    "a surrogate in cwd": (lambda s: s.commands.run("pwd", cwd=S), "cwd"),
    "a surrogate in an env value": (lambda s: s.commands.run("env", envs={"A": S}), "envs['A']"),
    "a surrogate in an env name": (lambda s: s.commands.run("env", envs={S: "x"}), "envs"),
    "a surrogate in stdin": (lambda s: s.commands.run("cat", stdin=S), "stdin"),
    "stdin bytes that are not UTF-8": (lambda s: s.commands.run("cat", stdin=b"\xff"), "stdin"),
    "a surrogate in python code": (lambda s: s.run_code(f"print('{S}')"), "code"),
    "a surrogate in bash code": (lambda s: s.run_code(f"echo {S}", "bash"), "code"),
    "a surrogate in the language": (lambda s: s.run_code("1", S), "language"),
    "a surrogate in written text": (lambda s: s.files.write("f", S), "data"),
    "written data of no byte type": (lambda s: s.files.write("f", 5), "data"),  # type: ignore[arg-type]
    "a command of None": (lambda s: s.commands.run(None), "cmd"),  # type: ignore[arg-type]
    "stdin of an object": (lambda s: s.commands.run("cat", stdin=object()), "stdin"),  # type: ignore[arg-type]
    "a read_range offset of text": (lambda s: s.files.read_range("f", "a", 1), "offset"),  # type: ignore[arg-type]
    "a download into a NUL path": (lambda s: s.files.download_dir("out\x00"), "dest"),
    "an upload of no path": (lambda s: s.files.upload_dir(5), "source"),  # type: ignore[arg-type]
    "a sandbox of a surrogate tier": (lambda s: s.client.sandbox(S), "tier"),
    "a sandbox with a surrogate env": (lambda s: s.client.sandbox("process", envs={"A": S}), "envs['A']"),
    "runs.get of a surrogate": (lambda s: s.client.runs.get(S), "run_id"),
    "delete_snapshot of a NUL": (lambda s: s.client.delete_snapshot("\x00"), "snapshot"),
    "delete_workspace of '..'": (lambda s: s.client.delete_workspace(".."), "workspace_id"),
    "resume of a NUL": (lambda s: RemoteSandbox.resume("a\x00", client=s.client), "sandbox_id"),
    # an acceptance check that cannot run: the service queued it, failing when the run ended
    "a check holding a NUL": (
        lambda s: s.client.runs.submit("t", check="true\x00base64 /etc/hostname"),
        "check",
    ),
    "an empty check": (lambda s: s.client.runs.submit("t", check=""), "check"),
    "a check of spaces": (lambda s: s.client.runs.submit("t", check="  "), "check"),
    # a path of 64 KiB was an httpx2.InvalidURL ("query too long"), no StockadeError
    "read a 64 KiB path": (lambda s: s.files.read(LONG), "path"),
    "write a 64 KiB path": (lambda s: s.files.write(LONG, "x"), "path"),
    "list a 64 KiB path": (lambda s: s.files.list(LONG), "path"),
    "read_range a 64 KiB path": (lambda s: s.files.read_range(LONG, 0, 1), "path"),
    "download_dir a 64 KiB source": (lambda s: s.files.download_dir(tempfile.gettempdir(), LONG), "path"),
}


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_a_bad_argument_is_refused_typed_before_any_request(
    service: Service, sbx: RemoteSandbox, case: str
) -> None:
    call, argument = REFUSED[case]
    with pytest.raises(exc.ConfigurationError) as caught:
        call(sbx)
    assert not caught.value.retryable
    assert getattr(caught.value, "argument", argument) == argument, str(caught.value)
    assert service.seen == []


def test_the_longest_path_a_file_system_takes_is_sent(service: Service, sbx: RemoteSandbox) -> None:
    longest = ("d" * 254 + "/") * 16 + "d" * 16  # PATH_MAX: 4096 bytes, no name past 255
    sbx.files.write(longest, "x")
    assert len(service.seen) == 1
    with pytest.raises(exc.InvalidArgument, match="4097 bytes"):
        sbx.files.write(longest + "e", "x")  # one byte past it
    assert len(service.seen) == 1


def test_an_upload_into_a_64_kib_path_is_refused_before_its_folder_is_read(
    service: Service, sbx: RemoteSandbox, tmp_path: Path
) -> None:
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(exc.InvalidArgument) as caught:
        sbx.files.upload_dir(tmp_path, LONG)
    assert caught.value.argument == "dest" and service.seen == []


CLIENTS: dict[str, tuple[Callable[[Service], object], str]] = {
    "a url of no http(s)": (lambda s: s.client("not a url"), "url"),
    "a url that is an int": (lambda s: s.client(5), "url"),
    "a url with a NUL": (lambda s: s.client("http://127.0.0.1:1\x00"), "url"),
    "a url with no port that can exist": (lambda s: s.client("http://127.0.0.1:99999"), "url"),
    "a token with a surrogate": (lambda s: s.client(token=S), "token"),
    "a token with a newline": (lambda s: s.client(token="a\nb"), "token"),
    "a timeout of nan": (lambda s: s.client(timeout_s=NAN), "timeout_s"),
}


@pytest.mark.parametrize("case", CLIENTS, ids=str)
def test_a_bad_url_token_or_timeout_is_a_mistake_not_an_unreachable_service(
    service: Service, case: str
) -> None:
    make, argument = CLIENTS[case]
    with pytest.raises(exc.InvalidArgument) as caught:
        make(service)
    assert not caught.value.retryable and caught.value.argument == argument
    assert TOKEN not in str(caught.value)


def test_the_url_and_token_from_the_environment_are_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOCKADE_URL", "127.0.0.1:8080")
    monkeypatch.setenv("STOCKADE_TOKEN", TOKEN)
    with pytest.raises(exc.InvalidArgument, match="STOCKADE_URL"):
        Client()


# -- what the local SDK accepts is sent --------------------------------------------------------


@pytest.mark.parametrize(
    "data", [bytearray(b"hi\x00\xff"), memoryview(b"hi\x00\xff")], ids=lambda d: type(d).__name__
)
def test_written_bytearray_and_memoryview_data_is_sent_as_its_bytes(
    service: Service, sbx: RemoteSandbox, data: bytearray | memoryview
) -> None:
    assert sbx.files.write("f", data).size == 4  # type: ignore[arg-type]
    assert service.seen[-1].content == b"hi\x00\xff"


@pytest.mark.parametrize(
    "stdin",
    [bytearray(b"caf\xc3\xa9"), memoryview(b"caf\xc3\xa9"), b"caf\xc3\xa9"],
    ids=["bytearray", "memoryview", "bytes"],  # a memoryview's repr holds its address: one id a worker
)
def test_stdin_as_bytes_bytearray_or_memoryview_is_sent_as_its_text(
    sbx: RemoteSandbox, stdin: bytes | bytearray | memoryview
) -> None:
    assert sbx.commands.run("cat", stdin=stdin).stdout == "café"  # type: ignore[arg-type]


def test_an_id_goes_as_one_url_segment_whatever_it_holds(service: Service, sbx: RemoteSandbox) -> None:
    with pytest.raises(exc.ResourceNotFound):
        sbx.client.delete_workspace("?a=b#")
    with pytest.raises(exc.ResourceNotFound):
        sbx.client.runs.get("../../x")
    assert [r.url.raw_path for r in service.seen] == [b"/v1/workspaces/%3Fa%3Db%23", b"/v1/runs/..%2F..%2Fx"]


def test_the_async_client_checks_the_same(service: Service) -> None:
    async def main() -> list[str]:
        refused: list[str] = []
        async with service.async_client() as client:
            sbx = await client.sandbox("process")
            service.seen.clear()
            for call in (
                lambda: sbx.commands.run("true", timeout_s=NAN),
                lambda: sbx.files.read(S),
                lambda: sbx.files.download_dir(tempfile.gettempdir(), S),
                lambda: sbx.run_code(f"echo {S}", "bash"),
                lambda: client.delete_snapshot("\x00"),
                lambda: client.runs.get(S),
                lambda: client.runs.submit("t", check="true\x00id"),
            ):
                with pytest.raises(exc.InvalidArgument) as caught:
                    await call()
                refused.append(caught.value.argument)
            assert service.seen == []
            assert (await sbx.files.write("f", bytearray(b"ab"))).size == 2  # type: ignore[arg-type]
            assert (await sbx.commands.run("cat", stdin=memoryview(b"ok"))).stdout == "ok"  # type: ignore[arg-type]
            await sbx.close()
        return refused

    assert asyncio.run(main()) == ["timeout_s", "path", "path", "code", "snapshot", "run_id", "check"]


# -- whatever it is given, the client raises the SDK's errors alone ----------------------------

texts = st.one_of(
    st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=12),
    st.sampled_from(
        ["", ".", "..", "/etc/passwd", "/workspace/a", "a\x00b", S, "\ud800x", "?a=b#", "a/../.."]
    ),
)


def viewed(raw: bytes) -> memoryview:
    return memoryview(raw)


anything = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), texts, st.binary(max_size=8),
    st.binary(max_size=8).map(bytearray), st.binary(max_size=8).map(viewed), st.just(object()),
    st.lists(texts, max_size=3), st.lists(st.integers(), max_size=2),
    st.dictionaries(texts, texts, max_size=2), st.dictionaries(st.integers(), st.none(), max_size=1),
)  # fmt: skip


def calls(data: st.DataObject, sbx: RemoteSandbox) -> Callable[[], object]:
    a, b, c, d = (data.draw(anything) for _ in range(4))
    files, run, client = sbx.files, sbx.commands.run, sbx.client
    return data.draw(
        st.sampled_from([
            lambda: files.read(a), lambda: files.read(a, format=b), lambda: files.read_range(a, b, c),
            lambda: files.write(a, b, mode=c), lambda: files.list(a, depth=b), lambda: files.stat(a),
            lambda: files.exists(a), lambda: files.remove(a), lambda: files.make_dir(a),
            lambda: files.download_dir(tempfile.gettempdir(), a, max_bytes=b, max_entries=c),
            lambda: run(a), lambda: run(a, cwd=b, envs=c, timeout_s=d), lambda: run("cat", stdin=a),
            lambda: sbx.run_code(a), lambda: sbx.run_code(a, b, timeout_s=c),
            lambda: client.sandbox(a, envs=b, labels=c, idle_timeout_s=d), lambda: client.runs.get(a),
            lambda: client.runs.delete(a), lambda: client.runs.list(status=a, label=b, limit=c),
            lambda: client.delete_snapshot(a), lambda: client.delete_workspace(a),
            lambda: RemoteSandbox.resume(a, client=client), lambda: client.runs.submit(a, tier=b, labels=c),
        ])
    )  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_error_of_a_public_call_on_any_input_is_a_stockade_error(
    sbx: RemoteSandbox, data: st.DataObject
) -> None:
    call = calls(data, sbx)
    with contextlib.suppress(exc.StockadeError):  # anything else fails the test
        call()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(url=anything, token=anything, timeout=anything)
def test_a_client_made_of_anything_is_made_or_refused_typed(
    service: Service, url: object, token: object, timeout: object
) -> None:
    try:
        service.client(url or "http://x", token or TOKEN, timeout_s=timeout).sandboxes()
    except exc.StockadeError as error:
        assert not isinstance(error, exc.ServiceUnavailable), error


def test_a_wait_that_ends_before_the_run_is_a_typed_timeout_and_its_figures_are_checked() -> None:
    """It raised the builtin TimeoutError (no StockadeError, no retryable), and a NaN timeout
    a ValueError from time.sleep."""
    run = {"run_id": "run-1", "status": "running"}
    transport = httpx2.MockTransport(lambda request: httpx2.Response(200, json=run))
    with Client(URL, TOKEN, transport=transport) as client:
        remote = client.runs.get("run-1")
        with pytest.raises(exc.RunWaitTimeout) as raised:
            remote.wait(timeout_s=0.05, poll_s=0.01)
        assert raised.value.retryable and isinstance(raised.value, TimeoutError)
        for timeout_s, poll_s in ((NAN, 0.01), (1.0, INF), (-1.0, 0.01)):
            with pytest.raises(exc.InvalidArgument):
                remote.wait(timeout_s=timeout_s, poll_s=poll_s)
