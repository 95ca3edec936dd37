"""The viewer's sessions: what its cookie holds in place of the API token.

    v1.<token id>.<expires, unix seconds>.<nonce>.<mac>

The mac is an HMAC-SHA256, under a key of the service's own (random, kept in its database so
that every API process shares it), of the fields before it and the token's stored digest. A
cookie that leaks (a shared machine, a browser extension) is then no API token: it shows the
viewer, for at most ``SESSION_S``, and never reaches the API. Its token bound into it, a
token taken out of the tenants file or given a new secret ends its sessions at once (the file
is followed: within a second, ``TenantsFile``); signing out ends one (its nonce is kept until
it would have expired).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from stockade import exceptions as exc
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Principal, Tenants, TenantsFile

__all__ = ["SESSION_S", "Session", "Sessions"]

SESSION_S = 12 * 3600
KEY_NAME = "viewer-sessions"
_SESSION = re.compile(r"^v1\.([0-9a-f]{12})\.([0-9]{1,12})\.([0-9a-f]{32})\.([0-9a-f]{64})$")
_EXPIRED = "the viewer's session expired or was signed out: sign in again"


@dataclass(frozen=True)
class Session:
    principal: Principal
    nonce: str
    expires: int  # unix seconds


class Sessions:
    """Makes and checks the viewer's sessions for the tokens of ``tenants`` (as they are at
    each check: a ``TenantsFile`` follows its file)."""

    def __init__(self, tenants: Tenants | TenantsFile, store: ServiceStore) -> None:
        self.tenants = tenants
        self.store = store
        self._key: bytes | None = None

    def start(self, token: str) -> str:
        """A session for the holder of ``token`` (``AuthenticationError`` when it is no token)."""
        tenants = self.tenants.current()
        principal = tenants.authenticate(token)
        expires = int(time.time()) + SESSION_S
        head = f"v1.{principal.token_id}.{expires}.{secrets.token_hex(16)}"
        return f"{head}.{self._mac(head, tenants.tokens[principal.token_id].sha256)}"

    def check(self, cookie: str) -> Session:
        """The session ``cookie`` holds; ``AuthenticationError`` unless it is one of this
        service's, unexpired, not signed out, and its token is still the one it was made for."""
        match = _SESSION.match(cookie)
        if match is None:
            raise exc.AuthenticationError("that is not a session of this viewer: sign in again")
        token_id, expires, nonce, mac = match.groups()
        head = cookie[: -len(mac) - 1]
        tenants = self.tenants.current()  # one table for the whole check
        record = tenants.tokens.get(token_id)
        if record is None or not hmac.compare_digest(mac, self._mac(head, record.sha256)):
            raise exc.AuthenticationError("that is not a session of this viewer: sign in again")
        if int(expires) <= time.time() or self.store.signed_out(nonce):
            raise exc.AuthenticationError(_EXPIRED)
        return Session(principal=tenants.principal(token_id), nonce=nonce, expires=int(expires))

    def end(self, cookie: str) -> None:
        """Sign ``cookie``'s session out (nothing for one that is no longer valid)."""
        try:
            session = self.check(cookie)
        except exc.AuthenticationError:
            return
        self.store.sign_out(session.nonce, session.expires * 1_000_000_000)

    def _mac(self, head: str, digest: str) -> str:
        """Of the session's fields and its token's stored digest (a new secret ends it)."""
        if self._key is None:
            self._key = self.store.key(KEY_NAME)
        bound = f"{head}\n{digest}".encode()
        return hmac.new(self._key, bound, hashlib.sha256).hexdigest()
