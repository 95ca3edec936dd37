"""The interface every audit store implements (``AuditStore``) and the values it keeps: a stored
event as it is on disk (``Row``) and the head record (``Head``). Apart from the stores: it is
what ``verify``, the viewer and the writers are written against, whichever store is behind it.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from stockade import exceptions as exc
from stockade._checks import check_number
from stockade.audit.events import AuditEvent, Chain, Draft
from stockade.audit.sealing import SEALED, open_attributes

__all__ = ["AuditStore", "Head", "Row", "after"]


def after(seq: object) -> int:
    """A reader's ``after_seq``: a whole number (``InvalidArgument`` else), held to what a
    stored seq can be (one past every seq reads nothing; below 0, from the start)."""
    check_number(seq, argument="after_seq", integer=True, low=-math.inf, high=math.inf)
    assert isinstance(seq, int)
    return max(0, min(seq, 2**63 - 1))


@dataclass(frozen=True, kw_only=True)
class Head:
    """The last event of a store's chain as the store recorded it, with the chain's algorithm."""

    seq: int
    hash: str
    algorithm: str
    mac: str


class Row(NamedTuple):
    """One stored event as it is on disk: the columns ``verify`` cross-checks against ``body``."""

    seq: int
    run_id: str
    kind: str
    body: str
    hash: str
    step: int
    timestamp_ns: int


class AuditStore(abc.ABC):
    """An append-only home for one hash chain."""

    url: str
    ns: str = "audit"  # the namespace the chain is kept under: its head's MAC names it

    @abc.abstractmethod
    def append(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        """Atomically seal ``drafts`` after the current head, write them and move the head.

        Raises ``ConfigurationError`` if ``chain`` is not the chain this store was started with
        (another algorithm, or another key: the head's MAC does not verify), writing nothing.
        """

    @abc.abstractmethod
    def rows(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[Row]:
        """Stored events in ``seq`` order, as stored (no check)."""

    @abc.abstractmethod
    def head(self) -> Head | None:
        """The head record, or ``None`` for an empty store."""

    def events(self, *, run_id: str | None = None, after_seq: int = 0) -> Iterator[AuditEvent]:
        """Stored events, parsed (unverified: use ``verify`` to trust them). A sealed run's
        attributes are opened with its key, or marked ``$erased`` once the key is gone.
        ``AuditIntegrityError`` naming the seq at a row that is no readable event (edited)."""
        return self.opened(self.rows(run_id=run_id, after_seq=after_seq))

    def opened(self, rows: Iterable[Row]) -> Iterator[AuditEvent]:
        """``rows`` as events (``events``, of rows read otherwise: a ``window``)."""
        keys: dict[str, bytes | None] = {}
        for row in rows:
            event = AuditEvent.from_body(row.body.encode(errors="surrogatepass"), row.hash, seq=row.seq)
            if SEALED in event.attributes:
                if event.run_id not in keys:
                    keys[event.run_id] = self.run_keys([event.run_id]).get(event.run_id)
                try:
                    opened = open_attributes(event.run_id, event.attributes, keys[event.run_id])
                except exc.AuditIntegrityError as error:
                    raise exc.AuditIntegrityError(f"seq {row.seq}: {error}") from None
                event = dataclasses.replace(event, attributes=opened)
            yield event

    def window(
        self,
        run_id: str,
        *,
        after_seq: int = 0,
        before_seq: int | None = None,
        limit: int,
        newest: bool = False,
    ) -> list[Row]:
        """At most ``limit`` stored events of ``run_id`` between ``after_seq`` and
        ``before_seq`` (both left out), in ``seq`` order: the first of them, or the newest
        (``newest``). What the run viewer shows of a run: the SQL stores read that many rows
        of the run's index from either end, whatever the run's size; this reads the run's
        rows up to them."""
        start, end = after(after_seq), None if before_seq is None else after(before_seq)
        kept: deque[Row] = deque(maxlen=max(0, limit))
        for row in self.rows(run_id=run_id, after_seq=start):
            if end is not None and row.seq >= end:
                break
            kept.append(row)
            if not newest and len(kept) >= limit:
                break
        return list(kept)

    def rows_at(self, seqs: Collection[int]) -> list[Row]:
        """The stored events at these ``seq`` (those there are), in ``seq`` order: the
        neighbours a run's check reads to see how its events link into the chain
        (``verify_run``). The SQL stores read them by their key; this reads from each."""
        found = []
        for seq in sorted(set(seqs)):
            for row in self.rows(after_seq=seq - 1):
                if row.seq == seq:
                    found.append(row)
                break
        return found

    # -- the keys of sealed runs (stockade.audit.sealing): kept apart from the chain, erasable --

    @abc.abstractmethod
    def run_key(self, run_id: str, subject: str) -> bytes:
        """The key the events of ``run_id``, a run about data subject ``subject``, are sealed
        with; made and kept on first use."""

    @abc.abstractmethod
    def run_keys(self, run_ids: Collection[str]) -> dict[str, bytes]:
        """The keys of these runs that are still kept (an erased run has none)."""

    @abc.abstractmethod
    def erase_keys(
        self, chain: Chain, *, run_ids: Collection[str] = (), subject: str | None = None
    ) -> list[str]:
        """Forget the keys of these runs, and of every run of ``subject``, and append one
        ``run_erased`` event of each (``chain``: the writers' chain, as for ``append``), in one
        transaction: what their events said can never be read again, the chain verifies as
        before, and ``verify`` tells this erasure from a key deleted or replaced outside
        stockade. Returns the runs (none: nothing appended, no chain needed)."""

    def close(self) -> None:  # noqa: B027 - stores without resources need nothing here
        """Release connections. Idempotent."""

    def __enter__(self) -> AuditStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
