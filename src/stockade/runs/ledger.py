"""The ledger: the tool calls of each run that returned, and the calls that started.

A call's row is keyed by its idempotency key and written once, the moment the call returns
(or with the checkpoint that holds it, whichever comes first). The calls started
(``<namespace>_calls_started``) are what a resume reads to tell a call that returned from
one that started and did not: run again if its tool is idempotent, ``OutcomeUnknown``
otherwise (``checkpoints``). A call started, not returned, of a run not ended whose signed
lease is neither held nor released was cut by its process's death (``calls_in_flight``;
``audit verify`` judges by its trail the calls whose start the trail has).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Sequence

from pydantic import BaseModel, ValidationError

from stockade import exceptions as exc
from stockade.agent.state import RunStatus, ToolCallRecord
from stockade.audit.ledger import LedgerCall
from stockade.audit.redact import Redactor
from stockade.models.messages import ToolCall
from stockade.runs._db import Database, Statement
from stockade.runs._mac import RowMac, select
from stockade.runs._schema import as_int
from stockade.runs.lease_keeper import held

__all__ = ["CallLedger", "redacted_json"]


def redacted_json(redactor: Redactor, model: BaseModel, *, exclude: set[str] | None = None) -> str:
    """The model as JSON with every string redacted (keys naming a credential: the whole value)."""
    data = redactor.value(model.model_dump(mode="json", exclude=exclude))
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class CallLedger:
    """The ``<namespace>_tool_calls`` and ``<namespace>_calls_started`` tables."""

    def __init__(
        self,
        db: Database,
        ns: str,
        redactor: Redactor,
        mac: RowMac,
        *,
        write: Callable[[str, Sequence[Statement]], None],
        where: str,
    ) -> None:
        self.db = db
        self.ns = ns
        self.redactor = redactor
        self.mac = mac
        self._write = write  # fenced by the run's lease
        self._where = where

    def insert_sql(self) -> str:
        return f"INSERT INTO {self.ns}_tool_calls VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"

    def row(self, run_id: str, step: int, record: ToolCallRecord, now: int) -> tuple[object, ...]:
        return self.mac.signed(
            "tool_calls",
            (
                record.idempotency_key,
                run_id,
                step,
                record.call.id,
                record.call.name,
                now,
                redacted_json(self.redactor, record),
            ),
        )

    def tool_calls(
        self, run_id: str, *, step: int | None = None, keys: Collection[str] | None = None
    ) -> list[ToolCallRecord]:
        """The ledger of ``run_id`` (in the order the calls returned); ``keys``: only the
        calls of these idempotency keys, each read by the table's key (the run viewer's
        window: never the run's whole ledger)."""
        sql = f"{select(self.ns, 'tool_calls')} WHERE run_id = ?"
        params: list[object] = [run_id]
        if step is not None:
            sql += " AND step = ?"
            params.append(step)
        if keys is None:
            rows = self.db.query(sql + " ORDER BY recorded_ns, idempotency_key", params)
        else:
            wanted, rows = sorted(set(keys)), list[tuple[object, ...]]()
            for at in range(0, len(wanted), _KEYS_AT_ONCE):
                part = wanted[at : at + _KEYS_AT_ONCE]
                found = f"{sql} AND idempotency_key IN ({','.join('?' * len(part))})"
                rows.extend(self.db.query(found, [*params, *part]))
            rows.sort(key=lambda r: (as_int(r[5]), str(r[0])))  # recorded_ns, then the key
        self.mac.check(self.ns, "tool_calls", rows, store=self._where)
        records = []
        for key, *_, body, _ in rows:
            try:
                records.append(ToolCallRecord.model_validate_json(str(body)))
            except ValidationError as error:
                raise exc.RunStoreCorrupt(
                    f"run store {self._where}: the {self.ns}_tool_calls row {str(key)!r} cannot be read "
                    f"({error.errors()[0]['msg'] if error.errors() else error})"
                ) from None
        return records

    def ledger_calls(self, run_id: str | None = None) -> list[LedgerCall]:
        """The ledger as ``audit verify`` cross-checks it: every call but the denied ones."""
        sql = f"SELECT run_id, step, idempotency_key, tool, body FROM {self.ns}_tool_calls"
        rows = (
            self.db.query(sql + " WHERE run_id = ?", (run_id,)) if run_id is not None else self.db.query(sql)
        )
        calls = []
        for run, step, key, tool, body in rows:
            try:
                denied = json.loads(str(body)).get("denied") is True
            except (ValueError, AttributeError):
                denied = False  # unreadable: cross-checked all the same
            if not denied:
                calls.append(
                    LedgerCall(run_id=str(run), step=as_int(step), idempotency_key=str(key), tool=str(tool))
                )
        return calls

    def calls_in_flight(self, run_id: str | None = None) -> list[LedgerCall]:
        """The calls its process died during: started, never returned, of a run that has not
        ended and whose lease its process neither holds (alive) nor released (it stopped the
        run itself, cutting the call: ``interrupted``, ``killed``). A lease row missing, or
        one the store did not sign, proves neither. A resume closes them (its load records
        each as returned or ``OutcomeUnknown``). ``audit verify`` judges by its trail the
        calls whose start the trail has: this is for those it lacks."""
        ns = self.ns
        sql = (
            f"SELECT s.run_id, s.step, s.idempotency_key, s.tool, l.run_id, l.owner, l.expires_ns, l.mac "
            f"FROM {ns}_calls_started s LEFT JOIN {ns}_leases l ON l.run_id = s.run_id "
            f"JOIN {ns}_runs r ON r.run_id = s.run_id "
            f"WHERE r.status NOT IN ({', '.join('?' * len(_ENDED))}) "
            f"AND NOT EXISTS (SELECT 1 FROM {ns}_tool_calls t WHERE t.idempotency_key = s.idempotency_key)"
        )
        params: list[object] = list(_ENDED)
        if run_id is not None:
            sql += " AND s.run_id = ?"
            params.append(run_id)
        now = time.time_ns()
        cut = []
        for run, step, key, tool, *lease in self.db.query(sql + " ORDER BY s.started_ns", params):
            signed = lease[0] is not None and self.mac.unauthentic(self.ns, "leases", lease) is None
            if signed and (as_int(lease[2]) == 0 or held(lease, now)):
                continue  # released by its own process, or live
            cut.append(
                LedgerCall(run_id=str(run), step=as_int(step), idempotency_key=str(key), tool=str(tool))
            )
        return cut

    # -- calls started -------------------------------------------------------------------------

    def started(self, run_id: str, step: int) -> dict[str, bool]:
        """The calls of ``step`` that started: idempotency key -> whether their tool is idempotent."""
        rows = self.db.query(
            f"{select(self.ns, 'calls_started')} WHERE run_id = ? AND step = ?", (run_id, step)
        )
        self.mac.check(self.ns, "calls_started", rows, store=self._where)
        return {str(r[0]): bool(r[5]) for r in rows}

    def call_started(self, run_id: str, step: int, call: ToolCall, key: str, *, idempotent: bool) -> None:
        """Record that ``call`` is about to run (again: its attempts are counted)."""
        self._write(
            run_id,
            [
                (
                    f"INSERT INTO {self.ns}_calls_started VALUES (?, ?, ?, ?, ?, ?, 1, ?, ?) "
                    "ON CONFLICT (idempotency_key) DO UPDATE SET "
                    f"attempts = {self.ns}_calls_started.attempts + 1, started_ns = excluded.started_ns, "
                    "mac = excluded.mac",
                    [
                        (
                            key,
                            run_id,
                            step,
                            call.id,
                            call.name,
                            int(idempotent),
                            time.time_ns(),
                            self.mac.sign(
                                "calls_started", (key, run_id, step, call.id, call.name, int(idempotent))
                            ),
                        )
                    ],
                )
            ],
        )

    def call_parked(self, run_id: str, key: str) -> None:
        """The call stopped at an approval before its effect: forget that it started, so a
        resume runs it again (its attempts start over)."""
        sql = f"DELETE FROM {self.ns}_calls_started WHERE idempotency_key = ? AND run_id = ?"
        self._write(run_id, [(sql, [(key, run_id)])])

    def attempts(self, run_id: str) -> dict[str, int]:
        """How many times each call of the run started: idempotency key -> attempts."""
        rows = self.db.query(
            f"SELECT idempotency_key, attempts FROM {self.ns}_calls_started WHERE run_id = ?", (run_id,)
        )
        return {str(r[0]): as_int(r[1]) for r in rows}


_KEYS_AT_ONCE = 500  # a query's bound parameters (SQLite allows 32,766; older builds 999)
_ENDED = tuple(s.value for s in RunStatus if s.finished)
