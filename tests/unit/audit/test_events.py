"""The canonical form and the hash chain, in isolation."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from stockade import ConfigurationError
from stockade.audit import GENESIS, AuditEvent, Chain, Draft, EventKind, canonical
from stockade.exceptions import AuditIntegrityError


def draft(**changes: object) -> Draft:
    values: dict[str, object] = {
        "run_id": "run-1",
        "kind": EventKind.TOOL_CALL,
        "step": 2,
        "actor": "agent",
        "timestamp_ns": 1_700_000_000_000_000_000,
        "duration_ns": 1500,
        "attributes": {"tool": "run_code"},
    }
    values.update(changes)
    return Draft(**values)  # type: ignore[arg-type]


def test_canonical_form_is_sorted_compact_utf8() -> None:
    assert canonical({"b": 1, "a": {"z": "é", "y": [1, 2.5]}}) == '{"a":{"y":[1,2.5],"z":"é"},"b":1}'.encode()


def test_canonical_form_refuses_nan() -> None:
    with pytest.raises(ValueError):
        canonical({"x": float("nan")})


def test_an_event_hashes_the_previous_hash_and_its_canonical_body() -> None:
    event = Chain().seal(draft(), seq=1, prev_hash=GENESIS)

    assert event.hash == hashlib.sha256(GENESIS.encode() + event.body).hexdigest()
    body = json.loads(event.body)
    assert body["seq"] == 1 and body["prev_hash"] == GENESIS and body["kind"] == "tool_call"
    assert "hash" not in body


def test_a_keyed_chain_is_an_hmac_that_plain_sha256_cannot_reproduce() -> None:
    key = b"k" * 32
    keyed = Chain(key).seal(draft(), seq=1, prev_hash=GENESIS)
    plain = Chain().seal(draft(), seq=1, prev_hash=GENESIS)

    assert keyed.hash == hmac.new(key, GENESIS.encode() + keyed.body, "sha256").hexdigest()
    assert keyed.hash != plain.hash
    assert Chain(key).algorithm == "hmac-sha256" and Chain().algorithm == "sha256"


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="16 bytes"):
        Chain(b"short")


def test_a_sealed_event_round_trips_through_its_body() -> None:
    event = Chain().seal(draft(), seq=7, prev_hash="ab" * 32)
    again = type(event).from_body(event.body, event.hash)

    assert again == event
    assert again.duration_s == 1.5e-6
    assert again.to_json()["hash"] == event.hash


def edited_body(**changes: object) -> bytes:
    data = json.loads(Chain().seal(draft(), seq=7, prev_hash=GENESIS).body)
    data.update(changes)
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    "body",
    [
        b"not json at all",
        b"[2, 3]",
        edited_body(kind="nosuch"),
        edited_body(step="2"),
        edited_body(seq=True),
        edited_body(attributes=["a"]),
        edited_body(timestamp_ns=10**30),
        b'{"seq": 7}',
    ],
    ids=[
        "not-json",
        "not-an-object",
        "unknown-kind",
        "text-step",
        "bool-seq",
        "list-attrs",
        "no-date",
        "fields",
    ],
)
def test_a_body_that_is_no_event_is_an_integrity_error_naming_its_seq(body: bytes) -> None:
    """Read back from an edited row (tail, export), such a body raised JSONDecodeError,
    ValueError or KeyError, or made an event that failed later, where it was shown."""
    with pytest.raises(AuditIntegrityError, match=r"^seq 7 is not a readable audit event"):
        AuditEvent.from_body(body, "ab" * 32, seq=7)
