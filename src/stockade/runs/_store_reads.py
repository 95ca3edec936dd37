"""What readers read across runs: the run list and one run's summary (runs whose process died
shown ``interrupted``), run ids by prefix, what ``audit verify`` cross-checks (the ledger,
forged rows, calls in flight, live, stored and erased runs), and a run's whole trace.

A base of ``RunStore`` (``store``), above what a run records (``_store_records``), which a
trace gathers; a claim asks the summary whether a run ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from stockade._checks import check_strings, check_text
from stockade.agent.state import RunStatus, ToolCallRecord
from stockade.audit.ledger import ForgedRow, LedgerCall
from stockade.runs._mac import select, unauthentic_rows
from stockade.runs._schema import summary_from_row
from stockade.runs._store_parts import check_run_id
from stockade.runs._store_records import RunRecords
from stockade.runs.lease_keeper import STALE_WHY
from stockade.runs.records import RunSummary, RunTrace

__all__ = ["RunReads"]


class RunReads(RunRecords):
    """The store as its readers see it (see ``RunStore``)."""

    def sweep(self) -> list[str]:
        """Mark ``interrupted`` the runs still ``running`` whose lease expired or whose process
        is gone; returns their ids (``runs`` and ``summary`` sweep first)."""
        return self._leases.sweep()

    def _stale(self) -> frozenset[str]:
        """The runs whose process died, still ``running`` in the rows: none once swept; opened
        read-only, they are shown ``interrupted`` as a sweep would mark them, and left as they are."""
        if self.db.read_only:
            return frozenset(self._leases.stale())
        self.sweep()
        return frozenset()

    def runs(self, *, limit: int = 50, status: RunStatus | None = None) -> list[RunSummary]:
        """The most recently updated runs first (runs whose process died: ``interrupted``)."""
        stale = self._stale()
        where, params = ("WHERE status = ?", [status.value]) if status is not None else ("", [])
        if stale and status in (RunStatus.RUNNING, RunStatus.INTERRUPTED):
            listed = f"run_id IN ({', '.join('?' * len(stale))})"
            where += f" AND NOT {listed}" if status is RunStatus.RUNNING else f" OR {listed}"
            params += sorted(stale)
        rows = self.db.query(
            f"{select(self.ns, 'runs')} {where} ORDER BY updated_ns DESC LIMIT ?", [*params, limit]
        )
        return [self._summary(row, stale) for row in rows]

    def summary(self, run_id: str) -> RunSummary | None:
        """The run's row (``RunStoreCorrupt`` where it was edited: a resume, the service and the
        viewer act on its status)."""
        check_run_id(run_id)
        stale = self._stale()
        rows = self.db.query(f"{select(self.ns, 'runs')} WHERE run_id = ?", (run_id,))
        self.mac.check(self.ns, "runs", rows, store=self._where)
        return _swept(summary_from_row(rows[0][:-1]), stale) if rows else None

    def _summary(self, row: tuple[object, ...], stale: frozenset[str]) -> RunSummary:
        """A row read with its MAC as the summary it is (``forged``: the MAC does not match)."""
        forged = self.mac.unauthentic(self.ns, "runs", row) is not None
        return _swept(dataclasses.replace(summary_from_row(row[:-1]), forged=forged), stale)

    def find(self, prefix: str) -> list[str]:
        """Run ids starting with ``prefix``, in its case (the CLI's show, workspace and replay
        accept a unique prefix; ``runs erase`` takes whole ids). An empty prefix names no run:
        it was every run. ``substr`` and not ``LIKE``: SQLite's ``LIKE`` ignores case, so
        ``PROD`` found ``prod-Main`` there and not on PostgreSQL."""
        if not isinstance(prefix, str):  # an int was an AttributeError
            check_text(prefix, argument="prefix", fix="give the start of a run id")
        try:
            prefix.encode("utf-8")
        except UnicodeEncodeError:  # a byte no UTF-8 holds (``$'\xff'``): no run id starts so
            return []
        if not prefix:
            return []
        rows = self.db.query(  # both count characters (code points), as len() does
            f"SELECT run_id FROM {self.ns}_runs WHERE substr(run_id, 1, ?) = ? ORDER BY run_id LIMIT 10",
            (len(prefix), prefix),
        )
        return [str(r[0]) for r in rows]

    def erased_runs(self, run_ids: Collection[str]) -> set[str]:
        """Those of ``run_ids`` this store erased (their ids stay taken)."""
        return self._among("erased", run_ids)

    def _among(self, table: str, run_ids: Collection[str]) -> set[str]:
        """Those of ``run_ids`` with a row in this store's ``table``, asked 500 at a time."""
        runs = [check_run_id(run_id) for run_id in check_strings(run_ids, argument="run_ids")]
        found: set[str] = set()
        for at in range(0, len(runs), 500):
            part = runs[at : at + 500]
            marks = ",".join("?" * len(part))
            sql = f"SELECT run_id FROM {self.ns}_{table} WHERE run_id IN ({marks})"
            found.update(str(r) for (r,) in self.db.query(sql, part))
        return found

    def tool_calls(
        self, run_id: str, *, step: int | None = None, keys: Collection[str] | None = None
    ) -> list[ToolCallRecord]:
        """The ledger of ``run_id`` (in the order the calls returned); ``keys``: only the
        calls of these idempotency keys."""
        check_run_id(run_id)
        return self._ledger.tool_calls(run_id, step=step, keys=keys)

    def ledger_calls(self, run_id: str | None = None) -> list[LedgerCall]:
        """The ledger as ``audit verify`` cross-checks it: every call but the denied ones."""
        if run_id is not None:
            check_run_id(run_id)
        return self._ledger.ledger_calls(run_id)

    def forged_rows(self, run_id: str | None = None) -> list[ForgedRow]:
        """The rows a resume would act on whose MAC is missing or wrong (none without the key),
        as ``audit verify`` reports them."""
        if run_id is not None:
            check_run_id(run_id)
        return [
            ForgedRow(row.run_id, str(row)) for row in unauthentic_rows(self.db, self.ns, self.mac, run_id)
        ]

    def calls_in_flight(self, run_id: str | None = None) -> list[LedgerCall]:
        """The calls a dead process was running (started, never returned, of a run neither
        ended, nor live, nor stopped by its process), as ``audit verify`` reports them."""
        if run_id is not None:
            check_run_id(run_id)
        return self._ledger.calls_in_flight(run_id)

    def live_runs(self, run_ids: Collection[str]) -> set[str]:
        """Those of ``run_ids`` a live process holds now, by a lease the store signed (when it
        has the key): ``audit verify`` reports no call of theirs in flight."""
        run_ids = [check_run_id(run_id) for run_id in check_strings(run_ids, argument="run_ids")]
        return self._leases.live(run_ids)

    def stored_runs(self, run_ids: Collection[str]) -> set[str]:
        """Those of ``run_ids`` this store has a run row of (``audit verify``: a run its trail
        says a store recorded, gone with no erasure recorded, was deleted behind its back)."""
        return self._among("runs", run_ids)

    def trace(self, run_id: str) -> RunTrace | None:
        check_run_id(run_id)
        summary = self.summary(run_id)
        state = self.load(run_id) if summary is not None else None
        if summary is None or state is None:
            return None
        return RunTrace(
            summary=summary,
            state=state,
            retries=tuple(self.retries(run_id)),
            approvals=tuple(self.approvals(run_id)),
            diff=self._diff(run_id),
        )


def _swept(summary: RunSummary, stale: frozenset[str]) -> RunSummary:
    if summary.run_id not in stale or summary.status is not RunStatus.RUNNING:
        return summary
    return dataclasses.replace(summary, status=RunStatus.INTERRUPTED, error=STALE_WHY)
