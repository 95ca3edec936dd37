"""Audit events, their canonical form, and the hash chain that links them.

An event is sealed when it is written: the store gives it the next ``seq`` and the hash of
the event before (``prev_hash``), and ``hash`` covers both, so editing, dropping, inserting
or reordering any event breaks the chain at that point.

The canonical form is the bytes that are hashed and stored: JSON with sorted keys, no
whitespace, UTF-8, no NaN/Infinity. Times are integer nanoseconds so that any language can
reproduce the bytes exactly.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeAlias, TypeVar

__all__ = [
    "FORMAT_VERSION",
    "GENESIS",
    "AuditEvent",
    "Chain",
    "Draft",
    "EventKind",
    "JSONValue",
    "canonical",
]

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"
Attributes: TypeAlias = Mapping[str, JSONValue]
_T = TypeVar("_T")

# The prev_hash of the first event of a store.
GENESIS = "0" * 64
FORMAT_VERSION = 1
# A run_start's attribute: a run store records the run (``verify`` with the store's ledger
# then finds its rows, or the trail's record of their erasure).
STORED = "stored"


class EventKind(enum.StrEnum):
    """What happened. Values are stored; never rename one, only add."""

    RUN_START = "run_start"
    RUN_END = "run_end"
    STEP = "step"
    MODEL_CALL = "model_call"
    TOOL_CALL = "tool_call"
    POLICY_DECISION = "policy_decision"
    APPROVAL = "approval"
    RETRY = "retry"
    BREAKER_CHANGE = "breaker_change"
    RATE_LIMITED = "rate_limited"
    BUDGET = "budget"
    KILL_SWITCH = "kill_switch"
    ANOMALY = "anomaly"
    SANDBOX_START = "sandbox_start"
    SANDBOX_STOP = "sandbox_stop"
    COMMAND = "command"
    RUN_CODE = "run_code"
    FILE_WRITE = "file_write"
    FILE_REMOVE = "file_remove"
    SANDBOX_RESET = "sandbox_reset"
    ERROR = "error"
    NOTE = "note"
    CHECK = "check"
    RUN_CRASH = "run_crash"  # found on resume: the run's process died while running it
    EXEC = "exec"  # a program the sandbox's rules judged at its exec, inside the sandbox
    SNAPSHOT_TAKE = "snapshot_take"  # a sandbox saved (snapshot, or pause), with the snapshot's id
    SNAPSHOT_RESTORE = "snapshot_restore"  # a sandbox started from a snapshot (resume, fork)
    EGRESS = "egress"  # a request through the sandbox's egress proxy, allowed or refused
    TOOL_CALL_START = "tool_call_start"  # a tool call about to run (its tool_call comes when it returns)
    OP_START = "op_start"  # a command or run_code about to run in a sandbox (its event comes at the end)
    RUN_ERASED = "run_erased"  # a sealed run's key forgotten (erasure): its attributes are unreadable
    EGRESS_OPEN = "egress_open"  # a spliced tunnel allowed, as it opens (its egress comes when it ends)


def canonical(obj: Mapping[str, Any]) -> bytes:
    """Deterministic JSON bytes: sorted keys, no whitespace, UTF-8, finite numbers only. A
    lone surrogate (a label or argv word of bytes that are no UTF-8) is written as its JSON
    escape: UTF-8 has no bytes for it, and one in an event made every later write of that
    log fail (the batch that held it was tried again, and failed again, for good)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return json_utf8(text).encode()


def json_utf8(text: str) -> str:
    """JSON text (from ``json.dumps(..., ensure_ascii=False)``) with its lone surrogates as their
    escapes: text UTF-8 can write, and the same JSON (a surrogate is only ever in a string)."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, kw_only=True)
class Draft:
    """An event as recorded, before the store seals it into the chain."""

    run_id: str
    kind: EventKind
    step: int = 0
    actor: str = ""
    timestamp_ns: int
    duration_ns: int | None = None
    attributes: Attributes = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class AuditEvent:
    """One sealed event of the audit trail.

    ``body`` is the canonical form that ``hash`` covers (everything but ``hash`` itself).
    """

    seq: int
    run_id: str
    kind: EventKind
    step: int
    actor: str
    timestamp_ns: int
    duration_ns: int | None
    attributes: Attributes
    prev_hash: str
    hash: str
    body: bytes = field(repr=False, compare=False)

    @property
    def timestamp(self) -> datetime:
        return datetime.fromtimestamp(self.timestamp_ns / 1e9, tz=UTC)

    @property
    def duration_s(self) -> float | None:
        return None if self.duration_ns is None else self.duration_ns / 1e9

    def to_json(self) -> dict[str, JSONValue]:
        """The event as one JSON object (the export format): the body, its hash, a readable time.
        (A sealed run's attributes are exported opened: ``body`` holds the ciphertext.)"""
        out: dict[str, JSONValue] = json.loads(self.body)
        out["attributes"] = dict(self.attributes)  # a sealed run's, as opened (or marked erased)
        out["hash"] = self.hash
        out["time"] = self.timestamp.isoformat()
        return out

    @classmethod
    def from_body(cls, body: bytes, hash: str, *, seq: int | None = None) -> AuditEvent:
        """The event a stored body holds. ``AuditIntegrityError`` (naming ``seq``, the row's)
        for a body that is no event stockade writes: edited around the store, which readers
        report rather than crash on (``verify`` says how it was edited)."""
        try:
            data = json.loads(body)
            event = cls(
                seq=_typed(data["seq"], int),
                run_id=_typed(data["run_id"], str),
                kind=EventKind(data["kind"]),
                step=_typed(data["step"], int),
                actor=_typed(data["actor"], str),
                timestamp_ns=_typed(data["timestamp_ns"], int),
                duration_ns=None if data["duration_ns"] is None else _typed(data["duration_ns"], int),
                attributes=_typed(data["attributes"], dict),
                prev_hash=_typed(data["prev_hash"], str),
                hash=hash,
                body=body,
            )
            event.timestamp  # noqa: B018 - a time no date can hold (year 10000) is no event's either
        except (ValueError, KeyError, TypeError, OverflowError, OSError, RecursionError) as error:
            from stockade.exceptions import AuditIntegrityError

            where = f"seq {seq}" if seq is not None else "an audit event"
            raise AuditIntegrityError(
                f"{where} is not a readable audit event ({type(error).__name__}: {error}): the store was "
                "edited; run `stockade audit verify` to see how"
            ) from None
        return event


def _typed(value: object, kind: type[_T]) -> _T:
    # bool is an int to Python, never a seq or a time to stockade
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{value!r:.40} is not {kind.__name__}")
    return value


class Chain:
    """How events are hashed: SHA-256, or HMAC-SHA256 when a key is given.

    Without the key, someone who can rewrite the whole store can recompute a plain SHA-256
    chain; they cannot recompute an HMAC one. The head record is MAC'd the same way.
    """

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and not isinstance(key, bytes):  # a str or an int: a TypeError deep in hmac
            from stockade.exceptions import InvalidArgument

            raise InvalidArgument(
                f"an audit key is bytes, got {type(key).__name__}",
                argument="key",
                fix="give bytes (str.encode())",
            )
        if key is not None and len(key) < 16:
            from stockade.exceptions import ConfigurationError

            raise ConfigurationError("an audit key must be at least 16 bytes")
        self._key = key
        self.algorithm = "sha256" if key is None else "hmac-sha256"

    @property
    def keyed(self) -> bool:
        return self._key is not None

    def link(self, prev_hash: str, body: bytes) -> str:
        data = prev_hash.encode() + body
        if self._key is None:
            return hashlib.sha256(data).hexdigest()
        return hmac.digest(self._key, data, "sha256").hex()

    def head_mac(self, seq: int, hash: str, namespace: str) -> str:
        """Binds the head record (last seq and hash) to the namespace the store keeps the chain
        under, so that it can neither be moved back nor copied under another namespace (one
        tenant's trail shown as another's) unnoticed."""
        return self.link(GENESIS, f"head:{namespace}:{seq}:{hash}".encode())

    def head_verifies(self, seq: int, hash: str, namespace: str, mac: str) -> bool:
        """Whether ``mac`` is the head's MAC; a head written before the MAC named its namespace
        (``head:SEQ:HASH``) is taken until the store's next append writes one that does."""
        return mac in (self.head_mac(seq, hash, namespace), self.link(GENESIS, f"head:{seq}:{hash}".encode()))

    def seal(self, draft: Draft, seq: int, prev_hash: str) -> AuditEvent:
        body = canonical(
            {
                "v": FORMAT_VERSION,
                "seq": seq,
                "run_id": draft.run_id,
                "kind": draft.kind.value,
                "step": draft.step,
                "actor": draft.actor,
                "timestamp_ns": draft.timestamp_ns,
                "duration_ns": draft.duration_ns,
                "attributes": draft.attributes,
                "prev_hash": prev_hash,
            }
        )
        return AuditEvent(
            seq=seq,
            run_id=draft.run_id,
            kind=draft.kind,
            step=draft.step,
            actor=draft.actor,
            timestamp_ns=draft.timestamp_ns,
            duration_ns=draft.duration_ns,
            attributes=draft.attributes,
            prev_hash=prev_hash,
            hash=self.link(prev_hash, body),
            body=body,
        )
