"""A yes answers one question: the action it allowed goes ahead once, and the same action asked
again later in the run is asked again. A no stands. Both approval books (the JSON files of one
machine, the service's database) keep to it, and two workers never both apply one yes."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stockade.exceptions import (
    ApprovalDecided,
    ApprovalRequired,
    ApprovalsFull,
    ConfigurationError,
    PolicyDenied,
)
from stockade.policy.approval import SPENT, ApprovalBook, ApprovalRequest, Approvals, ApprovalStore, Choice
from stockade.server.state.approvals import DatabaseApprovals
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore

PUSH = ApprovalRequest(
    run_id="run-1", action="run `git push origin main`", rule="git push", reason="publishes"
)


@pytest.fixture(params=["files", "database"])
def book(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ApprovalBook]:
    if request.param == "files":
        yield ApprovalStore(tmp_path / "approvals")
        return
    db = open_database(str(tmp_path / "service.db"))
    try:
        yield DatabaseApprovals(ServiceStore(db))
    finally:
        db.close()


def status(book: ApprovalBook, request: ApprovalRequest) -> str:
    return next(r["status"] for r in book.requests(request.run_id) if r["id"] == request.id)


def counting(choice: Choice | None) -> tuple[Callable[[ApprovalRequest], Choice | None], list[str]]:
    asked: list[str] = []

    def approver(request: ApprovalRequest) -> Choice | None:
        asked.append(request.action)
        return choice

    return approver, asked


def test_an_approver_is_asked_each_time_the_same_action_comes_again(book: ApprovalBook) -> None:
    approver, asked = counting(Choice.APPROVED)
    approvals = Approvals(approver, book)
    approvals.require(PUSH)
    approvals.require(PUSH)  # a later push, of other commits: the first yes did not cover it
    assert asked == [PUSH.action, PUSH.action]
    assert status(book, PUSH) == SPENT


def test_a_deferred_yes_lets_the_action_go_once_then_it_is_pending_again(book: ApprovalBook) -> None:
    approvals = Approvals(None, book)
    with pytest.raises(ApprovalRequired) as waiting:
        approvals.require(PUSH)
    assert waiting.value.request_id == PUSH.id and status(book, PUSH) == "pending"
    book.decide(PUSH.run_id, PUSH.id, Choice.APPROVED, by="alice")
    approvals.require(PUSH)  # the resumed run's push goes ahead
    assert status(book, PUSH) == SPENT and book.decision(PUSH) is None
    with pytest.raises(ApprovalRequired):
        approvals.require(PUSH)  # the next one waits for a person again
    assert book.pending(PUSH.run_id) == [r for r in book.requests(PUSH.run_id) if r["id"] == PUSH.id]


async def _yes() -> Choice:
    return Choice.APPROVED


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (True, "answered True, not Choice.APPROVED or Choice.DENIED"),
        ("approved", "answered 'approved', not Choice.APPROVED or Choice.DENIED"),
        ("coroutine", "the approver is async, and is not awaited here"),
    ],
)
def test_an_answer_that_is_no_choice_refuses_and_books_nothing(
    book: ApprovalBook, answer: object, why: str
) -> None:
    """An approver typed loosely (``True``), or async (its coroutine: never awaited, closed)."""
    approvals = Approvals(lambda request: _yes() if answer == "coroutine" else answer, book)  # type: ignore[arg-type,return-value]
    with pytest.raises(PolicyDenied, match="refused: .*" + why):
        approvals.require(PUSH)
    assert book.requests(PUSH.run_id) == []


def rm(i: int) -> ApprovalRequest:
    return ApprovalRequest(run_id="run-1", action=f"run `rm -r x{i}`", rule="rm -r", reason="deletes")


def test_a_run_keeps_so_many_requests_pending_and_refuses_more_on_the_spot(book: ApprovalBook) -> None:
    """Code looping over distinct `rm -r X$i` kept one request per exec, 2,000 in 21 s. Past
    `max_pending` a new action is refused now and kept nowhere; one already pending still
    waits for its decision, and a decision makes room for another."""
    approvals = Approvals(None, book, max_pending=3)
    for i in range(3):
        with pytest.raises(ApprovalRequired):
            approvals.require(rm(i))
    with pytest.raises(ApprovalsFull, match="already has 3 requests waiting") as full:
        approvals.require(rm(3))
    assert isinstance(full.value, PolicyDenied) and full.value.limit == 3 and not full.value.retryable
    assert sorted(r["action"] for r in book.requests("run-1")) == [rm(i).action for i in range(3)]
    with pytest.raises(ApprovalRequired):
        approvals.require(rm(1))  # the same question again: it waits on
    book.decide("run-1", rm(0).id, Choice.DENIED, by="alice")
    with pytest.raises(ApprovalRequired):
        approvals.require(rm(3))
    assert len(book.pending("run-1")) == 3 and len(book.requests("run-1")) == 4
    with pytest.raises(ApprovalRequired):  # another run's requests are its own
        approvals.require(dataclasses.replace(rm(9), run_id="run-2"))


def test_the_services_book_pages_a_runs_requests(tmp_path: Path) -> None:
    db = open_database(str(tmp_path / "service.db"))
    try:
        book = DatabaseApprovals(ServiceStore(db))
        for i in range(5):
            book.submit(rm(i))
        every = book.requests("run-1")
        assert [r["action"] for r in every] == [rm(i).action for i in range(5)]  # oldest first
        assert book.requests("run-1", offset=1, limit=2) == every[1:3]
        assert book.requests("run-1", offset=4, limit=100) == every[4:]
        assert [r["action"] for r in book.pending("run-1")] == [rm(i).action for i in reversed(range(5))]
    finally:
        db.close()


def test_a_no_stands_for_the_rest_of_the_run(book: ApprovalBook) -> None:
    approver, asked = counting(Choice.DENIED)
    approvals = Approvals(approver, book)
    for _ in range(3):
        with pytest.raises(PolicyDenied, match="a human denied"):
            approvals.require(PUSH)
    assert asked == [PUSH.action]


def test_a_yes_is_applied_by_one_worker_only(book: ApprovalBook) -> None:
    """Workers resuming the same run at once (a service, two processes on one machine) race
    for the one decision: one goes ahead, the others wait for a new one."""
    book.submit(PUSH)
    book.decide(PUSH.run_id, PUSH.id, Choice.APPROVED)
    outcomes: list[str] = []
    start = threading.Barrier(8)

    def worker() -> None:
        approvals = Approvals(None, book)
        start.wait()
        try:
            approvals.require(PUSH)
            outcomes.append("went ahead")
        except ApprovalRequired:
            outcomes.append("waits")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["waits"] * 7 + ["went ahead"]


def test_spending_what_is_not_approved_does_nothing(book: ApprovalBook) -> None:
    assert not book.spend(PUSH.run_id, PUSH.id)  # never asked
    book.submit(PUSH)
    assert not book.spend(PUSH.run_id, PUSH.id) and status(book, PUSH) == "pending"
    book.decide(PUSH.run_id, PUSH.id, Choice.DENIED)
    assert not book.spend(PUSH.run_id, PUSH.id) and book.decision(PUSH) is Choice.DENIED
    book.submit(PUSH)  # a no is kept as it is
    assert book.decision(PUSH) is Choice.DENIED


def test_a_decision_is_given_once_and_a_repeated_one_is_refused(book: ApprovalBook) -> None:
    """A second approve (a retried request, a double click, a stale command line) would have
    re-armed a spent yes: the same action went ahead again, unasked. Now it is refused, and
    what it would have changed stays as it is."""
    approvals = Approvals(None, book)
    with pytest.raises(ApprovalRequired):
        approvals.require(PUSH)
    book.decide(PUSH.run_id, PUSH.id, Choice.APPROVED, by="alice")
    with pytest.raises(ApprovalDecided, match="it was approved") as twice:
        book.decide(PUSH.run_id, PUSH.id, Choice.DENIED, by="bob")
    assert twice.value.status == "approved" and not twice.value.retryable
    approvals.require(PUSH)
    with pytest.raises(ApprovalDecided, match="spent") as stale:
        book.decide(PUSH.run_id, PUSH.id, Choice.APPROVED, by="alice")
    assert stale.value.status == SPENT and status(book, PUSH) == SPENT
    with pytest.raises(ApprovalRequired):
        approvals.require(PUSH)  # asked anew, as the next push should be
    book.decide(PUSH.run_id, PUSH.id, Choice.DENIED, by="bob")  # pending again: decided once more
    with pytest.raises(ApprovalDecided, match="it was denied"):
        book.decide(PUSH.run_id, PUSH.id, Choice.APPROVED, by="mallory")
    with pytest.raises(PolicyDenied):
        approvals.require(PUSH)


def test_the_request_a_run_waits_on_is_listed_first(book: ApprovalBook) -> None:
    """An exec nobody could decide was refused on the spot and stays pending; the run then
    paused on a later request. The client that approves the first pending request (as the
    README shows) approves the one the run waits on, not the older one."""
    earlier = ApprovalRequest(run_id="run-1", action="run `rm -r src`", rule="rm -r", reason="removes")
    approvals = Approvals(None, book)
    for request in (earlier, PUSH):
        with pytest.raises(ApprovalRequired):
            approvals.require(request)
    assert [r["id"] for r in book.pending("run-1")] == [PUSH.id, earlier.id]


def test_two_threads_asking_the_same_at_once_each_get_their_own_yes(book: ApprovalBook) -> None:
    """Two execs alike judged at the same moment (``xargs -P``): the approver is asked by both;
    the second decision finds the first made (``ApprovalDecided``), reads it again, and each
    exec goes ahead on a yes of its own: no error escapes, and no yes is used twice."""
    both_asking = threading.Barrier(2)
    asked: list[str] = []

    def approver(request: ApprovalRequest) -> Choice:
        asked.append(request.action)
        if len(asked) <= 2:
            both_asking.wait(timeout=10)
        return Choice.APPROVED

    approvals = Approvals(approver, book)
    errors: list[BaseException] = []

    def judge() -> None:
        try:
            approvals.require(PUSH)
        except BaseException as error:  # what escaped is the finding
            errors.append(error)

    threads = [threading.Thread(target=judge) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(asked) >= 2 and status(book, PUSH) == SPENT


def test_forgetting_a_run_while_it_is_asked_about_is_no_error(tmp_path: Path) -> None:
    """Found from outside (``stockade mcp``): a request asked while its run's records were
    forgotten made the removal fail with an untyped ``OSError: Directory not empty``."""
    store = ApprovalStore(tmp_path / "approvals")
    stop = threading.Event()
    errors: list[BaseException] = []

    def ask() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                store.submit(ApprovalRequest(run_id="run-1", action=f"act {n}", rule="r", reason="x"))
            except BaseException as error:  # what escaped is the finding
                errors.append(error)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        for _ in range(300):
            store.forget("run-1")
    except OSError as error:
        errors.append(error)
    finally:
        stop.set()
        asker.join()
    assert errors == []
    store.forget("run-1")
    assert store.requests("run-1") == []


def test_deciding_or_spending_for_a_run_never_asked_about_leaves_nothing_behind(tmp_path: Path) -> None:
    """`stockade approve nosuch x` (a mistyped run id) made the folder of a run that never
    was, with its lock file in it."""
    store = ApprovalStore(tmp_path / "approvals")
    with pytest.raises(ConfigurationError, match="no approval request 'x' for run 'nosuch'"):
        store.decide("nosuch", "x", Choice.APPROVED)
    assert not store.spend("nosuch", "x")
    assert not (tmp_path / "approvals").exists() and store.pending() == []


def test_a_book_keeps_a_token_in_a_request_redacted_under_the_id_of_the_action_as_asked(
    book: ApprovalBook, tmp_path: Path
) -> None:
    token, other = "ghp_" + "a1" * 18, "ghp_" + "b2" * 18
    asked = ApprovalRequest(
        run_id="run-1", action=f"run `git push --token {token}`", rule="push", reason=token
    )
    elsewhere = ApprovalRequest(
        run_id="run-1", action=asked.action.replace(token, other), rule="push", reason=other
    )
    approvals = Approvals(store=book)
    for request in (asked, elsewhere):
        with pytest.raises(ApprovalRequired):
            approvals.require(request)
    asked, elsewhere = book.keyed(asked), book.keyed(elsewhere)  # the ids the book keeps them by
    kept = book.requests("run-1")
    assert asked.id != elsewhere.id and {r["id"] for r in kept} == {asked.id, elsewhere.id}
    assert all("ghp_" not in r["action"] + r["reason"] for r in kept)
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())  # files, database
    assert token.encode() not in stored and other.encode() not in stored

    book.decide("run-1", asked.id, Choice.APPROVED)
    approvals.require(asked)  # found under its id: the same action as asked
    with pytest.raises(ApprovalRequired):
        approvals.require(elsewhere)  # a yes to one token is no yes to another

    # the run ends: what is still asked is closed under the id it was asked under
    (closed,) = approvals.withdraw("run-1")
    assert closed.id == elsewhere.id and status(book, elsewhere) == "denied"


def test_the_id_of_a_redacted_action_tells_nothing_of_its_secret(book: ApprovalBook, tmp_path: Path) -> None:
    """The id was the sha256 of the action as asked, kept beside the action redacted: whoever
    read the book (or the trail, or the service's approvals) recovered a password by guessing
    at 2.1 M guesses a second. Now it is an HMAC under the book's own secret key."""
    secret = "ghp_" + "c3" * 18
    asked = ApprovalRequest(run_id="run-1", action=f"run `curl -H 'token {secret}'`", rule="curl", reason="")
    with pytest.raises(ApprovalRequired) as caught:
        Approvals(store=book).require(asked)
    (kept,) = book.requests("run-1")
    guessed = hashlib.sha256(f"run-1\0{asked.action}\0curl".encode()).hexdigest()[:16]
    assert kept["id"] == caught.value.request_id != guessed
    assert book.keyed(asked).id == kept["id"]  # asked again: the same question
    assert book.keyed(PUSH).id == PUSH.id  # nothing redacted: the id of the action, as before


def test_an_action_shown_masked_is_keyed_by_what_was_asked(book: ApprovalBook, tmp_path: Path) -> None:
    """An exec's request shows its words as the trail has them, masked already: its id was the
    sha256 of that text, so `rm -r keep_token=A` and `rm -r keep_token=B` were one question, and
    a yes to the one was spent by the other. Now the id is an HMAC of the action as asked."""
    shown = "run `rm -r 'keep_token=[REDACTED:assignment]'`"
    one, another = (
        ApprovalRequest(
            run_id="run-1", action=shown, asked_as=f"run `rm -r keep_token={value}`", rule="rm -r", reason=""
        )
        for value in ("SHOWN1234", "OTHER5678")
    )
    approvals = Approvals(store=book)
    for request in (one, another):
        with pytest.raises(ApprovalRequired):
            approvals.require(request)
    one, another = book.keyed(one), book.keyed(another)
    assert one.id != another.id and {r["action"] for r in book.requests("run-1")} == {shown}
    assert "SHOWN1234" not in repr(one)
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())  # files, database
    assert b"SHOWN1234" not in stored and b"OTHER5678" not in stored

    book.decide("run-1", one.id, Choice.APPROVED)
    with pytest.raises(ApprovalRequired):
        approvals.require(another)  # shown alike, yet no yes to it
    approvals.require(one)
    assert status(book, one) == SPENT and status(book, another) == "pending"


def test_a_folder_s_key_is_private_made_once_and_shared_by_its_books(tmp_path: Path) -> None:
    asked = ApprovalRequest(
        run_id="run-1", action="run `login --token ghp_" + "d4" * 18 + "`", rule="r", reason=""
    )
    first, second = ApprovalStore(tmp_path / "approvals"), ApprovalStore(tmp_path / "approvals")
    assert first.keyed(asked).id == second.keyed(asked).id  # a resume in another process finds it
    assert ApprovalStore(tmp_path / "other").keyed(asked).id != first.keyed(asked).id
    assert stat.S_IMODE((tmp_path / "approvals" / ".key").stat().st_mode) == 0o600
    first.submit(first.keyed(asked))
    assert [r["run_id"] for r in first.pending()] == ["run-1"]  # the key is no run


def test_a_damaged_request_file_is_named_and_the_others_still_listed(tmp_path: Path) -> None:
    """One file that is no JSON object failed every run's listing (JSONDecodeError, or
    AttributeError for a list), and `approve` of a FIFO hung for ever: each is named, with
    what to do, and the other requests are listed and decided as before."""
    from typer.testing import CliRunner

    from stockade.cli.main import app

    store = ApprovalStore(tmp_path)
    store.submit(dataclasses.replace(PUSH, run_id="run-ok"))
    (kept,) = store.pending()
    (tmp_path / "run-1").mkdir()
    (tmp_path / "run-1" / "r1.json").write_text("{bad json")
    (tmp_path / "run-1" / "r2.json").write_text("[1, 2]")
    (tmp_path / "run-2").mkdir()
    os.mkfifo(tmp_path / "run-2" / "r3.json")
    assert [r["id"] for r in store.pending()] == [kept["id"]]
    assert len(store.damaged()) == 3

    runner = CliRunner()
    listed = runner.invoke(app, ["approvals", "--dir", str(tmp_path)])
    assert listed.exit_code == 1 and kept["id"] in listed.stdout, listed.output
    said = " ".join(listed.stderr.split())
    assert said.count("is damaged (no JSON object): remove it") == 2 and "is a FIFO: remove it" in said, said
    for run, request in (("run-1", "r2"), ("run-2", "r3")):
        decided = runner.invoke(app, ["approve", run, request, "--dir", str(tmp_path)])
        assert decided.exit_code == 1 and "remove it" in decided.stderr, decided.output
    assert runner.invoke(app, ["approve", "run-ok", kept["id"], "--dir", str(tmp_path)]).exit_code == 0


def test_approve_or_deny_of_what_waits_for_nothing_exits_two_with_its_fix(tmp_path: Path) -> None:
    """An unknown run or request, and a request decided already, are errors in what the command
    was given: exit 2 and what to do, as the CLI's other commands (it was exit 1, no fix)."""
    from typer.testing import CliRunner

    from stockade.cli.main import app

    runner = CliRunner()
    folder = ["--dir", str(tmp_path)]
    for verb in ("approve", "deny"):
        unknown = runner.invoke(app, [verb, "nosuchrun", "abc", *folder])
        assert unknown.exit_code == 2, unknown.output
        assert "no approval request 'abc' for run 'nosuchrun'" in unknown.stderr
        assert "stockade approvals" in unknown.stderr
    ApprovalStore(tmp_path).submit(PUSH)
    assert runner.invoke(app, ["approve", PUSH.run_id, PUSH.id, *folder]).exit_code == 0
    again = runner.invoke(app, ["deny", PUSH.run_id, PUSH.id, *folder])
    assert again.exit_code == 2 and "waits for no decision" in again.stderr, again.output
    assert "fix:" in again.stderr
    assert "Exit codes" in runner.invoke(app, ["approve", "--help"]).output
