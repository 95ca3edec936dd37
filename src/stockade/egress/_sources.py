"""Reads of the credentials' sources, within a deadline, at most one in flight per source.

A sandbox's start (``_attach.attach``) and each reset (``EgressProxy.renew``) read every
credential's source on the host; a source may block (a vault asked). Each read runs on a
daemon thread of its own and the caller waits for it at most ``timeout_s``: past it, a
``SandboxStartError`` (retryable) names the source, and the read is left running.

A read still running is never started again: the next start or reset of any sandbox whose
policy names that source waits on it anew (and uses its value if it comes in time). A
source that hangs so holds one thread, however often it is asked. Before, each attempt
started a thread and abandoned it at the deadline, and a pool retried its refill every
half second after one: a hung vault cost one more host thread (and one more concurrent
read of the vault) every 10.5 s, without bound, and each reset of a member one more. A
read ends when its source answers; the attempt after that reads again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import NoReturn

from stockade.exceptions import SandboxStartError, StockadeError
from stockade.types import Credential, NetworkPolicy, SecretSource

__all__ = ["SECRETS_TIMEOUT_S", "fail", "secrets_in_time", "secrets_within"]

SECRETS_TIMEOUT_S = 10.0  # a credential source's read at start, as at a reset


class _InFlight:
    """The reads running now, by source (its id: a source need not be hashable; the source
    is kept with its read, so its id is not reused while the entry lives)."""

    def __init__(self) -> None:
        self._fresh()
        # A forked child has none of its parent's threads: their reads never end there.
        os.register_at_fork(after_in_child=self._fresh)

    def _fresh(self) -> None:
        self.lock = threading.Lock()
        self.reads: dict[int, tuple[SecretSource, concurrent.futures.Future[str]]] = {}

    def read(self, source: SecretSource) -> concurrent.futures.Future[str]:
        """The read of ``source`` in flight, or a new one started on a thread of its own."""
        key = id(source)
        with self.lock:
            kept = self.reads.get(key)
            if kept is not None:
                return kept[1]
            read: concurrent.futures.Future[str] = concurrent.futures.Future()
            read.set_running_or_notify_cancel()  # no waiter's cancel can drop it for the others
            self.reads[key] = (source, read)
        try:
            threading.Thread(
                target=self._run, args=(key, source, read), name="stockade-egress-secrets", daemon=True
            ).start()
        except BaseException:  # no thread (the host is out of them): nothing in flight
            self._done(key)
            raise
        return read

    def _run(self, key: int, source: SecretSource, read: concurrent.futures.Future[str]) -> None:
        value, error = "", None
        try:
            value = source.read()
        except BaseException as err:  # the waiters' to see (``fail``, for each credential)
            error = err
        self._done(key)  # out first: an attempt from now on reads afresh
        if error is not None:
            read.set_exception(error)
        else:
            read.set_result(value)

    def _done(self, key: int) -> None:
        with self.lock:
            self.reads.pop(key, None)


_in_flight = _InFlight()


def _reads_of(policy: NetworkPolicy) -> list[tuple[Credential, concurrent.futures.Future[str]]]:
    """Every credential's read, all in flight at once: one deadline covers them together.
    (A read started by another start or reset is joined: its value is at most the
    deadline older than this attempt.)"""
    return [(credential, _in_flight.read(credential.source)) for credential in policy.credentials]


def _values(
    reads: list[tuple[Credential, concurrent.futures.Future[str]]], timeout_s: float
) -> dict[str, str]:
    """What the reads gave: the first failure among those ended (``fail``), else a
    ``SandboxStartError`` for one not ended, else every value."""
    ended = [(credential, read) for credential, read in reads if read.done()]
    for credential, read in ended:
        error = read.exception()
        if error is not None:
            fail(credential, error)
    for credential, read in reads:
        if not read.done():
            raise SandboxStartError(
                f"credential {credential.name!r}: its source was not read in {timeout_s:g} s "
                "(its read goes on: the next start or reset waits for it rather than read again)"
            )
    return {credential.name: read.result() for credential, read in ended}


def fail(credential: Credential, error: BaseException) -> NoReturn:
    """Raise what a source's failure to read is to the sandbox's start: its own
    ``StockadeError`` (or an interrupt), else a ``SandboxStartError`` (it may be passing: a
    vault down), the source's message not quoted (it may hold what was read)."""
    if isinstance(error, StockadeError) or not isinstance(error, Exception):
        raise error
    raise SandboxStartError(
        f"credential {credential.name!r}: its source could not be read ({type(error).__name__})"
    ) from error


def secrets_within(policy: NetworkPolicy, timeout_s: float = SECRETS_TIMEOUT_S) -> dict[str, str]:
    """Each credential's value, read from its source within ``timeout_s`` (blocks)."""
    if not policy.credentials:
        return {}
    reads = _reads_of(policy)
    # a failure need not wait for the other sources: it fails the start anyway
    concurrent.futures.wait([read for _, read in reads], timeout_s, concurrent.futures.FIRST_EXCEPTION)
    return _values(reads, timeout_s)


async def secrets_in_time(policy: NetworkPolicy, timeout_s: float = SECRETS_TIMEOUT_S) -> dict[str, str]:
    """``secrets_within`` on an event loop: the loop is not held while the sources answer."""
    if not policy.credentials:
        return {}
    reads = _reads_of(policy)
    waiting = [asyncio.wrap_future(read) for _, read in reads]
    try:
        await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for waited in waiting:  # the values are taken from the reads themselves
            if not waited.done():
                waited.cancel()  # not the read (it is running): only this wait for it
            elif not waited.cancelled():
                waited.exception()  # seen: no "exception never retrieved" when it goes
    return _values(reads, timeout_s)
