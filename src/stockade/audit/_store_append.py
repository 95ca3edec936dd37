"""What every store does as it appends, whatever its database: the writer's chain checked against
the store's head (``check_chain``), a batch sealed after it (``seal_batch``), the events of an
erasure (``erasures``). Apart from the stores, so each store and the writers (``AuditLog``,
``stockade runs erase``) share one check.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from stockade import exceptions as exc
from stockade.audit._store_base import Head
from stockade.audit.events import GENESIS, AuditEvent, Chain, Draft, EventKind

__all__ = ["check_chain", "erasures", "seal_batch"]


def erasures(runs: Sequence[str]) -> list[Draft]:
    """The ``run_erased`` events of runs whose keys are being forgotten."""
    now = time.time_ns()
    return [Draft(run_id=run, kind=EventKind.RUN_ERASED, actor="stockade", timestamp_ns=now) for run in runs]


def check_chain(head: Head | None, chain: Chain, namespace: str) -> None:
    """``ConfigurationError`` unless ``chain`` is the chain the store's head was written with:
    the same algorithm and, for a keyed chain, the same key (the head's MAC verifies under it).
    A writer with another key would append events no key verifies together: every event of
    one writer reads as edited under the other's key."""
    if head is None:
        return
    if head.algorithm != chain.algorithm:
        hint = (
            "pass its key"
            if head.algorithm == "hmac-sha256"
            else "it was written without a key, or rewritten without one (`stockade audit verify` "
            "with the key reports it downgraded)"
        )
        raise exc.ConfigurationError(
            f"this audit store's chain uses {head.algorithm}, not {chain.algorithm}: {hint}"
        )
    if not chain.head_verifies(head.seq, head.hash, namespace, head.mac):  # no secret to time: it is stored
        # also what a head moved back, or copied from another namespace, looks like
        raise exc.ConfigurationError(
            f"this audit store's head record (seq {head.seq}) does not verify under this writer's "
            f"{'key' if chain.keyed else 'chain'}: the store was written with another key, or its head "
            "was edited (run `stockade audit verify` with the store's key); refusing to append"
        )


def seal_batch(
    drafts: Sequence[Draft], chain: Chain, head: Head | None, namespace: str
) -> tuple[list[AuditEvent], Head]:
    seq, prev = (head.seq, head.hash) if head is not None else (0, GENESIS)
    sealed = []
    for draft in drafts:
        seq += 1
        event = chain.seal(draft, seq, prev)
        prev = event.hash
        sealed.append(event)
    return sealed, Head(
        seq=seq, hash=prev, algorithm=chain.algorithm, mac=chain.head_mac(seq, prev, namespace)
    )
