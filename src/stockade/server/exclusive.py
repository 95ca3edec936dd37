"""What a tenant may do only one at a time in one API process: verifying its whole audit
trail (``GET /v1/audit/verify``) reads every event of it (~10 us an event: 5 s of a core at
500,000 events, which a tenant reaches in well under an hour of ordinary calls), so four asked
at once held both cores of a 2-core host for 18 s each, slowing every other tenant's requests.
A second one while the first runs is refused (429, ``Retry-After``): its answer would be the
first's."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from stockade import exceptions as exc

__all__ = ["OnePerKey"]

RETRY_S = 5.0  # what a refused client is told to wait: about what a long trail's check takes


class OnePerKey:
    """At most one holder per key (a tenant) at once in this process."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._held: set[str] = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, key: str, *, who: str) -> Iterator[None]:
        """``RateLimited`` when ``key`` is held already; else held until the block ends."""
        with self._lock:
            if key in self._held:
                raise exc.RateLimited(
                    f"{who} has {self.what} running already: one at a time (ask again when it answers)",
                    key=f"one:{key}",
                    retry_after=RETRY_S,
                )
            self._held.add(key)
        try:
            yield
        finally:
            with self._lock:
                self._held.discard(key)

    def held(self, key: str) -> bool:
        with self._lock:
            return key in self._held
