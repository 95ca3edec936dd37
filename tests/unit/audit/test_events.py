"""The canonical form and the hash chain, in isolation."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from stockade import ConfigurationError
from stockade.audit import GENESIS, Chain, Draft, EventKind, canonical


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
