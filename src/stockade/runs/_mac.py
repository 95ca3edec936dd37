"""The MAC of each row a resume acts on, under a key derived from the audit trail's key.

A resume runs what the store says the model asked for, shows the model the conversation the
store holds, and puts back the workspace the store recorded: whoever can write the database
file could choose all three. So the rows that say them (checkpoints, messages, steps, the
ledger, the calls started, the workspace's path -> digest rows, a run's seed; and the lease,
which ``audit verify`` takes as proof that a run is live) carry an
HMAC-SHA256 in their ``mac`` column, over the table and the row's columns, under a key
derived from the audit trail's HMAC key (which the writer of the database does not hold).
A row whose MAC is missing or wrong is ``RunStoreCorrupt`` (a lease's is not: a claim takes
it over as before, and a lease that fails proves no run live), and ``audit verify`` reports it
(a lease's only when its MAC is wrong: an unsigned one, as earlier versions wrote, proves
nothing and so hides nothing).

What it cannot tell: a row removed (a run rolled back to an earlier checkpoint of its own),
or one put back to an earlier version of itself. A store opened without the key writes no
MACs and checks none: against a writer of the database, nothing holds then.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from stockade import exceptions as exc
from stockade.runs._db import Database
from stockade.runs._schema import SIGNED

__all__ = ["RowMac", "Unauthentic", "insert", "select", "unauthentic_rows"]

_PURPOSE = b"stockade run store rows v1"


@dataclass(frozen=True)
class Unauthentic:
    """A row whose MAC is missing or wrong: its table (without the namespace), its run, where."""

    table: str
    run_id: str
    where: str
    missing: bool

    def __str__(self) -> str:
        why = (
            "carries no MAC (written without the audit key, or its MAC removed)"
            if self.missing
            else "does not match its MAC (edited outside stockade)"
        )
        return f"the {self.where} {why}"


class RowMac:
    """Signs and checks rows; without a key, signs nothing (``None``) and checks nothing."""

    def __init__(self, audit_key: bytes | None) -> None:
        # its own key: a row's MAC is never a valid audit event MAC, nor the reverse
        self._key = None if audit_key is None else hmac.digest(audit_key, _PURPOSE, "sha256")

    @property
    def keyed(self) -> bool:
        return self._key is not None

    def sign(self, table: str, fields: Sequence[object]) -> str | None:
        if self._key is None:
            return None
        h = hmac.new(self._key, table.encode(), hashlib.sha256)
        for value in fields:  # each field length-prefixed: no two rows share an input
            data = b"\x00" if value is None else str(value).encode()
            h.update(b"%d:" % (-1 if value is None else len(data)))
            h.update(data)
        return h.hexdigest()

    def signed(self, table: str, row: Sequence[object]) -> tuple[object, ...]:
        """``row`` (the table's signed columns, in order) with its MAC after it."""
        return (*row, self.sign(table, row))

    def unauthentic(self, ns: str, table: str, row: Sequence[object]) -> Unauthentic | None:
        """What is wrong with ``row`` (the table's signed columns, then ``mac``), or None
        (always None without a key)."""
        *fields, mac = row
        expected = self.sign(table, fields)
        if expected is None or (mac is not None and hmac.compare_digest(expected, str(mac))):
            return None
        columns, naming = SIGNED[table]
        run_id = str(fields[columns.index("run_id")])
        named = ", ".join(f"{c} {v!r}" for c, v in zip(columns[:naming], fields, strict=False))
        return Unauthentic(table, run_id, f"{ns}_{table} row ({named})", missing=mac is None)

    def check(self, ns: str, table: str, rows: Sequence[Sequence[object]], *, store: str) -> None:
        """``RunStoreCorrupt`` (not retryable: the row stays as it is) unless every row is the
        store's own."""
        if self._key is None:
            return
        for row in rows:
            bad = self.unauthentic(ns, table, row)
            if bad is not None:
                raise exc.RunStoreCorrupt(
                    f"run store {store}: {bad}; no run is shown or resumed from rows the store did "
                    "not write (run `stockade audit verify` with the key to list them)"
                )


def select(ns: str, table: str) -> str:
    """``SELECT`` of the table's signed columns and its MAC (``unauthentic`` reads such rows)."""
    return f"SELECT {', '.join(SIGNED[table][0])}, mac FROM {ns}_{table}"


def insert(ns: str, table: str, conflict: str = "") -> str:
    """``INSERT`` of rows ``RowMac.signed`` made (the table's signed columns, by name, then its
    MAC); ``conflict``: what an existing row does (``ON CONFLICT ...``)."""
    columns = SIGNED[table][0]
    marks = ", ".join("?" * (len(columns) + 1))
    return f"INSERT INTO {ns}_{table} ({', '.join(columns)}, mac) VALUES ({marks}) {conflict}".rstrip()


def unauthentic_rows(db: Database, ns: str, mac: RowMac, run_id: str | None = None) -> list[Unauthentic]:
    """Every row of the signed tables (of ``run_id``) whose MAC is missing or wrong."""
    if not mac.keyed:
        return []
    found: list[Unauthentic] = []
    for table in SIGNED:
        sql, params = select(ns, table), tuple[str, ...]()
        if run_id is not None:
            sql, params = sql + " WHERE run_id = ?", (run_id,)
        for row in db.query(sql, params):
            bad = mac.unauthentic(ns, table, row)
            # An unsigned lease proves no run live (``LeaseKeeper.live``), so it hides nothing:
            # one an earlier version wrote (leases were signed from 2026-12-06) is no forgery
            if bad is not None and not (table == "leases" and bad.missing):
                found.append(bad)
    return found
