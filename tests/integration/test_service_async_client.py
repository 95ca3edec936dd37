"""``AsyncRemoteSandbox`` against real ``stockade serve`` (uvicorn on 127.0.0.1, embedded):
``AsyncSandbox``'s surface over HTTP, output streamed while it runs, many sandboxes on one
event loop, kills, and the SDK's errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from stockade import Limits
from stockade import exceptions as exc
from stockade.client import AsyncClient, AsyncRemoteSandbox
from tests.conftest import require_tier, wait_for_async
from tests.integration.service_env import Server, Tokens, write_tenants

pytestmark = [pytest.mark.process]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens]]:
    require_tier("process")
    folder = tmp_path_factory.mktemp("service")
    tenants, tokens = write_tenants(folder, sandboxes=6, memory_mb=6 * 256)
    server = Server(tenants, f"sqlite:///{folder / 'service.db'}", folder)
    try:
        yield server, tokens
    finally:
        server.stop()
    assert server.proc.returncode in (0, -15), server.output()[-3000:]
    assert "Traceback" not in server.output(), server.output()[-3000:]


@pytest.fixture
async def client(service: tuple[Server, Tokens]) -> AsyncIterator[AsyncClient]:
    server, tokens = service
    async with AsyncClient(server.url, tokens.acme) as opened:
        yield opened
    async with AsyncClient(server.url, tokens.acme) as check:
        assert await check.sandboxes() == []  # every test closed what it made


LIMITS = Limits(memory_mb=256, timeout_s=30)


async def test_an_async_remote_sandbox_is_an_async_sandbox(client: AsyncClient, tmp_path: Path) -> None:
    async with await AsyncRemoteSandbox.create(tier="process", limits=LIMITS, client=client) as sbx:
        assert sbx.tier == "process" and sbx.enforcement.memory
        chunks: list[tuple[float, str]] = []
        result = await sbx.commands.run(
            "for i in 1 2 3; do echo $i; sleep 0.3; done; echo oops >&2; exit 3",
            on_stdout=lambda text: chunks.append((time.monotonic(), text)),
        )
        assert result.exit_code == 3 and result.stdout == "1\n2\n3\n" and result.stderr == "oops\n"
        assert "".join(t for _, t in chunks) == "1\n2\n3\n"
        assert chunks[-1][0] - chunks[0][0] > 0.4  # streamed while it ran, not at the end
        assert (await sbx.commands.run(["cat"], stdin=b"bytes in")).stdout == "bytes in"
        assert (await sbx.run_code("x = 41")).error is None
        assert (await sbx.run_code("x + 1")).text == "42"  # state persists between calls
        errors: list[str] = []
        failed = await sbx.run_code("import sys; print('e', file=sys.stderr); 1/0", on_stderr=errors.append)
        assert (
            failed.error is not None and failed.error.name == "ZeroDivisionError" and "".join(errors) == "e\n"
        )
        assert (await sbx.run_code("echo 42", "bash")).logs.stdout == "42\n"
        await sbx.files.write("src/a.py", "print('hi')\n")
        assert await sbx.files.read("src/a.py") == "print('hi')\n"
        assert await sbx.files.read("src/a.py", format="bytes") == b"print('hi')\n"
        assert [e.name for e in await sbx.files.list("src")] == ["a.py"]
        assert await sbx.files.exists("src/a.py") and not await sbx.files.exists("nope")
        assert (await sbx.files.make_dir("d/e")).type.value == "dir"
        (tmp_path / "up" / "d").mkdir(parents=True)
        (tmp_path / "up" / "d" / "f.txt").write_text("data")
        (tmp_path / "up" / "secret.env").write_text("TOKEN=x")
        await sbx.files.upload_dir(tmp_path / "up", "up", hide=["**/*.env"])
        got = await sbx.files.download_dir(tmp_path / "down", "up")
        assert got.files == 1 and (tmp_path / "down" / "d" / "f.txt").read_text() == "data"
        assert not (tmp_path / "down" / "secret.env").exists()
        await sbx.files.remove("src/a.py")
        with pytest.raises(exc.SandboxFileNotFound):
            await sbx.files.read("src/a.py")
        with pytest.raises(exc.PathEscapeError) as escaped:
            await sbx.files.write("../outside.txt", "x")
        assert escaped.value.path == "../outside.txt"
        await sbx.reset()
        assert await sbx.files.list("") == []
    with pytest.raises(exc.ResourceNotFound):
        await client.http.request("GET", f"/v1/sandboxes/{sbx.id}")
    await sbx.close()  # twice: nothing


async def test_a_download_over_its_cap_leaves_nothing(client: AsyncClient, tmp_path: Path) -> None:
    async with await client.sandbox("process", limits=LIMITS) as sbx:
        await sbx.commands.run("head -c 300000 /dev/zero > big.bin")
        with pytest.raises(exc.FileTooLarge):
            await sbx.files.download_dir(tmp_path / "out", max_bytes=100_000)
        assert not (tmp_path / "out").exists()


async def test_many_sandboxes_on_one_event_loop_run_at_once(client: AsyncClient) -> None:
    sandboxes = await asyncio.gather(*(client.sandbox("process", limits=LIMITS) for _ in range(4)))
    try:
        started = time.monotonic()
        results = await asyncio.gather(*(s.run_code(f"import time; time.sleep(1.5); {i}") for i, s in
                                         enumerate(sandboxes)))  # fmt: skip
        elapsed = time.monotonic() - started
        assert [r.text for r in results] == ["0", "1", "2", "3"]
        assert elapsed < 4.5, elapsed  # together, not one after the other (6 s)
    finally:
        await asyncio.gather(*(s.close() for s in sandboxes))


async def test_a_kill_from_another_task_stops_a_command_in_flight(client: AsyncClient) -> None:
    sbx = await client.sandbox("process", limits=LIMITS)
    try:
        lines: list[str] = []
        running = asyncio.create_task(sbx.commands.run("echo started; sleep 30", on_stdout=lines.append))
        await wait_for_async(lambda: lines, what="the command's first line", timeout_s=15, interval_s=0.05)
        started = time.monotonic()
        await sbx.kill()
        with pytest.raises(exc.SandboxError):
            await asyncio.wait_for(running, 15)
        assert time.monotonic() - started < 10
        with pytest.raises(exc.SandboxClosed):
            await sbx.run_code("1")
    finally:
        await sbx.close()


async def test_quota_and_role_refusals_are_the_sdks_errors(service: tuple[Server, Tokens]) -> None:
    server, tokens = service
    async with AsyncClient(server.url, tokens.acme) as client:
        with pytest.raises(exc.QuotaExceeded) as quota:
            await client.sandbox("process", limits=Limits(memory_mb=4096))
        assert quota.value.quota == "memory_mb"
        with pytest.raises(exc.PolicyDenied) as denied:
            await client.sandbox("docker")
        assert "process" in str(denied.value)
    async with AsyncClient(server.url, "stk_000000000000_" + "x" * 40) as stranger:
        with pytest.raises(exc.AuthenticationError):
            await stranger.sandbox("process")
    async with AsyncClient("http://127.0.0.1:9", tokens.acme, timeout_s=2) as nowhere:
        with pytest.raises(exc.ServiceUnavailable):
            await nowhere.sandboxes()


async def test_without_a_client_one_is_made_from_the_environment_and_closed_with_the_sandbox(
    service: tuple[Server, Tokens], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, tokens = service
    monkeypatch.setenv("STOCKADE_URL", server.url)
    monkeypatch.setenv("STOCKADE_TOKEN", tokens.acme)
    async with await AsyncRemoteSandbox.create("process", limits=LIMITS) as sbx:
        assert (await sbx.run_code("6 * 7")).text == "42"
    assert sbx.client.http._client.is_closed
    monkeypatch.delenv("STOCKADE_TOKEN")
    with pytest.raises(exc.InvalidArgument) as missing:
        await AsyncRemoteSandbox.create("process")
    assert missing.value.argument == "token"


def test_the_readme_async_example_runs(
    service: tuple[Server, Tokens], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    server, tokens = service
    monkeypatch.setenv("STOCKADE_URL", server.url)
    monkeypatch.setenv("STOCKADE_TOKEN", tokens.acme)
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = next(b.split("```", 1)[0] for b in readme.split("```python\n") if "AsyncRemoteSandbox as" in b)
    exec(compile(block, "README.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == ["streamed", "42"]


async def test_a_run_through_the_async_client(client: AsyncClient, tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "app.py").write_text("print('v1')\n")
    turns = [
        {"name": "write_file", "args": {"path": "app.py", "content": "print('v2')\n"}},
        {"name": "run_code", "args": {"code": "rm -r build; true", "language": "bash"}},
        "updated app.py",
    ]
    run = await client.runs.submit("update app.py", scripted=turns, workspace=tmp_path / "project",
                                   labels={"team": "async"})  # fmt: skip
    kinds = [event.kind async for event in run.events()]
    assert kinds[0] == "status" and kinds[-1] == "end" and "approval" in kinds
    assert (await run.wait()).status == "paused"
    [request] = (await run.refresh()).info["pending_approvals"]
    assert "rm -r" in request["action"]
    await run.approve(request["id"])
    done = await run.wait()
    assert done.status == "success" and done.info["answer"] == "updated app.py"
    assert [a["status"] for a in await run.approvals()] == ["spent"]  # the yes let its action go, once
    assert "+print('v2')" in await run.diff()
    assert ((await run.artifacts(tmp_path / "out")) / "app.py").read_text() == "print('v2')\n"
    assert [r.id for r in await client.runs.list(label="team=async")] == [run.id]
    assert (await client.runs.get(run.id)).status == "success"
    await run.delete()  # erased, its bytes free of the tenant's storage_mb
    with pytest.raises(exc.ResourceNotFound):
        await client.runs.get(run.id)
    with pytest.raises(exc.ResourceNotFound):
        await client.runs.delete(run.id)


async def test_a_kill_all_through_the_async_client_ends_a_waiting_run(client: AsyncClient) -> None:
    turns = [{"name": "run_code", "args": {"code": "rm -r nothing", "language": "bash"}}, "never"]
    run = await client.runs.submit("wait for an approval", scripted=turns)
    assert (await run.wait()).status == "paused"
    killed = await client.runs.kill_all("incident")
    assert [(k["run_id"], k["where"]) for k in killed] == [(run.id, "paused")]
    assert (await run.refresh()).status == "killed"
