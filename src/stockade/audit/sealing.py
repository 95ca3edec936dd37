"""Sealed runs: the attributes of a run's audit events encrypted under a key of that run, which
the store keeps apart from the chain and can forget.

A run about a data subject (``AgentSession(subject=...)``, GDPR) has its events' attributes
sealed with AES-256-GCM as they are recorded: the hash chain covers the ciphertext. Erasing
the subject forgets the run's key (``AuditStore.erase_keys``): the events stay, in order,
verifying as before (nothing in the chain changed, and the events table stays append-only),
but what they said about the subject can never be read again. This is crypto-shredding, the
usual answer to "erase from an append-only log"; copies of the key made before the erasure
(a database backup) are outside its reach, as they are for any erasure.

What stays readable after an erasure: the event's kind, run, step, actor, times, and the few
attributes the chain's own checks need (``CLEAR``: a tool call's idempotency key, the tool's
name, the call an exec belongs to). Everything else a run recorded is sealed.

Needs the ``gdpr`` extra (``cryptography``), imported on first use.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stockade import exceptions as exc
from stockade.audit.events import STORED, canonical

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["CLEAR", "ERASED", "SEALED", "Sealer", "new_key", "open_attributes"]

SEALED = "$sealed"  # the attribute holding nonce + ciphertext, base64
ERASED = "$erased"  # set on what a reader gets once the run's key is gone
# Attributes left in clear: what verification and the run views need to tie events together;
# none of them is the content of an action.
CLEAR = frozenset({"idempotency_key", "tool", "call", "call_id", STORED})
_NONCE = 12


def _aesgcm(key: bytes) -> AESGCM:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as error:
        raise exc.ConfigurationError(
            'sealing audit events (runs with a data subject) needs cryptography: pip install "stockade[gdpr]"'
        ) from error
    return AESGCM(key)


def new_key() -> bytes:
    """A fresh 256-bit key for one run."""
    return os.urandom(32)


class Sealer:
    """Seals the attributes of one run's events (the run id is bound in as associated data, so
    a sealed value moved to another run's event does not open)."""

    def __init__(self, run_id: str, key: bytes) -> None:
        self._aead = _aesgcm(key)
        self._aad = run_id.encode()

    def seal(self, attributes: Mapping[str, Any]) -> dict[str, Any]:
        clear = {k: v for k, v in attributes.items() if k in CLEAR}
        hidden = {k: v for k, v in attributes.items() if k not in CLEAR}
        if not hidden:
            return clear
        nonce = os.urandom(_NONCE)
        data = nonce + self._aead.encrypt(nonce, canonical(hidden), self._aad)
        return {**clear, SEALED: base64.b64encode(data).decode()}


def open_attributes(run_id: str, attributes: Mapping[str, Any], key: bytes | None) -> dict[str, Any]:
    """The attributes as recorded; without the run's key (erased), the clear ones and
    ``$erased: true``. A sealed value that does not open under the key is reported, not guessed."""
    sealed = attributes.get(SEALED)
    clear = {k: v for k, v in attributes.items() if k != SEALED}
    if not isinstance(sealed, str):
        return dict(attributes)
    if key is None:
        return {**clear, ERASED: True}
    try:
        data = base64.b64decode(sealed, validate=True)
        plain = _aesgcm(key).decrypt(data[:_NONCE], data[_NONCE:], run_id.encode())
        hidden = json.loads(plain)
    except exc.ConfigurationError:
        raise
    except Exception as error:  # a wrong key, or a value edited in place (the chain says which)
        raise exc.AuditIntegrityError(
            f"a sealed event of run {run_id!r} does not open under its key ({type(error).__name__}): "
            "run `stockade audit verify` to see whether the trail was edited"
        ) from None
    return {**hidden, **clear}
