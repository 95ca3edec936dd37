"""What ``verify`` cross-checks the chain with: the run store's ledger, as a protocol.

Apart from the verification so that the run store, which is one, depends on these values and
not on the checks (``stockade.runs.store`` implements ``Ledger``; ``RunsLedger`` narrows one
to a tenant's runs).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

__all__ = ["ForgedRow", "Ledger", "LedgerCall", "RunsLedger"]


class LedgerCall(NamedTuple):
    """A tool call as the run store recorded it (denied calls are policy decisions, left out)."""

    run_id: str
    step: int
    idempotency_key: str
    tool: str


class ForgedRow(NamedTuple):
    """A run store row whose MAC is wrong or missing: written by someone without the key."""

    run_id: str
    detail: str


class Ledger(Protocol):
    """What ``verify`` cross-checks the chain with (``RunStore`` is one)."""

    def ledger_calls(self, run_id: str | None = None) -> Iterable[LedgerCall]: ...

    def forged_rows(self, run_id: str | None = None) -> Iterable[ForgedRow]:
        """The rows a resume acts on whose MAC is wrong or missing (none without the key)."""
        ...

    def calls_in_flight(self, run_id: str | None = None) -> Iterable[LedgerCall]:
        """The calls a process died during (started, never returned, its run not live)."""
        ...

    def live_runs(self, run_ids: Collection[str]) -> Collection[str]:
        """Those of ``run_ids`` a live process holds now (by a lease the store signed)."""
        ...

    def stored_runs(self, run_ids: Collection[str]) -> Collection[str]:
        """Those of ``run_ids`` the store has a run row of."""
        ...


@dataclass(frozen=True)
class RunsLedger:
    """A ledger narrowed to some runs: a tenant's, on a service's database, where each tenant's
    trail is a chain of its own and one run store holds every tenant's runs."""

    ledger: Ledger
    runs: frozenset[str]

    def ledger_calls(self, run_id: str | None = None) -> list[LedgerCall]:
        return [call for call in self.ledger.ledger_calls(run_id) if call.run_id in self.runs]

    def calls_in_flight(self, run_id: str | None = None) -> list[LedgerCall]:
        return [call for call in self.ledger.calls_in_flight(run_id) if call.run_id in self.runs]

    def forged_rows(self, run_id: str | None = None) -> list[ForgedRow]:
        return [row for row in self.ledger.forged_rows(run_id) if row.run_id in self.runs]

    def live_runs(self, run_ids: Collection[str]) -> Collection[str]:
        return self.ledger.live_runs(run_ids)  # the trail's runs are the tenant's: not narrowed

    def stored_runs(self, run_ids: Collection[str]) -> Collection[str]:
        return self.ledger.stored_runs(run_ids)
