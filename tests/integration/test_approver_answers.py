"""What a sandbox's approver answers, and how long it takes, decide only whether the exec runs.

Only ``True`` or ``Choice.APPROVED`` runs it: ``bool(answer)`` ran ``rm -r`` for an approver
answering ``Choice.DENIED`` (a non-empty string) and for an ``async def`` approver saying no
(its coroutine, never awaited, is truthy). A human slower than ``timeout_s`` took the whole
sandbox down: the time an exec waits for its answer is not the call's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from stockade import AsyncSandbox, InvalidArgument, Limits, Sandbox, SnapshotStore
from stockade.policy.approval import Choice
from stockade.sandbox._supervised_calls import GRACE_S
from stockade.types import ExecRecord, SandboxRules
from tests.conftest import require_tier
from tests.integration.conftest import TIERS

# The tiers whose kernel holds approve rules (gVisor's refuses them: LimitNotEnforceable).
CONFINES = ("process", "docker", "microvm")
RULES = SandboxRules(approve=("rm -r",))
LIMITS = Limits(memory_mb=256, timeout_s=20, pids=64)


@pytest.fixture(params=[t for t in TIERS if t in CONFINES])
def tier(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    require_tier(name)
    return name


@dataclass
class Answers:
    """Answers an exec by its last argument (the folder ``rm -r`` removes), after ``wait_s``
    for the folders named in ``slow``; ``asked`` holds the folders it was asked about."""

    answers: dict[str, object]
    slow: tuple[str, ...] = ()
    wait_s: float = 0.0
    asked: list[str] = field(default_factory=list)

    def __call__(self, record: ExecRecord) -> Any:  # any answer: callers need not be typed
        folder = record.argv[-1]
        self.asked.append(folder)
        if folder in self.slow:
            time.sleep(self.wait_s)  # a human reading the question
        return self.answers[folder]


def removes(*folders: str) -> str:
    """A command that makes each folder, removes it with ``rm -r``, and prints what is left."""
    made = " ".join(folders)
    each = "; ".join(f"rm -r {f}" for f in folders)
    return f"mkdir -p {made}; {each}; ls -d {made} 2>/dev/null; true"


def refusals(execs: tuple[ExecRecord, ...]) -> dict[str, str]:
    """Folder -> the rule of its refusal, for each ``rm -r`` the sandbox refused."""
    return {e.argv[-1]: e.rule for e in execs if e.argv[:2] == ("rm", "-r") and e.verdict == "refuse"}


def test_only_true_or_choice_approved_lets_an_exec_run(tier: str) -> None:
    answers = Answers(
        {
            "yes": True,
            "approved": Choice.APPROVED,
            "no": False,
            "nothing": None,
            "denied": Choice.DENIED,  # "denied", a non-empty string: it ran
            "word": "approved",  # Choice.APPROVED's value, not Choice.APPROVED
            "one": 1,
        }
    )
    with Sandbox.create(tier, limits=LIMITS, rules=RULES, approver=answers) as sbx:
        r = sbx.commands.run(removes(*answers.answers))
    assert answers.asked == list(answers.answers)
    assert sorted(r.stdout.split()) == ["denied", "no", "nothing", "one", "word"], r
    refused = refusals(r.execs)
    assert refused["no"] == refused["nothing"] == refused["denied"] == "commands.approve: rm -r"
    # an answer that is no plain yes or no is refused, and the record says what it was
    not_yes = "not True or Choice.APPROVED"
    assert refused["word"] == f"commands.approve: rm -r (the approver answered 'approved', {not_yes})"
    assert refused["one"] == f"commands.approve: rm -r (the approver answered 1, {not_yes})"
    assert "needs approval and was refused: commands.approve: rm -r (the approver answered 1" in r.stderr


def test_an_approver_that_raises_refuses_and_says_why(tier: str) -> None:
    def fails(record: ExecRecord) -> bool:
        raise LookupError("no human on call")

    with Sandbox.create(tier, limits=LIMITS, rules=RULES, approver=fails) as sbx:
        r = sbx.commands.run(removes("kept"))
    assert r.stdout.split() == ["kept"], r
    assert refusals(r.execs) == {
        "kept": "commands.approve: rm -r (the approver raised LookupError: no human on call)"
    }


async def test_an_async_approver_is_awaited_on_the_callers_loop(tier: str) -> None:
    asked: list[str] = []

    async def human(record: ExecRecord) -> bool:
        asked.append(record.argv[-1])
        return record.argv[-1] == "yes"

    sbx = await AsyncSandbox.create(tier, limits=LIMITS, rules=RULES, approver=human)
    async with sbx:
        r = await sbx.commands.run(removes("yes", "no"))
    assert asked == ["yes", "no"]
    assert r.stdout.split() == ["no"], r
    assert refusals(r.execs) == {"no": "commands.approve: rm -r"}


def test_a_blocking_sandbox_refuses_an_async_approver_before_it_starts() -> None:
    async def human(record: ExecRecord) -> bool:
        return False

    with pytest.raises(InvalidArgument, match="AsyncSandbox") as raised:
        Sandbox.create("process", rules=RULES, approver=human)  # type: ignore[arg-type]  # as typed
    assert raised.value.argument == "approver"


def test_an_approver_returning_an_awaitable_to_a_blocking_sandbox_refuses(tier: str) -> None:
    async def no() -> bool:
        return False

    # not an ``async def``: what it returns is known only when it is asked
    late: Callable[[ExecRecord], Awaitable[bool]] = lambda record: no()  # noqa: E731
    with Sandbox.create(tier, limits=LIMITS, rules=RULES, approver=late) as sbx:  # type: ignore[arg-type]
        r = sbx.commands.run(removes("kept"))
    assert r.stdout.split() == ["kept"], r
    assert refusals(r.execs) == {
        "kept": "commands.approve: rm -r (the approver returned an awaitable, which is not awaited here)"
    }  # and the coroutine was closed: never-awaited warnings are errors here


def test_a_human_slower_than_the_timeout_neither_times_the_call_out_nor_kills_the_sandbox(
    tier: str,
) -> None:
    # Past the supervisor's deadline for the job (timeout_s) and the host's (timeout_s + GRACE_S);
    # the timed call only its shell and the two `rm` (made and looked at in calls of their own:
    # on a loaded microVM five execs took CI 158's 1 s).
    answers = Answers({"slow": True, "quick": False}, slow=("slow",), wait_s=3 + GRACE_S + 1)
    with Sandbox.create(tier, limits=LIMITS, rules=RULES, approver=answers) as sbx:
        sbx.commands.run("echo state > /tmp/state; mkdir -p slow quick")
        r = sbx.commands.run("rm -r slow; rm -r quick; true", timeout_s=3)
        assert not r.timed_out and r.exit_code == 0, r
        left = sbx.commands.run("ls -d slow quick 2>/dev/null; true").stdout.split()
        assert left == ["quick"], left  # the slow yes ran, the quick no did not
        assert answers.asked == ["slow", "quick"]
        assert sbx.commands.run("cat /tmp/state").stdout == "state\n"


def test_a_human_slower_than_run_codes_timeout_leaves_its_interpreter_running(tier: str) -> None:
    # The approver is slower than the timeout, and the call's own work (started before it, in
    # the first call) far quicker: on the microVM under TCG an import could take the second.
    answers = Answers({"slow": True}, slow=("slow",), wait_s=5.5)
    limits = Limits(memory_mb=256, timeout_s=4, pids=64)
    with Sandbox.create(tier, limits=limits, rules=RULES, approver=answers) as sbx:
        # the set-up call has time of its own: a loaded host's guest took past 4 s to import
        # subprocess, and the call under test then met a fresh interpreter (NameError)
        setup = sbx.run_code("import os, subprocess\nos.makedirs('slow')\nkept = 'state'", timeout_s=120)
        assert setup.error is None and not setup.timed_out, setup
        r = sbx.run_code("subprocess.run(['rm', '-r', 'slow']).returncode")
        assert r.error is None and not r.timed_out and r.text == "0", r
        assert sbx.run_code("kept").text == "'state'"  # the same interpreter: not restarted


def test_code_that_keeps_an_approval_pending_times_out_once_approval_wait_s_is_spent(tier: str) -> None:
    # A loop of ever new `rm -r` argvs (each asked again), always one waiting for a slowish no,
    # beside a sleep far past timeout_s: the waits stopped the clock for ever (the call ran
    # its 25 s and printed). They stop it for approval_wait_s in all; then it is killed.
    asked: list[str] = []

    def slow_no(record: ExecRecord) -> bool:
        asked.append(record.argv[-1])
        time.sleep(0.2)  # a human's quick no
        return False

    limits = Limits(memory_mb=256, timeout_s=20, pids=64, approval_wait_s=2)
    keeps_asking = (
        "( i=0; while :; do for j in 1 2 3 4; do rm -r /tmp/x$i.$j 2>/dev/null & done; "
        "i=$((i+1)); wait; done ) & sleep 25; echo survived"
    )
    with Sandbox.create(tier, limits=limits, rules=RULES, approver=slow_no) as sbx:
        r = sbx.commands.run(keeps_asking, timeout_s=2)
        assert r.timed_out and "survived" not in r.stdout, r
        assert asked  # it did wait for approvals meanwhile
        # the host's clock credited no less than the supervisor's: it did not take the sandbox down
        assert sbx.commands.run("echo alive").stdout == "alive\n"


def test_run_code_that_keeps_an_approval_pending_times_out_once_approval_wait_s_is_spent(tier: str) -> None:
    limits = Limits(memory_mb=256, timeout_s=20, pids=64, approval_wait_s=2)
    keeps_asking = (
        "import subprocess, threading, time\n"
        "def ask():\n"
        "    for i in range(10**6):\n"
        "        try:\n"
        "            subprocess.run(['rm', '-r', f'/tmp/x{i}'])\n"
        "        except PermissionError:\n"
        "            pass  # refused: ask again, with a new argv\n"
        "threading.Thread(target=ask, daemon=True).start()\n"
        "time.sleep(25)\n"
        "'survived'"
    )

    def slow_no(record: ExecRecord) -> bool:
        time.sleep(0.2)
        return False

    with Sandbox.create(tier, limits=limits, rules=RULES, approver=slow_no) as sbx:
        r = sbx.run_code(keeps_asking, timeout_s=2)
        assert r.timed_out and r.text != "'survived'", r
        assert sbx.run_code("1 + 1").text == "2"


async def test_a_cancelled_call_cancels_its_async_approver_and_a_late_yes_runs_nothing(tier: str) -> None:
    human = asyncio.Event()
    asked = asyncio.Event()
    gave_up = asyncio.Event()

    async def approver(record: ExecRecord) -> bool:
        asked.set()
        try:
            await human.wait()  # a human who answers yes, after the caller gave up
        except asyncio.CancelledError:
            gave_up.set()
            raise
        return True

    sbx = await AsyncSandbox.create(tier, limits=LIMITS, rules=RULES, approver=approver)
    async with sbx:
        await sbx.files.write("victim/a.txt", b"precious")
        call = asyncio.create_task(sbx.commands.run("rm -r victim"))
        # cancelled once its exec waits for the approver (a guest under load takes its time
        # to get there: a deadline of its own raced the exec on the microVM)
        await asyncio.wait_for(asked.wait(), 60)
        # the human's yes comes 3 s on whatever happens: the old code waited for it, then ran rm
        asyncio.get_running_loop().call_later(3, human.set)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(gave_up.wait(), 30)  # the approver was cancelled, not left waiting
        await human.wait()
        r = await sbx.commands.run("cat victim/a.txt")
        assert r.stdout == "precious", r


async def test_gathered_approvals_whose_approver_awaits_a_thread_all_run(tier: str) -> None:
    """Each waiting call held a thread of the loop's default executor, the one the approver's
    ``to_thread`` needed: six gathered approvals (six threads, on two cores) hung for good."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))

    async def looked_up(record: ExecRecord) -> bool:
        return await asyncio.to_thread(lambda: True)  # a blocking look-up, off the loop

    sbx = await AsyncSandbox.create(tier, limits=LIMITS, rules=RULES, approver=looked_up)
    async with sbx:
        runs = [sbx.commands.run(removes(f"d{i}")) for i in range(6)]
        results = await asyncio.wait_for(asyncio.gather(*runs), 120)
    assert [r.stdout for r in results] == [""] * 6  # each rm -r ran
    assert all(not refusals(r.execs) for r in results)


async def test_an_async_approver_that_never_answers_is_given_up_after_approval_wait_s(tier: str) -> None:
    """The supervisor let the exec's wait go after approval_wait_s, but the call's thread
    waited for the approver for ever: the call never returned."""
    gave_up = asyncio.Event()

    async def away(record: ExecRecord) -> bool:
        try:
            await asyncio.Event().wait()  # nobody answers
        except asyncio.CancelledError:
            gave_up.set()
            raise
        return True

    limits = dataclasses.replace(LIMITS, approval_wait_s=2)
    sbx = await AsyncSandbox.create(tier, limits=limits, rules=RULES, approver=away)
    async with sbx:
        r = await asyncio.wait_for(sbx.commands.run(removes("kept")), 60)
        await asyncio.wait_for(gave_up.wait(), 30)  # cancelled, not left waiting
    assert r.stdout.split() == ["kept"], r
    assert refusals(r.execs) == {
        "kept": "commands.approve: rm -r (the approver did not answer within the call's approval_wait_s)"
    }


def test_resume_refuses_an_approver_it_cannot_call_and_leaves_the_pause_to_resume(
    tier: str, tmp_path: Path
) -> None:
    store = SnapshotStore(tmp_path / "snapshots")
    with Sandbox.create(tier, limits=LIMITS, rules=RULES) as sbx:
        sbx.files.write("kept.txt", "work")
        sbx.pause(store=store)

    async def human(record: ExecRecord) -> bool:
        return True

    for approver in ("yes", human):  # not callable; async, which a blocking Sandbox cannot await
        with pytest.raises(InvalidArgument) as refused:
            Sandbox.resume(sbx.id, store=store, approver=approver)  # type: ignore[arg-type]
        assert refused.value.argument == "approver"
    with Sandbox.resume(sbx.id, store=store, approver=Answers({"kept": False})) as back:
        assert back.files.read("kept.txt") == "work"
