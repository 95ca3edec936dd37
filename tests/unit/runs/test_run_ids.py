"""A run id the store cannot hold is refused by name, at the call that gave it: never an
OverflowError out of SQLite (an int past 2**63), a UnicodeEncodeError (a lone surrogate),
or a lookup of None that quietly finds nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stockade import InvalidArgument
from stockade.runs import RunStore

_CALLS: dict[str, Callable[[RunStore, object, Path], object]] = {
    "load": lambda s, r, _: s.load(r),  # type: ignore[arg-type]
    "summary": lambda s, r, _: s.summary(r),  # type: ignore[arg-type]
    "trace": lambda s, r, _: s.trace(r),  # type: ignore[arg-type]
    "claim (new)": lambda s, r, _: s.claim(r, new=True),  # type: ignore[arg-type]
    "claim (resume)": lambda s, r, _: s.claim(r, new=False),  # type: ignore[arg-type]
    "leased": lambda s, r, _: s.leased(r),  # type: ignore[arg-type]
    "tool_calls": lambda s, r, _: s.tool_calls(r),  # type: ignore[arg-type]
    "tag_subject": lambda s, r, _: s.tag_subject(r, "alice"),  # type: ignore[arg-type]
    "record_diff": lambda s, r, _: s.record_diff(r, "diff"),  # type: ignore[arg-type]
    "restore_seed": lambda s, r, tmp: s.restore_seed(r, tmp / "seed"),  # type: ignore[arg-type]
    "stored_runs": lambda s, r, _: s.stored_runs([r]),  # type: ignore[list-item]
    "live_runs": lambda s, r, _: s.live_runs([r]),  # type: ignore[list-item]
}


@pytest.mark.parametrize(
    "run_id", [2**63, "\ud800", None, 42], ids=["int past 2**63", "lone surrogate", "None", "int"]
)
@pytest.mark.parametrize("call", list(_CALLS))
def test_a_run_id_the_store_cannot_hold_is_refused_by_name(
    store: RunStore, tmp_path: Path, call: str, run_id: object
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        _CALLS[call](store, run_id, tmp_path)
    assert caught.value.argument in ("run_id", "run_ids")


def test_a_run_id_given_to_a_call_that_takes_none_for_every_run_is_checked(store: RunStore) -> None:
    assert store.ledger_calls(None) == []  # every run's: none yet
    with pytest.raises(InvalidArgument, match="run_id"):
        store.ledger_calls(2**63)  # type: ignore[arg-type]


def test_a_new_run_id_with_a_control_character_is_refused_but_a_prefix_of_no_utf8_finds_nothing(
    store: RunStore,
) -> None:
    with pytest.raises(InvalidArgument, match="control character"):
        store.claim("job\x1b[2J", new=True)  # the audit trail would refuse it at its first event
    assert store.find("\udcff") == []  # what the CLI passes for a byte no UTF-8 holds
    with pytest.raises(InvalidArgument, match="prefix"):
        store.find(5)  # type: ignore[arg-type]
