"""A cancelled ``AsyncSandbox`` call is cut as a Ctrl-C cuts a sync one, before its task's
``CancelledError`` goes on. Each call ran in a worker thread nothing stopped: a cancelled
write landed seconds later over a newer one, a cancelled run_code ran on to its timeout (the
next call waited for it), a Ctrl-C held ``asyncio.run`` for as long, and a cancelled create
left its sandbox running until garbage collection. The threads were the loop's default
executor's: long calls held them all, and every other call waited, its cancel too."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stockade import AsyncSandbox, Sandbox
from stockade.sandbox import _guest
from tests.conftest import require_tier

ROOT = Path(__file__).resolve().parents[2]


def _descendants() -> int:
    """Processes under this one (a process-tier sandbox is a tree of them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = 0, [os.getpid()]
    while todo:
        kids = children.get(todo.pop(), [])
        found += len(kids)
        todo += kids
    return found


async def test_a_cancelled_write_lands_nothing_after_its_cancel() -> None:
    async with await AsyncSandbox.create("process") as sbx:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sbx.files.write("f", b"OLD" * (30 << 20)), 0.02)
        await sbx.files.write("f", b"NEW")
        await asyncio.sleep(2)  # the old write, left running, landed within this
        assert await sbx.files.read("f", format="bytes") == b"NEW"
        assert [e.name for e in await sbx.files.list("")] == ["f"]  # no temporary file


async def test_a_cancelled_run_code_ends_with_its_cancel() -> None:
    async with await AsyncSandbox.create("process") as sbx:
        code = "import time\nfor i in range(300):\n    open('tick', 'a').write('.'); time.sleep(0.2)\n"
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sbx.run_code(code, timeout_s=60), 0.5)
        assert time.monotonic() - started < 10  # the run killed inside, not left to its timeout
        ticks = await sbx.files.read("tick", format="bytes")
        started = time.monotonic()
        await sbx.run_code("x = 1")
        assert time.monotonic() - started < 10  # the sandbox is idle: nothing to wait for
        await asyncio.sleep(1)
        assert await sbx.files.read("tick", format="bytes") == ticks  # the cancelled run writes no more


async def test_a_cancelled_command_is_killed_with_its_cancel() -> None:
    async with await AsyncSandbox.create("process") as sbx:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sbx.commands.run("sleep 321", timeout_s=60), 0.5)
        left = await sbx.commands.run("ps -eo args")
        assert "sleep 321" not in left.stdout


def _scarce_default_executor() -> None:
    """The application's default executor cut to two threads (a two-core host has six):
    stockade's calls must need none of it."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))


async def test_long_calls_on_one_sandbox_hold_up_no_other_call() -> None:
    """Each call held a thread of the loop's default executor: six long commands on one
    sandbox made an echo on another wait 9.5 s, and the application's own ``to_thread``."""
    _scarce_default_executor()
    async with await AsyncSandbox.create("process") as busy, await AsyncSandbox.create("process") as idle:
        long = [asyncio.create_task(busy.commands.run("sleep 30", timeout_s=60)) for _ in range(4)]
        await asyncio.sleep(0.5)
        quick = await asyncio.wait_for(idle.commands.run("echo quick"), 20)
        same = await asyncio.wait_for(busy.commands.run("echo same"), 20)
        own = await asyncio.wait_for(asyncio.to_thread(lambda: "own"), 20)
        assert (quick.stdout, same.stdout, own) == ("quick\n", "same\n", "own")
        assert not any(task.done() for task in long)  # answered while the long ones still ran
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)


async def test_a_call_cancelled_while_others_run_ends_with_its_cancel() -> None:
    """``wait_for(..., 1)`` on a call queued behind long ones raised only once they ended
    (14.5 s): the cancel waited for a job that had not started."""
    _scarce_default_executor()
    async with await AsyncSandbox.create("process") as sbx:
        long = [asyncio.create_task(sbx.commands.run("sleep 30", timeout_s=60)) for _ in range(4)]
        await asyncio.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sbx.commands.run("sleep 321", timeout_s=60), 1)
        assert time.monotonic() - started < 10  # not once the long ones end (30 s)
        assert not any(task.done() for task in long)
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)


async def test_a_cancelled_create_leaves_no_sandbox_running() -> None:
    await (await AsyncSandbox.create("process")).close()  # whatever a first start keeps
    before = _descendants()
    for delay in (0.001, 0.02, 0.05, 0.1, 0.2, 0.4):
        try:
            sbx = await asyncio.wait_for(AsyncSandbox.create("process"), delay)
        except TimeoutError:
            continue
        await sbx.close()
    assert _descendants() <= before  # at once: not left for the garbage collector


async def test_a_cancelled_docker_create_leaves_no_container() -> None:
    require_tier("docker")
    token = _guest.current_creator().token
    for delay in (0.05, 0.3):
        try:
            sbx = await asyncio.wait_for(AsyncSandbox.create("docker"), delay)
        except TimeoutError:
            continue
        await sbx.close()
    argv = ["docker", "ps", "-aq", "--filter", f"label=stockade.creator={token}"]
    assert subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split() == []


def test_ctrl_c_ends_asyncio_run_with_calls_in_flight() -> None:
    """Three run_code calls of 75 s each: the Ctrl-C's KeyboardInterrupt came after 75 s."""
    script = textwrap.dedent(
        """
        import asyncio, time
        from stockade import AsyncSandbox

        async def main():
            sbxs = await asyncio.gather(*[AsyncSandbox.create("process") for _ in range(3)])
            print("ready", flush=True)
            await asyncio.gather(*[s.run_code("import time; time.sleep(600)", timeout_s=75) for s in sbxs])

        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    ) as child:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        child.send_signal(signal.SIGINT)
        started = time.monotonic()
        try:
            out, _ = child.communicate(timeout=30)
        finally:
            child.kill()
        assert out.strip() == "interrupted"
        assert time.monotonic() - started < 30
        assert child.returncode == 0


def test_a_ctrl_c_in_a_sync_run_code_ends_the_run_inside() -> None:
    """The sync twin: the interrupt reached the caller at once, but the run went on to its
    timeout inside, and the next call waited for it."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with Sandbox.create("process") as sbx:
            code = "import time\nfor i in range(300):\n    open('tick', 'a').write('.'); time.sleep(0.2)\n"
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(KeyboardInterrupt):
                sbx.run_code(code, timeout_s=60)
            ticks = sbx.files.read("tick", format="bytes")
            started = time.monotonic()
            sbx.run_code("x = 1")
            assert time.monotonic() - started < 10
            time.sleep(1)
            assert sbx.files.read("tick", format="bytes") == ticks
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
