"""Durable runs, checked from outside: real processes SIGKILLed at random points, on SQLite and
PostgreSQL, each resumed in a new process with a new process-tier sandbox until it ends (each
forked by ``durable_forks.py``, which imported stockade once: a new interpreter's imports were
half of a process's time, and the test starts 40-60).

Each trial kills a run once or twice in a row, at points drawn at random: between steps,
inside a slow tool before or after its effect, right after a call returned, during a model
request, as the run ends (before the audit trail's last batch, or after it and before the
checkpoint saying the run ended), after a call rejected as invalid reached the trail and before
the ledger, or at a random moment chosen by this process. Then, for every trial:

- the run finishes ("success");
- the final diff holds every step's change exactly once (and nothing the seed already had);
- no non-idempotent effect outside the sandbox happened twice; idempotent ones at least once;
- the audit chain is intact, agrees with the run store's ledger, and holds each tool call and
  the run's end once (``verify``'s ``duplicate_in_trail``).

And two resumes of the same killed run started at once: exactly one runs it.

``STOCKADE_DURABLE_TRIALS`` sets the number of trials per store (default 16);
``STOCKADE_DURABLE_REPORT`` names a JSON file to write the outcomes to (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stockade.audit import open_store, verify
from stockade.runs import open_run_store
from tests.conftest import require_tier, wait_for
from tests.integration.run_stores import StoreTarget, run_store_target  # noqa: F401

pytestmark = pytest.mark.process

FORKS = Path(__file__).with_name("durable_forks.py")
TRIALS = int(os.environ.get("STOCKADE_DURABLE_TRIALS", "16"))
POINTS = (
    "step:1",
    "step:3",
    "step:5",
    "model:1",
    "model:3",
    "model:6",
    "before:1",
    "before:2",
    "before:4",
    "after:1",
    "after:2",
    "after:5",
    "returned:1",
    "returned:4",
    "returned:7",
    "end:1",
    "ended:1",
    "rejected:1",
    "timer:1",  # killed by this process at a random moment (three entries: drawn more often)
    "timer:2",
    "timer:3",
)
EXPECTED_DIFF = (
    "--- /dev/null\n+++ b/journal.txt\n@@ -0,0 +1,3 @@\n+1\n+2\n+3\n"
    "--- /dev/null\n+++ b/steps/1.txt\n@@ -0,0 +1 @@\n+one\n"
    "--- /dev/null\n+++ b/steps/4.txt\n@@ -0,0 +1 @@\n+four\n"
)


@pytest.fixture
def target(run_store_target: StoreTarget) -> StoreTarget:  # noqa: F811 - the fixture
    """The run store under test; its audit trail beside it (tables ``<ns>_audit_*``)."""
    return run_store_target


def _seed(work: Path) -> None:
    seed = work / "seed"
    (seed / "src").mkdir(parents=True)
    (seed / "README.md").write_text("# invoices\n")
    (seed / "src" / "app.py").write_text("print('pay')\n")


class Forks:
    """The children's processes, forked by ``durable_forks.py`` (which imported what they
    import once, for the module) rather than each a new interpreter; their output in files."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(FORKS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._read = b""

    def start(self, args: list[str], out: Path) -> int:
        """Its pid; its stdout and stderr go to ``out`` with the suffixes .out and .err."""
        request = {
            "args": args,
            "stdout": str(out.with_suffix(".out")),
            "stderr": str(out.with_suffix(".err")),
        }
        return int(self._ask(request, timeout_s=30).removeprefix("pid "))

    def poll(self, pid: int) -> int | None:
        """Its exit code (minus its signal), or None while it runs."""
        said = self._ask({"wait": pid, "block": False}, timeout_s=30)
        return None if said == "running" else int(said.removeprefix("status "))

    def wait(self, pid: int, *, timeout_s: float) -> int:
        return int(self._ask({"wait": pid, "block": True}, timeout_s=timeout_s).removeprefix("status "))

    def run(self, args: list[str], out: Path, *, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        pid = self.start(args, out)
        return self.done(args, out, self.wait(pid, timeout_s=timeout_s))

    @staticmethod
    def done(args: list[str], out: Path, code: int) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(
            args, code, out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text()
        )

    def _ask(self, request: dict[str, Any], *, timeout_s: float) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._read:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            assert ready, f"durable_forks.py did not answer {request} within {timeout_s:g} s"
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            assert chunk, f"durable_forks.py ended ({self.proc.wait()}) at {request}"
            self._read += chunk
        line, _, self._read = self._read.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def forks() -> Iterator[Forks]:
    started = Forks()
    try:
        yield started
    finally:
        started.close()


def _child(
    forks: Forks, mode: str, target: StoreTarget, run_id: str, work: Path, point: str, rng: random.Random
) -> subprocess.CompletedProcess[str]:
    args = [mode, target.url, target.namespace, run_id, str(work), point]
    out = work / "child"
    if not point.startswith("timer"):
        return forks.run(args, out)
    args[-1] = "none"
    (work / "started").unlink(missing_ok=True)
    pid = forks.start(args, out)
    code: int | None = None

    def started_or_ended() -> bool:
        nonlocal code
        if (work / "started").exists():
            return True
        code = forks.poll(pid)
        return code is not None

    wait_for(started_or_ended, what="the child to start its run", timeout_s=60, interval_s=0.005)
    time.sleep(rng.uniform(0.0, 0.6))
    if code is None:
        code = forks.poll(pid)
    if code is None:
        os.kill(pid, signal.SIGKILL)  # not reaped until asked: the pid is still the child's
        code = forks.wait(pid, timeout_s=60)
    return forks.done(args, out, code)


def _run_trial(
    forks: Forks, target: StoreTarget, run_id: str, work: Path, rng: random.Random
) -> dict[str, object]:
    """Kill the run at one or two random points, then let it finish; return what happened."""
    _seed(work)
    kills = rng.sample(POINTS, rng.choice((1, 2)))
    mode, killed, invocations = "start", [], 0
    history: list[str] = []  # each process: mode, kill point, exit code, seconds
    report: dict[str, object] | None = None
    for point in [*kills, "none", "none"]:
        invocations += 1
        began = time.monotonic()
        done = _child(forks, mode, target, run_id, work, point, rng)
        history.append(f"{mode} {point} -> {done.returncode} in {time.monotonic() - began:.2f}s")
        if done.returncode == -signal.SIGKILL:
            killed.append(point)
            mode = "resume"
            continue
        if done.returncode == 5:  # killed before its first checkpoint: start it again
            mode = "start"
            continue
        if done.returncode == 4 and mode == "resume":  # the kill came after the run ended
            with open_run_store(target.url, namespace=target.namespace) as store:
                trace = store.trace(run_id)
            assert trace is not None, done.stderr
            report = {"status": trace.summary.status.value, "diff": trace.diff, "error": trace.summary.error}
            break
        assert done.returncode == 0, f"{run_id} (processes {history}): {done.returncode}\n{done.stderr}"
        report = json.loads(done.stdout)
        break
    assert report is not None, f"{run_id} never finished (kills {kills}; processes {history})"
    return {
        "run_id": run_id,
        "planned": kills,
        "killed": killed,
        "invocations": invocations,
        "history": history,
        **report,
    }


def _check_trial(target: StoreTarget, outcome: dict[str, object], work: Path) -> dict[str, int]:
    run_id = str(outcome["run_id"])
    assert outcome["status"] == "success", outcome
    assert outcome["diff"] == EXPECTED_DIFF, f"{run_id}: {outcome}"
    payments = Counter(line.split()[0] for line in (work / "payments.log").read_text().splitlines())
    assert payments == {"inv-1": 1, "inv-2": 1}, f"{run_id}: a payment repeated or missing: {payments}"
    notices = Counter(line.split()[0] for line in (work / "notices.log").read_text().splitlines())
    assert set(notices) == {"paid-inv-1", "all-paid"} and min(notices.values()) >= 1, notices
    with (
        open_run_store(target.url, namespace=target.namespace) as store,
        open_store(target.url, namespace=f"{target.namespace}_audit") as audit,
    ):
        report = verify(audit, run_id=run_id, ledger=store)
        assert report.ok and report.found, f"{run_id}: {[str(p) for p in report.problems]}"
        calls = store.tool_calls(run_id)
        unknown = sum(1 for r in calls if r.error_type == "OutcomeUnknown")
        events = [e for e in audit.events(run_id=run_id)]
        ends = [e.attributes.get("repeat") for e in events if e.kind.value == "run_end"]
        assert ends == [None], f"{run_id}: the run's end in the audit trail: {ends}"
        crashes = sum(1 for e in events if e.kind.value == "run_crash")
        reconciled = sum(1 for e in events if e.attributes.get("reconciled") is True)
        summary = store.summary(run_id)
        assert summary is not None and summary.status.value == "success"
    return {
        "outcome_unknown": unknown,
        "repeated_notices": sum(n - 1 for n in notices.values()),
        "crash_events": crashes,
        "reconciled_events": reconciled,
    }


def test_killed_runs_resume_to_the_same_end(target: StoreTarget, tmp_path: Path, forks: Forks) -> None:
    require_tier("process")
    seed = int(os.environ.get("STOCKADE_DURABLE_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    failures: list[str] = []  # the trials go on after one fails: how many fail is the news
    for trial in range(TRIALS):
        work = tmp_path / f"t{trial}"
        work.mkdir()
        outcome: dict[str, Any] = {"killed": []}
        try:
            outcome = _run_trial(forks, target, f"durable-{trial}", work, rng)
            outcome.update(_check_trial(target, outcome, work))
        except AssertionError as error:
            # The seed replays the draw, not the timing: say where the kills fell, in order.
            # A trial whose process failed never returned its outcome: its message names them.
            where = (
                f" (planned kills {outcome['planned']}; processes: {outcome['history']})"
                if "planned" in outcome
                else ""
            )
            failures.append(f"seed {seed}, trial {trial}{where}: {error}")
        results.append(outcome)
    kills = [k for r in results for k in r["killed"]]
    summary: dict[str, Any] = {
        "store": target.url.split(":")[0],
        "seed": seed,
        "trials": len(results),
        "kills": len(kills),
        "twice_in_a_row": sum(1 for r in results if len(r["killed"]) == 2),
        "kills_by_point": dict(Counter(k.split(":")[0] for k in kills)),
        "outcome_unknown_calls": sum(int(r.get("outcome_unknown", 0)) for r in results),
        "repeated_idempotent_effects": sum(int(r.get("repeated_notices", 0)) for r in results),
        "crash_events": sum(int(r.get("crash_events", 0)) for r in results),
        "reconciled_audit_events": sum(int(r.get("reconciled_events", 0)) for r in results),
        "failed_trials": len(failures),
        "all_succeeded": not failures,
    }
    print(json.dumps(summary))
    if os.environ.get("STOCKADE_DURABLE_REPORT"):
        with open(os.environ["STOCKADE_DURABLE_REPORT"], "a", encoding="utf-8") as out:
            out.write(json.dumps(summary) + "\n")
    if failures:
        raise AssertionError(f"{len(failures)} of {TRIALS} trials failed:\n" + "\n".join(failures))
    assert summary["kills"] >= TRIALS  # every trial killed its run at least once


def test_two_resumes_of_a_killed_run_one_runs_it(target: StoreTarget, tmp_path: Path, forks: Forks) -> None:
    require_tier("process")
    for attempt in range(4):
        work = tmp_path / f"c{attempt}"
        work.mkdir()
        _seed(work)
        run_id = f"contended-{attempt}"
        args = ["start", target.url, target.namespace, run_id, str(work)]
        killed = forks.run([*args, "after:2"], work / "killed")
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        args[0] = "resume"
        outs = [work / "first", work / "second"]
        both = [forks.start([*args, "none"], out) for out in outs]  # at once
        ended = [
            Forks.done(args, out, forks.wait(pid, timeout_s=120)) for pid, out in zip(both, outs, strict=True)
        ]
        codes = sorted(e.returncode for e in ended)
        errors = [e.stderr for e in ended]
        assert codes[0] == 0 and codes[1] in (3, 4), (codes, errors)  # one ran; the other was refused
        loser = next(e.stderr for e in ended if e.returncode != 0)
        assert "running in another process" in loser or "ended (success)" in loser, loser
        payments = Counter(line.split()[0] for line in (work / "payments.log").read_text().splitlines())
        assert payments == {"inv-1": 1, "inv-2": 1}, payments
