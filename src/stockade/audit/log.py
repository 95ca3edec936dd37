"""``AuditLog``: record events into a store's hash chain, fast and from any thread.

``record()`` redacts the event on the caller's thread (secrets never reach memory buffers,
the store, or a log line about a failed write) and queues it; events are sealed and written
in batches, when ``batch_size`` are queued, every ``flush_interval_s`` from a background
thread, on ``flush()``/``close()``, and before each action: ``check()``, which the wrappers
that record actions call before each, writes what is queued, so that no action starts while
an earlier one is unwritten (a background write that failed, or one that would fail now,
stops the next action, not only the next record). If the store fails, the events stay queued
and every ``record()`` and ``check()`` raises ``AuditStoreError`` until a write succeeds: a
broken audit trail stops the caller rather than letting it act unrecorded. A log its owner never
closed is flushed at the interpreter's exit, after every egress proxy left open closed
(``stockade._exit``: the flusher is a daemon thread, frozen then, and would lose the last
``flush_interval_s`` of events); a ``SIGKILL`` loses them (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from types import TracebackType

from stockade import _exit
from stockade import exceptions as exc
from stockade._checks import check_id, check_number
from stockade.audit._store_append import check_chain
from stockade.audit.events import AuditEvent, Chain, Draft, EventKind
from stockade.audit.redact import Redactor
from stockade.audit.sealing import Sealer
from stockade.audit.stores import AuditStore

__all__ = ["AuditLog"]

_log = logging.getLogger(__name__)


MAX_INT64 = 2**63 - 1  # what the stores' integer columns hold


class AuditLog:
    """Appends to the chain of ``store``; keyed (HMAC-SHA256) when ``key`` is given."""

    def __init__(
        self,
        store: AuditStore,
        *,
        key: bytes | None = None,
        redactor: Redactor | None = None,
        batch_size: int = 512,
        flush_interval_s: float | None = 0.2,
        max_pending: int = 100_000,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        # typed refusals here, not a TypeError at the first record, or a flusher thread that
        # died on a flush_interval_s of "x" and never wrote again
        check_number(batch_size, argument="batch_size", integer=True, low=1, high=1 << 20)
        check_number(max_pending, argument="max_pending", integer=True, low=1, high=1 << 40)
        if flush_interval_s is not None:
            check_number(flush_interval_s, argument="flush_interval_s", integer=False, low=0, high=3600,
                         unit="s", low_inclusive=False)  # fmt: skip
        if redactor is not None and not isinstance(redactor, Redactor):
            raise exc.InvalidArgument("AuditLog.redactor must be a Redactor", argument="redactor")
        if not callable(clock):
            raise exc.InvalidArgument(
                "AuditLog.clock must be a function giving nanoseconds", argument="clock"
            )
        self.store = store
        self.chain = Chain(key)
        # a key that is not the store's fails here, before any event is queued (append checks
        # again, under the store's lock: the head may move meanwhile)
        check_chain(store.head(), self.chain, store.ns)
        self.redactor = redactor if redactor is not None else Redactor()
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self.clock = clock
        self._pending: list[Draft] = []
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._error: BaseException | None = None
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._sealers: dict[str, Sealer] = {}
        _exit.keep(self, _exit.LOGS)

    def seal_run(self, run_id: str, subject: str) -> None:
        """From now on, seal the attributes of ``run_id``'s events: the run holds personal data
        of ``subject``, which ``erase(subject=...)`` can later make unreadable
        without touching the chain (``stockade.audit.sealing``)."""
        if run_id not in self._sealers:
            self._sealers[run_id] = Sealer(run_id, self.store.run_key(run_id, subject))

    def erase(self, *, run_ids: Collection[str] = (), subject: str | None = None) -> list[str]:
        """Forget the keys of these sealed runs and of every run of ``subject``, each erasure a
        ``run_erased`` event of the chain (``AuditStore.erase_keys``); returns the runs."""
        gone = self.store.erase_keys(self.chain, run_ids=run_ids, subject=subject)
        for run in gone:
            self._sealers.pop(run, None)
        return gone

    def continue_sealing(self, run_id: str) -> bool:
        """Seal ``run_id``'s events if its earlier events were (a resumed run about a subject);
        whether they are. A run whose key was erased is not sealed again: it has no key."""
        if run_id not in self._sealers:
            key = self.store.run_keys([run_id]).get(run_id)
            if key is None:
                return False
            self._sealers[run_id] = Sealer(run_id, key)
        return True

    def record(
        self,
        kind: EventKind,
        *,
        run_id: str,
        step: int = 0,
        actor: str = "",
        duration_s: float | None = None,
        attributes: Mapping[str, object] | None = None,
        timestamp_ns: int | None = None,
    ) -> None:
        """Queue one event. ``attributes`` are redacted and made JSON here, on this thread.
        ``InvalidArgument`` for a run id or actor the store cannot keep (nothing queued)."""
        check_id(run_id, argument="run_id", empty=True)
        check_id(actor, argument="actor", empty=True)
        # Checked here, not at the flush: an event the store cannot take went back to the
        # front of the queue, and every later record() failed (found from outside).
        try:
            kind = EventKind(kind)
        except ValueError:
            raise exc.InvalidArgument(f"no audit event kind {kind!r}", argument="kind") from None
        check_number(step, argument="step", integer=True, low=0, high=MAX_INT64)
        if timestamp_ns is not None:
            check_number(timestamp_ns, argument="timestamp_ns", integer=True, low=0, high=MAX_INT64)
        if duration_s is not None:
            check_number(duration_s, argument="duration_s", integer=False, low=0, high=MAX_INT64 / 1e9)
        redact = self.redactor
        attrs = redact.attributes(attributes) if attributes else {}
        sealer = self._sealers.get(run_id)
        if sealer is not None and attrs:
            attrs = sealer.seal(attrs)
        draft = Draft(
            run_id=redact.text(run_id),
            kind=kind,
            step=step,
            actor=redact.text(actor),
            timestamp_ns=self.clock() if timestamp_ns is None else timestamp_ns,
            duration_ns=None if duration_s is None else round(duration_s * 1e9),
            attributes=attrs,
        )
        self._enqueue(draft)

    def _enqueue(self, draft: Draft) -> None:
        if self._closed:
            raise exc.ConfigurationError("this AuditLog is closed")
        with self._pending_lock:
            if len(self._pending) >= self.max_pending:
                raise exc.AuditStoreError(
                    f"{len(self._pending)} audit events are waiting for {self.store.url}; refusing more"
                )
            self._pending.append(draft)
            full = len(self._pending) >= self.batch_size
            broken = self._error is not None
        if broken:
            # This write is the retry that mends it: without one (no flusher, nothing checked
            # first) every record() after a full disk that cleared still failed, for ever.
            with contextlib.suppress(Exception):
                self.flush()
        self._raise_if_broken()
        if full:
            self.flush()
        elif self.flush_interval_s is not None and self._flusher is None:
            self._start_flusher()

    def check(self) -> None:
        """Before an action: write what is queued, so that the trail holds everything recorded
        before it; ``AuditStoreError`` if that write fails, and while the trail is broken (from
        a write that failed, in the background too, until one succeeds). The wrappers that
        record actions (``AuditedBackend``, the agent's ``AuditObserver``) check before each
        action, so that none starts while what came before it is unwritten. (Checking only for
        a failed write let every action of a ``flush_interval_s`` run unrecorded before the
        write that failed was known: a full disk, 11 ``run_code`` calls of 15.) A write per
        action: a SQLite commit without fsync, about 0.17 ms (docs/architecture.md)."""
        if self._pending:
            try:
                self.flush()
            except Exception as error:
                raise exc.AuditStoreError(f"writing to the audit store failed: {error}") from error
        self._raise_if_broken()

    def _raise_if_broken(self) -> None:
        error = self._error
        if error is not None:
            raise exc.AuditStoreError(f"writing to the audit store failed: {error}") from error

    def flush(self) -> list[AuditEvent]:
        """Seal and write everything queued; returns the sealed events. Raises ``AuditStoreError``."""
        with self._flush_lock:
            with self._pending_lock:
                batch, self._pending = self._pending, []
            if not batch:
                return []
            try:
                sealed = self.store.append(batch, self.chain)
            except BaseException as error:
                with self._pending_lock:
                    self._pending[:0] = batch  # keep order: the failed batch goes first next time
                    if isinstance(error, Exception):
                        self._error = error  # broken until a write succeeds
                raise
            with self._pending_lock:
                self._error = None
            return sealed

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _start_flusher(self) -> None:
        with self._pending_lock:
            if self._flusher is not None:
                return
            self._flusher = threading.Thread(
                target=self._flush_loop, name="stockade-audit-flush", daemon=True
            )
        self._flusher.start()

    def _flush_loop(self) -> None:
        assert self.flush_interval_s is not None
        while not self._closed:
            self._wake.wait(self.flush_interval_s)
            if self._closed:
                return
            with contextlib.suppress(Exception):  # kept by flush(): raised on the caller's thread
                self.flush()

    def close(self) -> None:
        """Write what is queued and stop the background flusher. Idempotent; the store stays open."""
        if self._closed:
            return
        self._closed = True
        _exit.forget(self, _exit.LOGS)
        self._wake.set()
        if self._flusher is not None:
            self._flusher.join()
        self.flush()

    def finish_at_exit(self) -> None:
        """Write what is still queued: the flusher, a daemon thread, is about to freeze."""
        try:
            self.flush()
        except Exception as error:  # nobody is left to raise to: say it where it can be seen
            _log.error("%d audit events were not written at exit: %s", self.pending, error)

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc_value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
