"""A decision answers the one action it was asked for: inside a tool call, that call's n-th
question about it (a resume that runs the call again finds it); outside one, it is spent."""

from __future__ import annotations

from pathlib import Path

import pytest

from stockade._asking import asking_in
from stockade.exceptions import ApprovalRequired
from stockade.policy.approval import SPENT, ApprovalBook, Approvals, ApprovalStore, Choice, request_in_call
from stockade.server.state import DatabaseApprovals, ServiceStore, open_database


def ask(approvals: Approvals) -> None:
    approvals.require(request_in_call(run_id="r", action="run `rm -r build`", rule="rm -r", reason="r"))


def test_a_decision_outside_a_call_is_spent_once_applied(tmp_path: Path) -> None:
    store = ApprovalStore(tmp_path)
    approvals = Approvals(store=store)
    with pytest.raises(ApprovalRequired) as waiting:
        ask(approvals)
    store.decide("r", waiting.value.request_id, Choice.APPROVED)
    ask(approvals)  # the decided action runs, once
    with pytest.raises(ApprovalRequired) as again:
        ask(approvals)
    assert again.value.request_id == waiting.value.request_id
    assert [r["status"] for r in store.pending("r")] == ["pending"]


def test_inside_a_call_each_question_is_its_own_and_a_rerun_of_the_call_finds_it(tmp_path: Path) -> None:
    store = ApprovalStore(tmp_path)
    asked: list[str] = []

    def once(request: object) -> Choice | None:
        asked.append(str(request))
        return Choice.APPROVED if len(asked) == 1 else None

    with asking_in("call-1"):
        ask(Approvals(once, store))  # approved by the callback
        with pytest.raises(ApprovalRequired) as second:
            ask(Approvals(once, store))  # the same action again in the same call: asked again
    with asking_in("call-1"):  # the call runs again (a resume): its first question is answered
        ask(Approvals(None, store))
        with pytest.raises(ApprovalRequired) as still:
            ask(Approvals(None, store))
    assert still.value.request_id == second.value.request_id
    with asking_in("call-2"), pytest.raises(ApprovalRequired):
        ask(Approvals(None, store))  # a later call doing the same: its own question
    assert len(asked) == 2


@pytest.mark.parametrize("book", ["files", "database"])
def test_both_books_spend_a_decision_and_ask_it_again(tmp_path: Path, book: str) -> None:
    store: ApprovalBook = (
        ApprovalStore(tmp_path)
        if book == "files"
        else DatabaseApprovals(ServiceStore(open_database(f"sqlite:///{tmp_path / 'svc.db'}")))
    )
    approvals = Approvals(store=store)
    with pytest.raises(ApprovalRequired) as waiting:
        ask(approvals)
    store.decide("r", waiting.value.request_id, Choice.APPROVED, by="alice")
    ask(approvals)
    assert [r["status"] for r in store.requests("r")] == [SPENT]
    with pytest.raises(ApprovalRequired):
        ask(approvals)
    assert [(r["status"], r["by"] if book == "database" else "") for r in store.requests("r")] == [
        ("pending", "")
    ]
