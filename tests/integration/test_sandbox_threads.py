"""A sandbox lives as long as its owner keeps it, whichever thread started it. A parent-death
signal (bwrap's --die-with-parent, setpriv --pdeathsig) fires when the *thread* that forked the
child exits: a microVM started from a thread that then ended (a worker of a pool shut down, a
web server's idle worker) was killed with it, its next call "sandbox is gone", and so was the
process tier's sandbox when bwrap starts it (not root, or ``start="exec"``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from stockade import Sandbox
from stockade.sandbox.microvm import MicroVMBackend
from stockade.sandbox.process import ProcessBackend
from tests.conftest import require_tier


def started_in_a_thread(make: Callable[[], Sandbox]) -> Sandbox:
    """``make()`` on a thread that has ended by the time this returns."""
    made: list[Sandbox | BaseException] = []

    def start() -> None:
        try:
            made.append(make())
        except BaseException as error:
            made.append(error)

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    (sandbox,) = made
    if isinstance(sandbox, BaseException):
        raise sandbox
    time.sleep(0.5)  # room for a death signal sent at the thread's exit to land
    return sandbox


def test_a_sandbox_outlives_the_thread_that_started_it(tier: str) -> None:
    with started_in_a_thread(lambda: Sandbox.create(tier)) as sbx:
        assert sbx.run_code("print(2)").logs.stdout == "2\n"
        assert sbx.commands.run("echo 3").stdout == "3\n"


def test_a_process_sandbox_that_bwrap_starts_outlives_the_thread_that_started_it() -> None:
    require_tier("process")
    with started_in_a_thread(lambda: Sandbox.create(backend=ProcessBackend(start="exec"))) as sbx:
        assert sbx.run_code("print(2)").logs.stdout == "2\n"


def test_a_microvm_booted_for_its_caller_outlives_the_thread_that_started_it() -> None:
    # not from a QEMU started ahead (the background thread that starts those lives on)
    require_tier("microvm")
    with started_in_a_thread(lambda: Sandbox.create(backend=MicroVMBackend(start_ahead=False))) as sbx:
        assert sbx.run_code("print(2)").logs.stdout == "2\n"
