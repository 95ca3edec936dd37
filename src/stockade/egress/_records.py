"""How one request through the proxy ends: its one ``EgressRecord``, and the answer the
proxy gives itself when it refuses one.

``Entry`` tells a request's record exactly once, however it ends (a cut at any await
included), with what of it went (``Progress``); ``denied`` and ``cut_short`` are the record
of a request refused before or after it went out; ``refuse`` is the proxy's own answer,
with the rule and the reason. Shared by the HTTP exchange (``_http``) and the tunnels
(``_tunnel``), whose connections end the same ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from stockade.egress._feed import load_h11
from stockade.egress._gate import Gate, Refused
from stockade.egress._streams import Stream
from stockade.types import EgressRecord

__all__ = ["Entry", "Progress", "cut_reason", "cut_short", "denied", "phrase", "refuse", "short"]


class Progress:
    """What of one HTTP request has gone each way so far, kept by the relay as it goes: a
    request that ends early (a redirect or an answer refused, a limit hit mid-body, either
    side gone, the proxy closed) is recorded with what went, not as if nothing had."""

    def __init__(self, credential: str) -> None:
        self.credential = credential  # the name of the one the request's head carries, if any
        self.sent = False  # the head went to the server (with the credential)
        self.bytes_out = 0  # body bytes passed on to the server
        self.answer = 0  # the server's final status, once its head came
        self.passed = 0  # that status, once its head was passed on to the client
        self.bytes_in = 0  # body bytes of the answer passed on to the client

    def went(self, size: int) -> None:
        """A write to the server: the head first, then ``size`` bytes of the body."""
        self.sent = True
        self.bytes_out += size

    def came(self, size: int) -> None:
        """A write to the client: the answer's head first, then ``size`` bytes of its body."""
        self.passed = self.answer
        self.bytes_in += size

    def onto(self, record: EgressRecord) -> EgressRecord:
        """``record`` with the bytes that went, and the credential's name once a head carried it."""
        return replace(
            record,
            bytes_out=self.bytes_out,
            bytes_in=self.bytes_in,
            credential=self.credential if self.sent else "",
        )


class Entry:
    """One request's ``EgressRecord``, told exactly once however the request ends.

    ``tell`` it when the request ends as it should. Until then ``record`` holds what is known
    (host, rule, SNI) and, as a ``with`` block, the entry tells that if the request ends any
    other way, at any await (the proxy closed or reset at a lookup, a TLS hello, a connect,
    a reply; the client gone): why, with what of it went (``progress``, once an HTTP
    request is sent: its bytes, its credential, the server's status if the client got it;
    status 0 before), so a cut is in the trail too. ``decided`` is a record settled before
    its last awaits (a refusal still to be sent): told as it is if what follows is cut."""

    def __init__(self, gate: Gate, record: EgressRecord) -> None:
        self.gate = gate
        self.record = record
        self.progress: Progress | None = None
        self.decided: EgressRecord | None = None
        self.started = time.monotonic()
        self.told = False

    def tell(self, record: EgressRecord) -> None:
        if not self.told:
            self.told = True
            self.gate.emit(replace(record, duration_s=time.monotonic() - self.started))

    def opened(self, record: EgressRecord) -> None:
        """Tell ``record`` as the tunnel it is opens (``phase="open"``), before its end: the
        one record every request has is still told when it ends, however it ends."""
        self.gate.emit(replace(record, phase="open", duration_s=time.monotonic() - self.started))

    def hand_on(self) -> None:
        """The record is others' now (each request inside a tunnel whose TLS the proxy opened)."""
        self.told = True

    def __enter__(self) -> Entry:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if self.told or err is None:
            return
        if self.decided is not None:
            self.tell(self.decided)
        elif self.progress is not None:
            self.tell(
                replace(self.progress.onto(self.record), status=self.progress.passed, reason=cut_reason(err))
            )
        else:
            self.tell(replace(self.record, status=0, reason=cut_reason(err)))


def cut_reason(err: BaseException) -> str:
    """Why a request ended before its record was told (the kind, not the message: h11's quote bytes)."""
    if isinstance(err, asyncio.CancelledError):
        return "cut: the sandbox's proxy was closed mid-request"
    return f"cut: the connection ended mid-request ({type(err).__name__})"


async def refuse(conn: Any, client: Stream, refused: Refused, *, redact: Callable[[str], str]) -> None:
    """Answer the request ourselves: the status, the reason and the rule that refused it,
    through ``redact`` (``Gate.redact``): a reason may hold what a server sent."""
    h11 = load_h11()
    verdict = refused.verdict
    text = redact(f"stockade egress: {verdict.reason} (rule: {verdict.rule})")
    body = (text + "\n").encode("utf-8", "replace")
    reason = phrase(text)
    headers = [
        (b"Content-Type", b"text/plain; charset=utf-8"),
        (b"Content-Length", str(len(body)).encode()),
        (b"X-Stockade-Rule", phrase(redact(verdict.rule))),
        (b"Connection", b"close"),
    ]
    if conn.our_state not in (h11.SEND_RESPONSE, h11.IDLE):  # IDLE: a head h11 could not read
        return
    with contextlib.suppress(h11.LocalProtocolError):
        await client.send(conn.send(h11.Response(status_code=refused.status, headers=headers, reason=reason)))
        await client.send(conn.send(h11.Data(data=body)))
        await client.send(conn.send(h11.EndOfMessage()))


def phrase(text: str) -> bytes:
    """A reason phrase: visible ASCII and spaces only, short."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text)[:300].encode("ascii")


def cut_short(record: EgressRecord, progress: Progress, refused: Refused) -> EgressRecord:
    """The record of a request that went out and that the proxy ended early (``refused``:
    a redirect or an answer refused, a limit hit mid-body, a body that broke its framing,
    a side gone): as it was judged if its head never reached the server (``denied``, or
    ``allow`` for a server that could not be reached). Else the server had it:
    ``allow``, with the bytes that went and the credential, the status the client got (the
    server's, if its head was passed on), and the rule and reason that ended it, after
    what the server answered, if it did (a ``302`` refused says both)."""
    if not progress.sent:
        nothing = denied(progress.onto(record), refused)
        return replace(nothing, decision="allow") if refused.verdict.allowed else nothing
    after = f"the server answered {progress.answer}, then " if progress.answer else "sent, then "
    return replace(
        progress.onto(record),
        status=progress.passed or refused.status,
        decision="allow",
        rule=refused.verdict.rule,
        reason=after + refused.verdict.reason,
    )


def denied(record: EgressRecord, refused: Refused) -> EgressRecord:
    return replace(
        record,
        status=refused.status,
        decision="deny",
        rule=refused.verdict.rule,
        reason=refused.verdict.reason,
    )


def short(path: str, limit: int = 2048) -> str:
    return path if len(path) <= limit else path[:limit] + "…"
