"""Who holds the viewer's cookie (``ViewerAuth``): `stockade ui`'s printed key (``KeyAuth``) or
a session of an API token (``ServiceAuth``), each turning a cookie into the runs its holder
may see and the event streams it may hold. Apart from the routes, which take either.
"""

from __future__ import annotations

import hmac
from typing import Any, Protocol

from stockade import exceptions as exc
from stockade.server.streams import StreamSlot, StreamSlots
from stockade.server.viewer.data import ServiceRuns
from stockade.server.viewer.sessions import Sessions
from stockade.server.viewer.values import RunSource

__all__ = ["LOCAL_STREAMS", "KeyAuth", "ServiceAuth", "ViewerAuth"]

LOCAL_STREAMS = 16  # `stockade ui`'s streams open at once (the service's: ServiceConfig.max_streams)


class ViewerAuth(Protocol):
    """Turns the viewer's cookie into the runs its holder may see."""

    hint: str  # what to paste at sign-in
    # Whether a link may carry the credential (``/ui/login?key=``): `stockade ui`'s own key,
    # printed for one laptop; never an API token, which a URL would put in access logs and
    # which another site's link could sign a browser in with.
    link_sign_in: bool

    def sign_in(self, credential: str) -> str:
        """What the cookie holds for the holder of ``credential`` (``AuthenticationError`` for
        a credential that is not one)."""

    def source(self, cookie: str) -> RunSource:
        """The runs the cookie's holder may see; ``AuthenticationError`` for a cookie that is
        not (or no longer) one."""

    def sign_out(self, cookie: str) -> None: ...

    def check(self, cookie: str, source: RunSource) -> None:
        """``AuthenticationError`` once ``cookie`` no longer holds what ``source`` was made
        for (signed out, expired, its token taken out); counted against no rate: a stream
        asks it as it goes."""

    def release(self, source: RunSource) -> None: ...

    def stream(self, source: RunSource) -> StreamSlot:
        """A slot for one more event stream of ``source``'s holder; ``RateLimited`` when it
        has as many open as it may."""


class KeyAuth:
    """``stockade ui``: one source, and a key printed at start (a laptop's other users can
    reach 127.0.0.1 too)."""

    hint = "the key `stockade ui` printed"
    link_sign_in = True

    def __init__(self, source: RunSource, key: str) -> None:
        self._source = source
        self.key = key
        self.streams = StreamSlots(LOCAL_STREAMS)

    def sign_in(self, credential: str) -> str:
        self.source(credential)
        return credential  # the key is this viewer's alone, made for this one start

    def source(self, cookie: str) -> RunSource:
        if not hmac.compare_digest(cookie.encode(), self.key.encode()):
            raise exc.AuthenticationError("that is not this viewer's key: use the one `stockade ui` printed")
        return self._source

    def sign_out(self, cookie: str) -> None:
        pass

    def check(self, cookie: str, source: RunSource) -> None:
        self.source(cookie)

    def release(self, source: RunSource) -> None:
        pass

    def stream(self, source: RunSource) -> StreamSlot:
        return self.streams.take("local", who="this viewer")


class ServiceAuth:
    """``stockade serve``: an API token signs in; the cookie holds a session made for it
    (``sessions.py``), never the token. Its tenant's runs, its role's buttons."""

    hint = "an API token (stk_…), from `stockade token new`"
    link_sign_in = False

    def __init__(self, service: Any) -> None:
        self.service = service
        self.sessions = Sessions(service.config.tenants, service.store)

    def sign_in(self, credential: str) -> str:
        cookie = self.sessions.start(credential)
        self.source(cookie)  # the tenant's rate counts sign-ins too
        return cookie

    def source(self, cookie: str) -> RunSource:
        principal = self.sessions.check(cookie).principal
        self.service.limits.admit(principal)
        return ServiceRuns(self.service, principal)

    def sign_out(self, cookie: str) -> None:
        self.sessions.end(cookie)

    def check(self, cookie: str, source: RunSource) -> None:
        assert isinstance(source, ServiceRuns)  # what ``source`` made
        now = self.sessions.check(cookie).principal
        if not now.stands_as(source.principal):  # a role changed reaches other runs
            raise exc.AuthenticationError(
                "the session's token no longer stands for that tenant and role: sign in again"
            )

    def release(self, source: RunSource) -> None:
        pass

    def stream(self, source: RunSource) -> StreamSlot:
        assert isinstance(source, ServiceRuns)  # what ``source`` made
        tenant = source.principal.tenant.id
        slot: StreamSlot = self.service.streams.take(tenant, who=f"tenant {tenant!r}")  # with the API's
        return slot
