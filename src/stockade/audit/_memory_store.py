"""The audit store in memory (``MemoryStore``), for tests and short-lived tools: the interface
kept in a list, without a database.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Sequence

from stockade.audit._store_append import check_chain, erasures, seal_batch
from stockade.audit._store_base import AuditStore, Head, Row, after
from stockade.audit.events import AuditEvent, Chain, Draft
from stockade.audit.sealing import new_key

__all__ = ["MemoryStore"]


class MemoryStore(AuditStore):
    """Events in a list: for tests (``stockade.testing.capture_audit``) and short-lived tools."""

    url = "memory:"

    def __init__(self) -> None:
        self._rows: list[Row] = []
        self._head: Head | None = None
        self._keys: dict[str, tuple[str, bytes]] = {}  # run id -> (subject, key)
        self._lock = threading.Lock()

    def run_key(self, run_id: str, subject: str) -> bytes:
        with self._lock:
            return self._keys.setdefault(run_id, (subject, new_key()))[1]

    def run_keys(self, run_ids: Collection[str]) -> dict[str, bytes]:
        with self._lock:
            return {r: self._keys[r][1] for r in run_ids if r in self._keys}

    def erase_keys(
        self, chain: Chain, *, run_ids: Collection[str] = (), subject: str | None = None
    ) -> list[str]:
        with self._lock:
            gone = [r for r, (s, _) in self._keys.items() if r in set(run_ids) or s == subject]
            if gone:
                self._seal(erasures(gone), chain)
            for run in gone:
                del self._keys[run]
            return gone

    def append(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        with self._lock:
            return self._seal(drafts, chain)

    def _seal(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        check_chain(self._head, chain, self.ns)
        sealed, self._head = seal_batch(drafts, chain, self._head, self.ns)
        self._rows.extend(
            Row(e.seq, e.run_id, e.kind.value, e.body.decode(), e.hash, e.step, e.timestamp_ns)
            for e in sealed
        )
        return sealed

    def rows(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[Row]:
        with self._lock:
            snapshot = list(self._rows)
        start = after(after_seq)
        return (r for r in snapshot if r.seq > start and (run_id is None or r.run_id == run_id))

    def head(self) -> Head | None:
        return self._head

    def rows_at(self, seqs: Collection[int]) -> list[Row]:
        with self._lock:
            stored = self._rows  # seq n is at n - 1: the list is only ever appended to
            return [stored[s - 1] for s in sorted(set(seqs)) if 0 < s <= len(stored)]
