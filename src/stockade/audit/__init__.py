"""The audit trail: every action as an event in an append-only, hash-chained store.

    store = open_store("sqlite:///audit.db")            # or postgresql://..., memory:
    key = read_key_file("audit.key")                    # as `stockade audit verify --key-file` reads it
    with AuditLog(store, key=key) as log:               # key: optional, HMAC-SHA256
        log.record(EventKind.TOOL_CALL, run_id=run, step=3, actor="agent",
                   attributes={"tool": "run_code"})
    report = verify(store, key=key)                     # where and how the chain is broken
    verify_run(store, run_id, key=key)                  # one run's events and links: reads ~the run
    report.raise_for_problems()

Sandboxes are audited by wrapping them: ``AuditedBackend(backend, log, run_id=...)``.
"""

from stockade._config_file import read_key_file
from stockade.audit.events import GENESIS, AuditEvent, Chain, Draft, EventKind, JSONValue, canonical
from stockade.audit.log import AuditLog
from stockade.audit.redact import Redactor, SecretValues, redact_tokens
from stockade.audit.sandbox import AuditedBackend, AuditedInstance
from stockade.audit.stores import AuditStore, Head, MemoryStore, Row, SQLiteStore, open_store
from stockade.audit.verify import verify, verify_run
from stockade.audit.verify_report import Problem, ProblemKind, VerifyReport

__all__ = [
    "GENESIS",
    "AuditEvent",
    "AuditLog",
    "AuditStore",
    "AuditedBackend",
    "AuditedInstance",
    "Chain",
    "Draft",
    "EventKind",
    "Head",
    "JSONValue",
    "MemoryStore",
    "Problem",
    "ProblemKind",
    "Redactor",
    "Row",
    "SQLiteStore",
    "SecretValues",
    "VerifyReport",
    "canonical",
    "open_store",
    "read_key_file",
    "redact_tokens",
    "verify",
    "verify_run",
]
