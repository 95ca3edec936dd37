"""``capture_audit()``: see what a piece of code records, as ``structlog.testing.capture_logs``.

    with capture_audit() as audit:
        sbx = Sandbox.create(backend=AuditedBackend(FakeBackend(), audit, run_id="r1"))
        sbx.commands.run("make test")
        sbx.close()
    assert audit.kinds() == [EventKind.SANDBOX_START, EventKind.COMMAND, EventKind.SANDBOX_STOP]

The captured log is a real ``AuditLog`` (same redaction, same chain) over memory that seals
every event as it is recorded, so ``audit.events`` is always up to date and verifiable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from stockade.audit.events import AuditEvent, EventKind
from stockade.audit.log import AuditLog
from stockade.audit.redact import Redactor
from stockade.audit.stores import MemoryStore

__all__ = ["CapturedAudit", "capture_audit"]


class CapturedAudit(AuditLog):
    """An ``AuditLog`` in memory, unbatched, with helpers to look at what was recorded."""

    def __init__(self, *, key: bytes | None = None, redactor: Redactor | None = None) -> None:
        super().__init__(MemoryStore(), key=key, redactor=redactor, batch_size=1, flush_interval_s=None)

    @property
    def events(self) -> list[AuditEvent]:
        return list(self.store.events())

    def kinds(self) -> list[EventKind]:
        return [event.kind for event in self.events]

    def of(self, kind: EventKind) -> list[AuditEvent]:
        return [event for event in self.events if event.kind == kind]


@contextmanager
def capture_audit(*, key: bytes | None = None, redactor: Redactor | None = None) -> Iterator[CapturedAudit]:
    """A fresh in-memory audit log to hand to the code under test."""
    audit = CapturedAudit(key=key, redactor=redactor)
    try:
        yield audit
    finally:
        audit.close()
