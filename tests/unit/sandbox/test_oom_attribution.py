"""Whose OOM kill it was: the counters a sandbox has are the whole sandbox's, so a command is
``oom_killed`` only if it died of a SIGKILL nobody sent it while the count rose."""

from __future__ import annotations

from typing import Any

import pytest

from stockade.sandbox._replies import OutputCollector, command_result, execution


def reported(h: dict[str, Any], *, rose: bool) -> bool:
    streams = {1: OutputCollector(1024), 2: OutputCollector(1024)}
    return command_result({"id": 1, "ev": "exit", **h}, streams, lambda settle: rose).oom_killed


@pytest.mark.parametrize("ended", [{"exit_code": 137, "signal": None}, {"exit_code": 137, "signal": 9}])
def test_a_command_killed_while_the_count_rose_was_killed_for_memory(ended: dict[str, Any]) -> None:
    assert reported(ended, rose=True)
    assert not reported(ended, rose=False)


def test_a_command_that_exited_is_not_flagged_for_another_calls_kill() -> None:
    assert not reported({"exit_code": 0, "signal": None}, rose=True)
    assert not reported({"exit_code": 1, "signal": None}, rose=True)


def test_the_guest_kernels_count_is_the_whole_guests_too() -> None:
    """The microVM's supervisor reports its kernel's kills during the call with its report."""
    assert not reported({"exit_code": 0, "signal": None, "oom_kills": 1}, rose=False)
    assert reported({"exit_code": 137, "signal": 9, "oom_kills": 1}, rose=False)


def test_a_command_killed_at_its_timeout_was_not_killed_for_memory() -> None:
    assert not reported({"exit_code": 137, "signal": 9, "timed_out": True}, rose=True)


def run_error(
    h: dict[str, Any], error_name: str, *, rose: bool, locks_killed: bool = False
) -> tuple[str, str]:
    streams = {1: OutputCollector(1024), 2: OutputCollector(1024)}
    payload = {"results": [], "error": {"name": error_name, "value": "said", "traceback": ""}}
    report = execution(
        {"id": 1, "ev": "result", **h}, payload, streams, lambda settle: rose, locks_killed=locks_killed
    )
    assert report.error is not None
    return report.error.name, report.error.value


def test_an_interpreter_the_supervisor_saw_die_during_a_kill_was_killed_for_memory_or_locks() -> None:
    died = {"verdict": "KernelDied"}
    assert run_error(died, "KernelDied", rose=True)[0] == "MemoryLimitExceeded"
    assert run_error(died | {"oom_kills": 1}, "KernelDied", rose=False)[0] == "MemoryLimitExceeded"
    assert run_error(died, "KernelDied", rose=True, locks_killed=True)[0] == "FileLockLimitExceeded"
    assert run_error(died, "KernelDied", rose=False) == ("KernelDied", "said")


@pytest.mark.parametrize("locks_killed", [False, True])
def test_an_exception_of_the_code_named_as_a_death_is_the_codes_whatever_was_killed(
    locks_killed: bool,
) -> None:
    """Only the supervisor's header says the interpreter died: the payload's error is the
    code's exception, whose class can be called anything."""
    assert run_error({}, "KernelDied", rose=True, locks_killed=locks_killed) == ("KernelDied", "said")
    assert run_error({"oom_kills": 1}, "KernelDied", rose=True) == ("KernelDied", "said")
    # a verdict of another kind is no death
    assert (
        run_error({"verdict": "TimeoutError", "timed_out": True}, "TimeoutError", rose=True)[0]
        == "TimeoutError"
    )
