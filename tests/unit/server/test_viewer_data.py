"""What the run viewer reads, over the shipped fakes: recorded runs as rows and timelines, the
filters, the chain's verification, pending approvals and their decision; every kind of audit
event as a line of the timeline; a long run read one bounded window at a time."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from datetime import UTC, datetime
from pathlib import Path

from stockade.assembly import AgentConfig, build_agent
from stockade.audit import AuditLog, MemoryStore
from stockade.audit.events import Chain, Draft, EventKind
from stockade.audit.stores import Row, SQLiteStore
from stockade.models import ScriptedModel, tool_call
from stockade.policy import Policy
from stockade.policy.approval import ApprovalStore, Choice
from stockade.policy.schema import CommandRules, PathRules, TrustRules
from stockade.server.viewer.data import LocalRuns
from stockade.server.viewer.timeline import timeline
from stockade.server.viewer.values import PAGE, Filters, RunView, Window
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.types import Trust

POLICY = Policy(
    trust=TrustRules(level=Trust.TRUSTED),
    paths=PathRules(deny=("secrets/**",)),
    commands=CommandRules(approve=("rm -r",)),
)


def record(tmp_path: Path, name: str, turns: list[object]) -> str:
    config = AgentConfig(
        model=ScriptedModel(turns, name=name),  # type: ignore[arg-type]
        policy=POLICY,
        backend=FakeBackend(MemoryWorkspace(), tier="process"),
        audit=f"sqlite:///{tmp_path / 'a.db'}",
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
    )
    with build_agent(config) as agent:
        return agent.run_sync(f"the {name} run").run_id


def test_recorded_runs_read_as_rows_and_timelines(tmp_path: Path) -> None:
    done = record(
        tmp_path,
        "scripted-busy",
        [
            tool_call("write_file", {"path": "a.txt", "content": "hello\n"}),
            tool_call("write_file", {"path": "secrets/k", "content": "x"}),
            "done",
        ],
    )
    paused = record(
        tmp_path, "scripted-careful", [tool_call("run_code", {"code": "rm -r x", "language": "bash"})]
    )
    source = LocalRuns(f"sqlite:///{tmp_path / 'a.db'}", approvals=tmp_path / "approvals")
    try:
        assert {r.run_id for r in source.runs(Filters())} == {done, paused}
        assert [r.run_id for r in source.runs(Filters(status="paused"))] == [paused]
        assert [r.run_id for r in source.runs(Filters(model="busy"))] == [done]
        assert source.runs(Filters(since=datetime(2999, 1, 1, tzinfo=UTC))) == []
        assert source.runs(Filters(status="no-such-status")) == []

        view = source.run(done)
        assert view is not None and view.row.status == "success" and not view.live
        entries = [e for step in view.steps for e in step.entries]
        kinds = {e.kind for e in entries}
        assert {"run", "sandbox", "model", "tool", "denial"} <= kinds
        wrote = next(e for e in entries if e.kind == "tool")
        assert wrote.title == "write_file" and '"path": "a.txt"' in (wrote.args or "") and wrote.text
        assert view.diff is not None and "+hello" in view.diff
        assert [e.text for e in entries if e.kind == "model"][-1] == "done"  # the model's words
        assert view.answer == "done" and not view.earlier and not view.later
        assert view.verification is not None and view.verification.ok is True
        last, status = source.changes(done, 0) or (0, "")
        assert last == view.last_seq and status == "success"
        assert source.changes(done, last) == (last, "success")
        assert source.run("nope") is None and source.changes("nope", 0) is None

        waiting = source.run(paused, verified=False)
        assert waiting is not None and waiting.verification is None and len(waiting.pending) == 1
        request = waiting.pending[0]
        assert "rm -r x" in request.action
        source.decide(paused, request.request_id, Choice.APPROVED)
        assert ApprovalStore(tmp_path / "approvals").pending(paused) == []
    finally:
        source.close()


def test_every_kind_of_event_is_a_line_of_the_timeline() -> None:
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    r = "run-1"
    log.record(EventKind.RUN_START, run_id=r, attributes={"task": "t", "resumed": False})
    log.record(
        EventKind.MODEL_CALL,
        run_id=r,
        step=1,
        duration_s=0.5,
        attributes={"model": "m", "input_tokens": 10, "output_tokens": 2, "tool_calls": ["run_code"]},
    )
    log.record(
        EventKind.RETRY,
        run_id=r,
        step=1,
        attributes={"subject": "read", "attempt": 1, "delay_s": 0.1, "reason": "busy"},
    )
    log.record(
        EventKind.RETRY,
        run_id=r,
        step=1,
        attributes={"subject": "tests", "flaky": True, "first_exit_code": 1, "second_exit_code": 0},
    )
    log.record(
        EventKind.EXEC,
        run_id=r,
        step=1,
        attributes={"argv": ["rm", "-r", "x"], "verdict": "deny", "rule": "commands.deny"},
    )
    log.record(EventKind.COMMAND, run_id=r, step=1, attributes={"argv": ["ls"]})  # under its call: not shown
    log.record(
        EventKind.TOOL_CALL,
        run_id=r,
        step=1,
        duration_s=0.01,
        attributes={
            "tool": "run_code",
            "call_id": "c1",
            "idempotency_key": "k",
            "args": {"code": "<b>"},
            "is_error": True,
            "error_type": "Boom",
            "observation_chars": 5,
            "outcome": "unknown",
            "reconciled": True,
        },
    )
    log.record(
        EventKind.APPROVAL,
        run_id=r,
        actor="human",
        attributes={"outcome": "approved", "action": "a", "through": "api"},
    )
    log.record(
        EventKind.POLICY_DECISION, run_id=r, step=2, attributes={"decision": "flag", "level": "prompt"}
    )
    log.record(EventKind.KILL_SWITCH, run_id=r, step=2, actor="human", attributes={"reason": "stop"})
    log.record(
        EventKind.ANOMALY, run_id=r, step=2, attributes={"rule": "loop", "detail": "d", "action": "kill"}
    )
    log.record(EventKind.RATE_LIMITED, run_id=r, step=2, attributes={"limit": "rate", "detail": "slow down"})
    log.record(
        EventKind.BREAKER_CHANGE,
        run_id=r,
        step=2,
        attributes={"name": "tools", "old": "closed", "new": "open", "reason": "5 failures"},
    )
    log.record(
        EventKind.CHECK,
        run_id=r,
        step=2,
        duration_s=1.0,
        attributes={"command": "pytest", "passed": False, "exit_code": 1, "summary": "1 failed"},
    )
    log.record(EventKind.RUN_CRASH, run_id=r, attributes={"detail": "died"})
    log.record(EventKind.RUN_END, run_id=r, attributes={"status": "killed", "error": "stop"})
    log.flush()
    steps, last = timeline(log.store.events(run_id=r))
    assert last == 16 and [s.index for s in steps] == [0, 1, 2]
    titles = [e.title for s in steps for e in s.entries]
    assert titles == [
        "run started",
        "model call (m)",
        "retry 1: read",
        "flaky, run again: tests",
        "exec deny: rm -r x",
        "run_code",
        "approved: a",
        "flag: prompt",
        "killed",
        "anomaly: loop",
        "rate limited: rate",
        "breaker tools: closed → open",
        "check failed: pytest",
        "run crash",
        "run ended: killed",
    ]
    tool = steps[1].entries[4]
    assert (
        tool.failed
        and "outcome unknown (cut by a crash)" in tool.facts
        and tool.text
        and "5 characters" in tool.text
    )


def test_a_limit_that_waits_is_not_a_failure_and_an_open_breaker_is() -> None:
    log = AuditLog(MemoryStore(), flush_interval_s=None)
    r = "run-2"
    log.record(EventKind.RATE_LIMITED, run_id=r, step=1, attributes={"limit": "rate", "action": "wait"})
    log.record(EventKind.BUDGET, run_id=r, step=1, attributes={"limit": "spend", "action": "stop"})
    log.record(
        EventKind.BREAKER_CHANGE,
        run_id=r,
        step=1,
        attributes={"name": "agent", "old": "closed", "new": "open", "failures": 5, "reason": "r"},
    )
    log.flush()
    steps, _ = timeline(log.store.events(run_id=r))
    waited, stopped, broke = [e for s in steps for e in s.entries]
    assert not waited.failed and waited.facts == ("waits for its window",)
    assert stopped.failed and stopped.facts == ("stops the run",)
    assert broke.failed and broke.facts == ("5 failures in a row",)


# Tool calls of a long run: 2 events each (a call, its command), 16 pages of PAGE: many pages
# to go back through, and a page that held every entry would be far over the web test's
# bound of 200 KB (2,475 entries made ~1 MiB). 10,000 before: the same proof at 5 times the
# cost (12 s a test in CI).
LONG = 2_000


def lengthen(db: Path, run_id: str, calls: int, *, start: int = 0) -> None:
    """``calls`` more tool calls of ``run_id`` in its trail (each with a command under it,
    which the timeline leaves to its call): a long run, without running it."""
    store = SQLiteStore(db)
    log = AuditLog(store, flush_interval_s=None)
    try:
        for n in range(start, start + calls):
            step = 2 + n // 100
            log.record(EventKind.COMMAND, run_id=run_id, step=step, attributes={"argv": ["true"]})
            log.record(
                EventKind.TOOL_CALL,
                run_id=run_id,
                step=step,
                attributes={"tool": f"call-{n}", "call_id": f"c{n}", "idempotency_key": f"k{n}"},
            )
    finally:
        log.close()
        store.close()


class CountingStore(SQLiteStore):
    """The run viewer's audit store, counting the rows it reads."""

    def __init__(self, db: Path) -> None:
        super().__init__(db, read_only=True)
        self.read = 0

    def rows(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[Row]:
        for row in super().rows(run_id=run_id, after_seq=after_seq):
            self.read += 1
            yield row

    def window(
        self,
        run_id: str,
        *,
        after_seq: int = 0,
        before_seq: int | None = None,
        limit: int,
        newest: bool = False,
    ) -> list[Row]:
        found = super().window(run_id, after_seq=after_seq, before_seq=before_seq, limit=limit, newest=newest)
        self.read += len(found)
        return found

    def rows_at(self, seqs: Collection[int]) -> list[Row]:
        found = super().rows_at(seqs)
        self.read += len(found)
        return found


def test_a_run_page_verifies_the_run_not_the_whole_trail(tmp_path: Path) -> None:
    """A short run in a trail of 50,000 other events: its page verified the whole trail,
    reading every event (a 3-event run's page took 5 s on a tenant trail of 500,000); now the
    run's events, the ones on either side of each and the head's, whatever the trail's size."""
    done = record(
        tmp_path, "scripted-short", [tool_call("write_file", {"path": "a.txt", "content": "a"}), "ok"]
    )
    db = tmp_path / "a.db"
    with SQLiteStore(db) as store:
        for _ in range(10):
            store.append([Draft(run_id="busy", kind=EventKind.NOTE, timestamp_ns=1)] * 5000, Chain())
    source = LocalRuns(f"sqlite:///{db}", approvals=tmp_path / "approvals")
    source.audit = counting = CountingStore(db)
    try:
        view = source.run(done)
        assert view is not None and view.verification is not None and view.verification.ok is True
        with SQLiteStore(db, read_only=True) as store:
            events = sum(1 for _ in store.rows(run_id=done))
        counting.read = 0
        source.run(done)
        assert 0 < counting.read <= 4 * events + 4  # the page's window, and the check
    finally:
        source.close()


def titles(view: RunView) -> list[str]:
    return [e.title for s in view.steps for e in s.entries]


def test_a_long_run_is_read_one_bounded_window_at_a_time(tmp_path: Path) -> None:
    """A run of thousands of audit events: its page was every entry of it (at 2,475 entries ~1 MiB and
    up to 1.7 s, rendered again whole at each live update); now its newest PAGE events, reading
    about that many rows, and earlier pages go back to its first event."""
    done = record(
        tmp_path, "scripted-long", [tool_call("write_file", {"path": "a.txt", "content": "a"}), "ok"]
    )
    db = tmp_path / "a.db"
    lengthen(db, done, LONG)
    source = LocalRuns(f"sqlite:///{db}", approvals=tmp_path / "approvals")
    source.audit = counting = CountingStore(db)
    try:
        latest = source.run(done, verified=False)
        assert latest is not None and latest.earlier and not latest.later
        assert sum(len(s.entries) for s in latest.steps) <= PAGE
        assert titles(latest)[-1] == f"call-{LONG - 1}"
        assert counting.read <= PAGE + 2  # the window, and one row to know there is more

        # back a page at a time, to the run's first event: each event shown once
        seqs = [e.seq for s in latest.steps for e in s.entries]
        page, pages = latest, 1
        while page.earlier:
            counting.read = 0
            earlier = source.run(done, verified=False, window=Window(before=page.first_seq))
            assert earlier is not None and earlier.later and earlier.last_seq < page.first_seq
            assert counting.read <= PAGE + 2
            seqs[:0] = [e.seq for s in earlier.steps for e in s.entries]
            page, pages = earlier, pages + 1
        assert "run started" in titles(page)[:2] and pages >= 2 * LONG // PAGE
        assert seqs == sorted(set(seqs)) and len(seqs) >= LONG
        # the first events read forwards: the same ones, then on
        first = source.run(done, verified=False, window=Window(after=0))
        assert first is not None and first.later and not first.earlier
        assert titles(first)[: len(titles(page))] == titles(page)

        # a live page's update: only what came after the last event it shows
        nothing = source.run(
            done, verified=False, window=Window(after=latest.last_seq, step=latest.steps[-1].index)
        )
        assert nothing is not None and nothing.steps == () and nothing.last_seq == latest.last_seq
        # an event outside any step (an approval) goes with the step the page ends in
        with SQLiteStore(db) as store:
            log = AuditLog(store, flush_interval_s=None)
            log.record(
                EventKind.APPROVAL, run_id=done, actor="h", attributes={"outcome": "approved", "action": "x"}
            )
            log.close()
        last = Window(after=latest.last_seq, step=latest.steps[-1].index)
        approved = source.run(done, verified=False, window=last)
        assert approved is not None and titles(approved) == ["approved: x"]
        assert [s.index for s in approved.steps] == [latest.steps[-1].index]
        lengthen(db, done, 3, start=LONG)
        counting.read = 0
        delta = source.run(
            done, verified=False, window=Window(after=approved.last_seq, step=latest.steps[-1].index)
        )
        assert delta is not None and titles(delta) == [f"call-{LONG + n}" for n in range(3)]
        assert counting.read <= 6 + 2  # the three calls and their commands; one row before them
        assert source.changes(done, latest.last_seq) == (delta.last_seq, "success")
    finally:
        source.close()
