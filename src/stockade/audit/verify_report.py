"""What ``verify`` finds: each ``Problem`` by its ``ProblemKind``, and the ``VerifyReport``.

Values apart from the checks that produce them, so that the passes over the chain (``verify``)
and the checks of what the events say of runs (``_run_book``) share them, one importing the
other only one way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from stockade import exceptions as exc
from stockade.audit.stores import Head

__all__ = ["Problem", "ProblemKind", "VerifyReport"]


class ProblemKind(enum.StrEnum):
    EDITED = "edited"  # the body does not hash to the stored hash
    BROKEN_LINK = "broken_link"  # prev_hash is not the hash of the event before
    MISSING = "missing"  # a gap in seq: events were deleted
    OUT_OF_ORDER = "out_of_order"  # seq repeats or goes back, or the body's seq is not the row's
    COLUMN_MISMATCH = "column_mismatch"  # a queryable column differs from the signed body
    UNREADABLE = "unreadable"  # the body is not the canonical JSON of an event
    TRUNCATED = "truncated"  # the head record says the chain went further
    HEAD_FORGED = "head_forged"  # the head record does not match its MAC or the chain's end
    WRONG_KEY = "wrong_key"  # the chain is keyed and no key (or another key) was given
    DOWNGRADED = "downgraded"  # a key was given and the head says the chain is not keyed
    UNEXPECTED_HEAD = "unexpected_head"  # the chain does not reach the head the caller pinned
    NOT_IN_TRAIL = "not_in_trail"  # the run store's ledger has a tool call the trail does not
    NOT_IN_LEDGER = "not_in_ledger"  # a tool_call event of a run the ledger knows, not in its ledger
    DUPLICATE_IN_TRAIL = "duplicate_in_trail"  # a tool_call's key, or a run's final run_end, twice
    IN_FLIGHT = "in_flight"  # a run's process died during a call: what it did is not in the trail
    STORE_FORGED = "store_forged"  # a run store row a resume acts on does not carry its MAC
    NOT_IN_STORE = "not_in_store"  # a run the trail says a run store recorded, gone from it unrecorded
    RUN_KEY_GONE = "run_key_gone"  # a sealed run's key deleted with no run_erased event in the chain
    RUN_KEY_FORGED = "run_key_forged"  # a sealed run's key does not open its events, or outlived its erasure


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One finding. ``seq`` is where it shows (0 when it concerns the store as a whole)."""

    seq: int
    kind: ProblemKind
    detail: str
    run_id: str = ""

    def __str__(self) -> str:
        return f"seq {self.seq}: {self.kind.value}: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What ``verify`` found. ``problems`` is empty when the chain is intact."""

    store: str
    run_id: str | None
    algorithm: str
    checked: int
    run_events: int
    last_seq: int
    last_hash: str
    problems: tuple[Problem, ...] = ()
    problems_elsewhere: int = 0
    problems_truncated: bool = False
    head: Head | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def found(self) -> bool:
        """Whether there was anything to verify: events in the store (of ``run_id``, if given).
        An empty trail has no problems, and proves nothing."""
        return self.checked > 0 and (self.run_id is None or self.run_events > 0)

    def raise_for_problems(self) -> None:
        if self.problems:
            raise exc.AuditIntegrityError(f"{self.store}: " + "; ".join(str(p) for p in self.problems[:5]))

    def summary(self) -> str:
        scope = f"run {self.run_id} ({self.run_events} events) in " if self.run_id is not None else ""
        if self.ok and not self.found:
            what = f"no events of run {self.run_id}" if self.checked else "no events at all"
            return f"{scope}{self.checked} events checked: {what}, nothing to verify"
        state = "intact" if self.ok else f"{len(self.problems)} problem(s)"
        return f"{scope}{self.checked} events checked ({self.algorithm}), head seq {self.last_seq}: {state}"
