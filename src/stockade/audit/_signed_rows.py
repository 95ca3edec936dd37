"""One row of the chain against its signed body: the fields the body signs, read fast, and
where the row's columns (or its link to the event before) differ from them.

Apart from the passes over the chain (``verify``, ``verify_run``), which read every row
through these and differ only in which rows they read and how they link them.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from stockade.audit.verify_report import ProblemKind

# The end of a canonical body: sorted keys put these scalars last, after "attributes", so
# the match anchored at the end is the top-level one (quotes inside strings are escaped).
# Reading them this way is about twice as fast as parsing the body; a body it does not fit
# is parsed as JSON, and the hash still covers every byte.
_STRING = r'"(?:[^"\\]|\\.)*"'
_TAIL = re.compile(
    rf'"kind":({_STRING}),"prev_hash":"([^"]*)","run_id":({_STRING}),"seq":(-?\d+),'
    r'"step":(-?\d+),"timestamp_ns":(-?\d+),"v":\d+}\Z'
)


class Signed(NamedTuple):
    seq: int
    prev: str
    run_id: str
    kind: str
    step: int
    timestamp_ns: int


def signed_fields(body: str, strings: dict[str, str]) -> Signed:
    """What ``body`` signs of its row's columns; ``ValueError`` if it is not an event."""
    match = _TAIL.match(body, max(0, body.rfind('"kind":"')))
    if match is None:
        try:
            data = json.loads(body)
            return Signed(
                data["seq"],
                data["prev_hash"],
                data["run_id"],
                data["kind"],
                data["step"],
                data["timestamp_ns"],
            )
        except (KeyError, TypeError, RecursionError) as error:  # not an event, or nested past reading
            raise ValueError("not an audit event") from error
    kind_token, prev, run_token, seq, step, timestamp_ns = match.groups()
    for token in (kind_token, run_token):
        if token not in strings:
            if len(strings) > 10_000:
                strings.clear()
            strings[token] = json.loads(token)
    return Signed(int(seq), prev, strings[run_token], strings[kind_token], int(step), int(timestamp_ns))


BROKEN = (
    "prev_hash is not the hash of the event before: that event was edited, "
    "or events were removed or inserted between them"
)


def mismatches(
    seq: int, run: str, kind: str, signed: Signed, *, step: int, timestamp_ns: int, prev: str | None = None
) -> list[tuple[ProblemKind, str]]:
    """Where a row's columns differ from what its body signs; and, given the hash of the event
    read before it (``prev``), whether its link does."""
    found = []
    if signed.seq != seq:
        detail = f"the row is seq {seq} but its signed body says {signed.seq} (moved or renumbered)"
        found.append((ProblemKind.OUT_OF_ORDER, detail))
    if prev is not None and signed.prev != prev:
        found.append((ProblemKind.BROKEN_LINK, BROKEN))
    if signed.run_id != run or signed.kind != kind:
        detail = f"columns say {run!r}/{kind!r}, the signed body {signed.run_id!r}/{signed.kind!r}"
        found.append((ProblemKind.COLUMN_MISMATCH, detail))
    if signed.step != step or signed.timestamp_ns != timestamp_ns:
        detail = (
            f"columns say step {step!r} at {timestamp_ns!r}, the signed body step {signed.step} "
            f"at {signed.timestamp_ns}"
        )
        found.append((ProblemKind.COLUMN_MISMATCH, detail))
    return found
