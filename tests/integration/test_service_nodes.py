"""Several API processes on one PostgreSQL: two real ``stockade serve`` (uvicorn on 127.0.0.1),
one sandbox driven through both (the one that does not hold it forwards, streams included),
and a process SIGKILLed: its sandboxes answer ``SandboxGone`` and their quota is free."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from stockade import Limits
from stockade import exceptions as exc
from stockade.client import AsyncClient, AsyncRemoteSandbox, Client, RemoteSandbox
from tests.conftest import require_tier, wait_for_async
from tests.integration.service_env import Server, Tokens, postgres_schema, write_tenants

pytestmark = [pytest.mark.process, pytest.mark.postgres, pytest.mark.slow]
LIMITS = Limits(memory_mb=256, timeout_s=60)


@dataclass
class Pair:
    a: Server
    b: Server
    tokens: Tokens
    folder: Path


@contextlib.contextmanager
def started_pair(folder: Path, database: str) -> Iterator[Pair]:
    require_tier("process")
    tenants, tokens = write_tenants(folder, sandboxes=3, memory_mb=3 * 256)
    a = Server(tenants, database, folder)
    try:
        b = Server(tenants, database, folder)
    except BaseException:
        a.stop()
        raise
    try:
        yield Pair(a=a, b=b, tokens=tokens, folder=folder)
    finally:
        b.stop()
        a.stop()
    assert "Traceback" not in b.output(), b.output()[-3000:]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Two processes kept for the module's tests (a start of both is seconds): each test closes
    what it opened, so the next finds the tenant's quota whole and no sandbox of the last."""
    with postgres_schema() as database, started_pair(tmp_path_factory.mktemp("nodes"), database) as both:
        yield both


@pytest.fixture
def own_pair(tmp_path: Path, postgres_url: str) -> Iterator[Pair]:
    """Two processes of the test's own: for a test that kills one."""
    with started_pair(tmp_path, postgres_url) as both:
        yield both


def test_one_sandbox_is_driven_through_both_processes(pair: Pair, tmp_path: Path) -> None:
    with Client(pair.a.url, pair.tokens.acme) as via_a, Client(pair.b.url, pair.tokens.acme) as via_b:
        made = RemoteSandbox.create("process", limits=LIMITS, client=via_a)
        there = RemoteSandbox(via_b, made.info)  # the same sandbox, asked through B
        try:
            assert made.run_code("x = 41").error is None
            assert there.run_code("x + 1").text == "42"  # one interpreter, whichever process is asked
            chunks: list[tuple[float, str]] = []
            result = there.commands.run(
                "for i in 1 2 3; do echo $i; sleep 0.4; done; exit 4",
                on_stdout=lambda text: chunks.append((time.monotonic(), text)),
            )
            assert result.exit_code == 4 and "".join(t for _, t in chunks) == "1\n2\n3\n"
            assert chunks[-1][0] - chunks[0][0] > 0.5  # streamed through the hop, not gathered
            there.files.write("notes/b.txt", "written through B")
            assert made.files.read("notes/b.txt") == "written through B"
            (tmp_path / "up").mkdir()
            (tmp_path / "up" / "big.bin").write_bytes(bytes(range(256)) * 20_000)  # a 5 MB body up
            there.files.upload_dir(tmp_path / "up", "up")
            got = there.files.download_dir(tmp_path / "down", "up")
            assert (
                got.files == 1 and (tmp_path / "down" / "big.bin").read_bytes() == bytes(range(256)) * 20_000
            )
            with pytest.raises(exc.PathEscapeError):  # the owner's problem, passed back as it was
                there.files.read("../etc/passwd")
            with pytest.raises(exc.SandboxFileNotFound):
                there.files.read("nope.txt")
            listed = via_b.sandboxes()
            assert [s["id"] for s in listed] == [made.id] and listed[0]["state"] == "running"
            assert via_b.http.request("GET", f"/v1/sandboxes/{made.id}").json()["tier"] == "process"
            with Client(pair.b.url, pair.tokens.other) as other:
                with pytest.raises(exc.ResourceNotFound):  # another tenant's, through either process
                    other.http.request("GET", f"/v1/sandboxes/{made.id}")
                with pytest.raises(exc.ResourceNotFound):
                    RemoteSandbox(other, made.info).run_code("1")
                assert other.sandboxes() == []
            # a command in flight through B, killed through A: B's stream ends with the error
            failure: list[BaseException] = []

            def long_command() -> None:
                try:
                    there.commands.run("sleep 60", on_stdout=lambda _: None)
                except BaseException as error:
                    failure.append(error)

            thread = threading.Thread(target=long_command)
            thread.start()
            time.sleep(1.0)
            started = time.monotonic()
            made.kill()
            thread.join(20)
            assert not thread.is_alive() and time.monotonic() - started < 15
            assert failure and isinstance(failure[0], exc.SandboxError), failure
            assert via_b.http.request("GET", f"/v1/sandboxes/{made.id}").json()["state"] == "killed"
        finally:
            there.close()  # deleted through B
        for client in (via_a, via_b):
            with pytest.raises(exc.ResourceNotFound):
                client.http.request("GET", f"/v1/sandboxes/{made.id}")
        made.close()  # already deleted: nothing
        assert via_a.sandboxes() == [] and via_b.sandboxes() == []
        assert via_b.verify_audit()["ok"]


async def test_the_async_client_goes_through_the_other_process_too(pair: Pair) -> None:
    with Client(pair.a.url, pair.tokens.acme) as via_a:
        made = RemoteSandbox.create("process", limits=LIMITS, client=via_a)
        try:
            async with AsyncClient(pair.b.url, pair.tokens.acme) as via_b:
                there = AsyncRemoteSandbox(via_b, made.info)
                lines: list[str] = []
                result = await there.commands.run("echo one; echo two", on_stdout=lines.append)
                assert result.stdout == "one\ntwo\n" and "".join(lines) == "one\ntwo\n"
                await there.close()
            with pytest.raises(exc.ResourceNotFound):
                via_a.http.request("GET", f"/v1/sandboxes/{made.id}")
        finally:
            made.close()


def _sleeping(sandbox: RemoteSandbox) -> int:
    """How many ``sleep 61`` the sandbox runs (the line the pattern is on is not one)."""
    count = (
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -cx 'sleep 6[1] '"
    )
    return int(sandbox.commands.run(["sh", "-c", count]).stdout.strip() or 0)


async def test_a_call_forwarded_to_the_owner_is_stopped_there_when_its_client_goes(pair: Pair) -> None:
    with Client(pair.a.url, pair.tokens.acme) as via_a:
        made = RemoteSandbox.create("process", limits=LIMITS, client=via_a)
        try:
            # streamed through B, its task cancelled
            async with AsyncClient(pair.b.url, pair.tokens.acme) as via_b:
                there = AsyncRemoteSandbox(via_b, made.info)
                task = asyncio.create_task(there.commands.run(["sleep", "61"], on_stdout=print))
                await wait_for_async(lambda: _sleeping(made) == 1, what="the sleep to start", interval_s=0.2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await wait_for_async(
                lambda: _sleeping(made) == 0, what="the sleep to stop", timeout_s=20, interval_s=0.2
            )
            # not streamed, through B, its client out of patience after a second
            with (
                Client(pair.b.url, pair.tokens.acme, timeout_s=1.0) as impatient,
                pytest.raises(exc.StockadeError),
            ):
                RemoteSandbox(impatient, made.info).commands.run(["sleep", "61"], timeout_s=50)
            await wait_for_async(
                lambda: _sleeping(made) == 0, what="the sleep to stop", timeout_s=20, interval_s=0.2
            )
            assert made.commands.run(["echo", "still here"]).stdout == "still here\n"
        finally:
            made.close()


def test_a_dead_process_sandboxes_are_gone_and_their_quota_free(own_pair: Pair) -> None:
    pair = own_pair
    with Client(pair.a.url, pair.tokens.acme) as via_a, Client(pair.b.url, pair.tokens.acme) as via_b:
        on_a = [RemoteSandbox.create("process", limits=LIMITS, client=via_a) for _ in range(2)]
        on_b = RemoteSandbox.create("process", limits=LIMITS, client=via_b)
        with pytest.raises(exc.QuotaExceeded):  # 3 of 3, whichever process is asked
            RemoteSandbox.create("process", limits=LIMITS, client=via_b)
        assert sorted(s["id"] for s in via_b.sandboxes()) == sorted([on_b.id, *(s.id for s in on_a)])
        pair.a.kill_group()  # the whole process, with its sandboxes: no cleanup
        pair.a.proc.wait(10)
        started = time.monotonic()
        lost = RemoteSandbox(via_b, on_a[0].info)
        with pytest.raises(exc.SandboxGone) as gone:
            lost.run_code("1")
        assert gone.value.id == on_a[0].id and isinstance(gone.value, exc.SandboxClosed)
        assert gone.value.problem["status"] == 410  # type: ignore[attr-defined]
        with pytest.raises(exc.SandboxGone):
            via_b.http.request("GET", f"/v1/sandboxes/{on_a[1].id}")
        assert time.monotonic() - started < 5  # on this machine, a dead pid is seen at once
        # the quota the dead process held is free: two more fit beside the one on B
        more = [RemoteSandbox.create("process", limits=LIMITS, client=via_b) for _ in range(2)]
        assert sorted(s["id"] for s in via_b.sandboxes()) == sorted([on_b.id, *(s.id for s in more)])
        assert on_b.run_code("6 * 7").text == "42"  # B's own sandbox never noticed
        lost.close()  # closing a gone sandbox: nothing to do, no error
        with pytest.raises(exc.SandboxGone):  # still gone, not "not found", while it is remembered
            via_b.http.request("DELETE", f"/v1/sandboxes/{on_a[0].id}")
        for sbx in [on_b, *more]:
            sbx.close()
        # another tenant: not found, as ever
        with Client(pair.b.url, pair.tokens.other) as other, pytest.raises(exc.ResourceNotFound):
            other.http.request("GET", f"/v1/sandboxes/{on_a[0].id}")
        assert via_b.verify_audit()["ok"]


def test_a_forwarded_request_is_refused_without_the_peers_key(pair: Pair) -> None:
    with Client(pair.a.url, pair.tokens.acme) as via_a:
        made = RemoteSandbox.create("process", limits=LIMITS, client=via_a)
        try:
            # a client claiming to be a peer is not forwarded, and gains nothing: B does not hold it
            forged = httpx2.get(
                f"{pair.b.url}/v1/sandboxes/{made.id}",
                headers={"Authorization": f"Bearer {pair.tokens.acme}", "x-stockade-hop": "guess"},
            )
            assert forged.status_code == 404 and forged.json()["error"] == "ResourceNotFound"
        finally:
            made.close()
