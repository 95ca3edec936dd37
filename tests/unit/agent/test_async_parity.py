"""The async API answers as the sync one does: a callback checked before it is wrapped, what it
raises propagated, a store or backend of the wrong kind refused by name; a run whose task is
cancelled ends interrupted in its trail and its run store, as a kill switch's interrupt does."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade import AsyncSandbox, Sandbox
from stockade.agent import RunStatus
from stockade.assembly import AgentConfig, build_agent
from stockade.cli.main import app
from stockade.exceptions import InvalidArgument
from stockade.models import ScriptedModel, tool_call
from stockade.policy import Policy
from stockade.policy.schema import TrustRules
from stockade.runs import open_run_store
from stockade.sandbox.base import WrapperBackend
from stockade.sandbox.ops import RunCode
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.types import CommandResult, Execution, Trust


def fake() -> FakeBackend:
    return FakeBackend(lambda op: CommandResult(exit_code=0, stdout="out\n", stderr="", duration_s=0.0))


@pytest.mark.parametrize("threaded", [True, False], ids=["blocking backend", "async backend"])
def test_an_async_callback_is_checked_before_it_is_wrapped_and_what_it_raises_propagates(
    threaded: bool,
) -> None:
    def boom(text: str) -> None:
        raise RuntimeError(f"callback refused {text!r}")

    with Sandbox.create(backend=fake()) as sbx:
        with pytest.raises(InvalidArgument, match="on_stdout must be callable"):
            sbx.run_code("print(1)", language="bash", on_stdout=5)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="callback refused"):
            sbx.commands.run("echo out", on_stdout=boom)

    async def main() -> None:
        # a blocking backend's output comes from a worker thread, an async one's from the loop's
        sbx = await AsyncSandbox.create(backend=WrapperBackend(fake()) if threaded else fake())
        with pytest.raises(InvalidArgument, match="on_stdout must be callable"):
            await sbx.run_code("print(1)", language="bash", on_stdout=5)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="on_stderr must be callable"):
            await sbx.commands.run("echo out", on_stderr="print")  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="callback refused 'out\\\\n'"):
            await sbx.commands.run("echo out", on_stdout=boom)
        seen: list[str] = []
        assert (await sbx.commands.run("echo out", on_stdout=seen.append)).exit_code == 0
        assert seen == ["out\n"]
        assert sbx.alive and repr(sbx) == f"<AsyncSandbox {sbx.id} tier=fake alive=True>"
        await sbx.close()
        assert not sbx.alive and "alive=False" in repr(sbx)

    asyncio.run(main())


def test_a_store_or_a_backend_of_the_wrong_kind_is_refused_by_name() -> None:
    with Sandbox.create(backend=fake()) as sbx:
        for call in (sbx.snapshot, sbx.pause):
            with pytest.raises(InvalidArgument, match="store must be a SnapshotStore") as caught:
                call(store="x")  # type: ignore[arg-type]
            assert caught.value.argument == "store"
    with pytest.raises(InvalidArgument, match="store must be a SnapshotStore"):
        Sandbox.resume("sbx-1", store="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="tier='process'") as refused:
        Sandbox.create(backend="process")  # type: ignore[arg-type]
    assert refused.value.argument == "backend"
    with pytest.raises(InvalidArgument, match=r"instance of it \(FakeBackend\(\)\)"):
        Sandbox.create(backend=FakeBackend)  # type: ignore[arg-type]

    async def main() -> None:
        sbx = await AsyncSandbox.create(backend=fake())
        for call in (sbx.snapshot, sbx.pause):
            with pytest.raises(InvalidArgument, match="store must be a SnapshotStore"):
                await call(store="x")  # type: ignore[arg-type]
        await sbx.close()
        with pytest.raises(InvalidArgument, match="store must be a SnapshotStore"):
            await AsyncSandbox.resume("sbx-1", store="x")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="tier='docker'"):
            await AsyncSandbox.create(backend="docker")  # type: ignore[arg-type]

    asyncio.run(main())


def test_a_run_whose_task_is_cancelled_mid_call_ends_interrupted_in_its_trail(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    running, release = threading.Event(), threading.Event()

    def code(op: RunCode) -> Execution:  # runs until released: a call to cancel the run in
        running.set()
        release.wait(30)
        return Execution()

    cfg = AgentConfig(
        model=ScriptedModel(
            [tool_call("run_code", {"code": "import time; time.sleep(60)", "language": "python"}), "done"]
        ),
        policy=Policy(trust=TrustRules(level=Trust.TRUSTED)),
        backend=FakeBackend(MemoryWorkspace(code=code), tier="process"),
        audit=db,
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
    )

    async def main() -> None:
        with build_agent(cfg) as agent:
            task = asyncio.create_task(agent.run("wait", run_id="cut"))
            await asyncio.to_thread(running.wait, 30)
            task.cancel()
            try:
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                release.set()

    asyncio.run(main())
    with open_run_store(db) as store:
        summary = store.summary("cut")
        assert summary is not None and summary.status == RunStatus.INTERRUPTED
    verified = CliRunner().invoke(app, ["audit", "verify", "--db", db, "--runs-db", db])
    assert verified.exit_code == 0, verified.output
    assert "intact" in verified.output and "in_flight" not in verified.output


def test_long_text_written_from_a_coroutine_is_checked_and_encoded_as_the_sync_write_does() -> None:
    # past a MiB it is encoded in a worker thread, a slice at a time
    text = "é" * (3 << 19) + "€ end"

    async def main() -> None:
        sbx = await AsyncSandbox.create(backend=FakeBackend(MemoryWorkspace()))
        await sbx.files.write("long.txt", text)
        assert await sbx.files.read("long.txt") == text
        with pytest.raises(InvalidArgument, match="lone surrogate") as refused:
            await sbx.files.write("bad.txt", text + "\udc80")
        assert refused.value.argument == "data" and not await sbx.files.exists("bad.txt")
        await sbx.close()

    asyncio.run(main())
