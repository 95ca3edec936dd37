"""The run viewer's pages: server-rendered (Jinja2, autoescaped), a little plain JavaScript for
live updates, no asset from anywhere else.

    /ui/                      the runs, filtered by status, model and time
    /ui/runs/{id}             one run: its approvals, its diff, its chain and one window of its
                              timeline: its latest PAGE audit events, or those ?before=SEQ (read
                              backwards) or ?after=SEQ (forwards), with links to the others
    /ui/runs/{id}/body        the same page's body; ?after=SEQ&step=N: a live page's update,
                              the head and tail again and only the entries after SEQ
    /ui/runs/{id}/events      Server-Sent Events: "changed" when the run's trail grows, "end"
                              once it ended or waits (paused, broken): the page reconnects to a
                              waiting run now and then; a tenant holds a few streams at once.
                              The session is checked at each poll: signed out, expired or its
                              token taken out, the stream ends ("end", signed_out)
    /ui/runs/{id}/approvals/{request}   POST approve or deny (the role decides who may)
    /ui/login, /ui/logout     a token for the viewer: an API token (the service), or the key
                              ``stockade ui`` prints (a laptop)

Everything the model or its code produced is untrusted: every value a template renders has its
controls, bidi and invisible characters shown as escapes (``stockade._display.visible``: a
bidi override drew ``rm -r src`` as if it were inside an echoed string, on the card a human
approved), then the templates escape it as HTML, and every page
carries a Content-Security-Policy that runs no script but the viewer's own file, so a tool
output holding ``<script>`` is text. The cookie is HttpOnly and SameSite=Strict (and Secure
when the request came over https); on the service it holds a signed session of at most 12
hours, never the API token (``sessions.py``), which sign-out ends everywhere. Forms carry a
token derived from it (CSRF), and sign-in and sign-out take a form only from the viewer's own
pages (``Sec-Fetch-Site``, else ``Origin``): another site's form cannot sign a browser in to a
tenant of its choosing.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import importlib.resources
import json
import re
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Protocol
from urllib.parse import quote, urlencode, urlsplit

import anyio
from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stockade import __version__
from stockade import exceptions as exc
from stockade._display import visible
from stockade.policy.approval import Choice
from stockade.server.streams import HeldStream, StreamSlot, StreamSlots
from stockade.server.viewer.data import ServiceRuns
from stockade.server.viewer.sessions import Sessions
from stockade.server.viewer.values import (
    LATEST,
    SETTLED,
    STATUSES,
    Filters,
    RunSource,
    RunView,
    Window,
)

__all__ = ["CSP", "KeyAuth", "ServiceAuth", "ViewerAuth", "ViewerHeaders", "local_app", "viewer_router"]

COOKIE = "stockade_viewer"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
STATIC = {
    "viewer.css": "text/css; charset=utf-8",
    "viewer.js": "text/javascript; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
POLL_S = 0.5
# a run that waits for someone (an approval; a look at why its actions failed): its stream ends
# as the API's does, and the page comes back for it now and then (viewer.js)
WAITING = frozenset({"paused", "broken"})
LOCAL_STREAMS = 16  # `stockade ui`'s streams open at once (the service's: ServiceConfig.max_streams)
MAX_SEQ = 2**62  # as the API's `after`: a bigger number is no sequence number the database holds
# where a sign-in may go on to: a plain path (printable ASCII: it becomes a Location header)
_PLAIN_PATH = re.compile(r"[!-~]*")


class ViewerHeaders:
    """ASGI middleware: every response under the viewer's ``prefix`` carries ``HEADERS`` (those
    it does not set itself), FastAPI's own too: its 404 for a path no route has, its 405, its
    422 for a query that does not parse, which carried no CSP, no ``nosniff``, no frame
    refusal (a page a browser would render from them unconfined)."""

    def __init__(self, app: ASGIApp, *, prefix: str = "/ui") -> None:
        self.app = app
        self.prefix = prefix
        self._headers = [(name.lower().encode(), value.encode()) for name, value in HEADERS.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else None
        if path is None or not (path == self.prefix or path.startswith(self.prefix + "/")):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {name.lower() for name, _ in message.get("headers", [])}
                added = [(name, value) for name, value in self._headers if name not in have]
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        await self.app(scope, receive, with_headers)


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


def _templates() -> Any:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("stockade.server.viewer", "templates"),
        autoescape=True,  # every template, whatever its name: nothing is rendered raw
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_shown,
    )
    env.filters["when"] = lambda ts: datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
    env.filters["diff_class"] = _diff_class
    env.filters["diff_lines"] = _diff_lines
    return env


def _shown(value: object) -> object:
    """Each value a template renders, its untrusted text included: nothing that reorders what is
    drawn (bidi controls) or is not seen (zero-width characters) reaches the page raw."""
    import markupsafe

    if isinstance(value, str) and not isinstance(value, markupsafe.Markup):
        return visible(value)
    return value


def _diff_lines(diff: str) -> list[str]:
    """A diff's lines: ended by newlines alone, as git ends them. ``str.splitlines`` also ends a
    line at a form feed, a vertical tab, U+0085, U+2028..., which a changed file's line may
    hold: the rest of that line was drawn as a line of its own, classed by its first
    character (a ``+`` or ``-`` there read as a line added or removed)."""
    lines = diff.split("\n")
    return lines[:-1] if lines and not lines[-1] else lines


def _diff_class(line: str) -> str:
    if line.startswith(("+++", "---")):
        return "file"
    if line.startswith("@@"):
        return "hunk"
    return {"+": "add", "-": "del"}.get(line[:1], "ctx")


def _csrf(credential: str) -> str:
    return hmac.new(credential.encode(), b"stockade viewer form", hashlib.sha256).hexdigest()


def _parse_time(value: str | None, field: str) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise exc.InvalidArgument(
            f"{field} {value!r} is not a date and time",
            argument=field,
            fix="give e.g. 2026-01-31T14:00 (UTC)",
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


_CROSS_SITE = "a form of another site cannot sign this browser in or out: use this page's own form"


def _same_site(request: Request) -> bool:
    """Whether a form was posted from the viewer itself. Browsers say where a request comes
    from (``Sec-Fetch-Site``; older ones only ``Origin``); a request that says neither is no
    browser's cross-site form (a script holding the token could sign in anyway)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return True
    # the host as the browser asked it (a proxy in front changes the scheme, not the host)
    return urlsplit(origin).netloc == request.headers.get("host", "")


class _Viewer:
    """The routes' bodies, over one ``auth``."""

    def __init__(self, auth: ViewerAuth, prefix: str) -> None:
        self.auth = auth
        self.prefix = prefix
        self.env = _templates()

    # -- plumbing ------------------------------------------------------------------------------

    def page(self, template: str, status: int = 200, **values: Any) -> Response:
        html = self.env.get_template(template).render(prefix=self.prefix, version=__version__, **values)
        return Response(html, status_code=status, media_type="text/html; charset=utf-8", headers=HEADERS)

    def redirect(
        self, url: str, *, cookie: str | None = None, clear: bool = False, request: Request | None = None
    ) -> Response:
        response = Response(status_code=303, headers={**HEADERS, "Location": url})
        if cookie is not None:
            response.set_cookie(
                COOKIE,
                cookie,
                httponly=True,
                samesite="strict",
                # over https, never sent back over plain http (a proxy's X-Forwarded-Proto
                # counts when uvicorn trusts it: FORWARDED_ALLOW_IPS, this host by default)
                secure=request is not None and request.url.scheme == "https",
                path=self.prefix,
                max_age=12 * 3600,
            )
        if clear:
            response.delete_cookie(COOKIE, path=self.prefix)
        return response

    def target(self, next: str) -> str:
        """Where to go after signing in: a page of the viewer, nowhere else (no open redirect),
        given as a plain path (printable ASCII, no backslash: it goes into a header as is)."""
        plain = _PLAIN_PATH.fullmatch(next) is not None and "\\" not in next and "//" not in next
        return next if plain and next.startswith(self.prefix + "/") else f"{self.prefix}/"

    async def signed_in(self, request: Request) -> tuple[RunSource, str] | None:
        credential = request.cookies.get(COOKIE)
        if not credential:
            return None
        try:
            return await _blocking(lambda: self.auth.source(credential)), credential
        except exc.AuthenticationError:
            return None

    def to_login(self, request: Request) -> Response:
        return self.redirect(f"{self.prefix}/login?{urlencode({'next': request.url.path})}")

    def failed(self, status: int, message: str, source: RunSource, credential: str) -> Response:
        return self.page("error.html", status, message=message, source=source, csrf=_csrf(credential))

    # -- sign-in -------------------------------------------------------------------------------

    async def login_form(self, request: Request, key: str | None = None, next: str = "") -> Response:
        target = self.target(next)
        if key and self.auth.link_sign_in:  # the link `stockade ui` prints
            try:
                cookie = await _blocking(lambda: self.auth.sign_in(key))
            except exc.AuthenticationError as error:
                return self.page("login.html", 401, error=str(error), hint=self.auth.hint, next=target)
            return self.redirect(target, cookie=cookie, request=request)
        return self.page("login.html", error=None, hint=self.auth.hint, next=target)

    async def login(
        self, request: Request, token: Annotated[str, Form()] = "", next: Annotated[str, Form()] = ""
    ) -> Response:
        target = self.target(next)
        if not _same_site(request):  # another site's form would sign this browser in to its tenant
            return self.page("login.html", 403, error=_CROSS_SITE, hint=self.auth.hint, next=target)
        try:
            cookie = await _blocking(lambda: self.auth.sign_in(token.strip()))
        except exc.StockadeError as error:
            return self.page("login.html", 401, error=str(error), hint=self.auth.hint, next=target)
        return self.redirect(target, cookie=cookie, request=request)

    async def logout(self, request: Request) -> Response:
        if not _same_site(request):
            return self.page(
                "login.html", 403, error=_CROSS_SITE, hint=self.auth.hint, next=f"{self.prefix}/"
            )
        cookie = request.cookies.get(COOKIE)
        if cookie:  # a copy of the cookie elsewhere signs in no more
            await _blocking(lambda: self.auth.sign_out(cookie))
        return self.redirect(f"{self.prefix}/login", clear=True)

    async def static(self, name: str) -> Response:
        media = STATIC.get(name)
        if media is None:
            return Response("not found", status_code=404, headers=HEADERS)
        body = importlib.resources.files("stockade.server.viewer").joinpath("static", name).read_bytes()
        return Response(body, media_type=media, headers={**HEADERS, "Cache-Control": "max-age=300"})

    # -- the runs ------------------------------------------------------------------------------

    async def runs(
        self,
        request: Request,
        status: str = "",
        model: str = "",
        since: str = "",
        until: str = "",
        limit: int = 100,
    ) -> Response:
        who = await self.signed_in(request)
        if who is None:
            return self.to_login(request)
        source, credential = who
        form = {"status": status, "model": model, "since": since, "until": until}
        values: dict[str, Any] = {
            "source": source,
            "csrf": _csrf(credential),
            "statuses": STATUSES,
            "form": form,
        }
        try:
            filters = Filters(
                status=status or None,
                model=model or None,
                since=_parse_time(since, "since"),
                until=_parse_time(until, "until"),
                limit=max(1, min(limit, 1000)),
            )
        except exc.InvalidArgument as error:
            return self.page("runs.html", 400, runs=[], error=str(error), **values)
        found = await _blocking(lambda: source.runs(filters))
        return self.page("runs.html", runs=found, error=None, **values)

    async def view(
        self, request: Request, run_id: str, *, verified: bool, window: Window = LATEST
    ) -> tuple[RunView, RunSource, str] | Response:
        who = await self.signed_in(request)
        if who is None:
            return self.to_login(request)
        source, credential = who
        found: RunView | None = await _blocking(lambda: source.run(run_id, verified=verified, window=window))
        if found is None:
            return self.page("missing.html", 404, run_id=run_id, source=source, csrf=_csrf(credential))
        return found, source, credential

    async def run_page(
        self,
        request: Request,
        run_id: str,
        before: Annotated[int | None, Query(ge=1, le=MAX_SEQ)] = None,
        after: Annotated[int | None, Query(ge=0, le=MAX_SEQ)] = None,
    ) -> Response:
        window = Window(after=after) if after is not None else Window(before=before)
        # the run's events are verified on its own page (each one, and its links into the
        # chain: ``verify_run``, bounded by the run, not the trail), not again on earlier pages
        got = await self.view(request, run_id, verified=window == LATEST, window=window)
        if isinstance(got, Response):
            return got
        run, source, credential = got
        base = f"{self.prefix}/runs/{quote(run_id)}"
        return self.page(
            "run.html",
            run=run,
            source=source,
            csrf=_csrf(credential),
            events=f"{base}/events",
            body=f"{base}/body",
        )

    async def run_body(
        self,
        request: Request,
        run_id: str,
        verified: int = 0,
        after: Annotated[int | None, Query(ge=0, le=MAX_SEQ)] = None,
        step: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
    ) -> Response:
        """The page's body (its latest window), or with ``after`` a live page's update: the
        entries after the last it shows (``PAGE`` at most: ``data-more`` asks for the rest),
        never the whole run again at each event."""
        window = Window(after=after, step=step) if after is not None else LATEST
        got = await self.view(request, run_id, verified=bool(verified), window=window)
        if isinstance(got, Response):
            return got
        run, source, credential = got
        template = "_run_body.html" if after is None else "_run_delta.html"
        return self.page(template, run=run, source=source, csrf=_csrf(credential))

    async def run_events(
        self,
        request: Request,
        run_id: str,
        after: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
        status: Annotated[str, Query(max_length=32)] = "",  # the page's: unchanged is no news
    ) -> Response:
        who = await self.signed_in(request)
        if who is None:
            return Response("sign in first", status_code=401, headers=HEADERS)
        source, credential = who
        try:
            slot = self.auth.stream(source)
        except exc.RateLimited as error:
            retry = str(max(1, round(error.retry_after or 1)))
            return Response(str(error), status_code=429, headers={**HEADERS, "Retry-After": retry})
        return HeldStream(
            _changes(
                request,
                source,
                functools.partial(self.auth.check, credential, source),
                run_id,
                after,
                status or None,
            ),
            slot=slot,
            headers={**HEADERS, "X-Accel-Buffering": "no"},
        )

    async def decide(
        self,
        request: Request,
        run_id: str,
        request_id: str,
        decision: Annotated[str, Form()] = "",
        csrf: Annotated[str, Form()] = "",
    ) -> Response:
        who = await self.signed_in(request)
        if who is None:
            return self.to_login(request)
        source, credential = who
        if not hmac.compare_digest(csrf, _csrf(credential)):
            return self.failed(403, "the form is stale or forged: reload the page", source, credential)
        if decision not in ("approve", "deny"):
            return self.failed(400, "decide approve or deny", source, credential)
        choice = Choice.APPROVED if decision == "approve" else Choice.DENIED
        try:
            await _blocking(lambda: source.decide(run_id, request_id, choice))
        except exc.PolicyDenied as error:
            return self.failed(403, str(error), source, credential)
        except exc.ResourceNotFound as error:
            return self.failed(404, str(error), source, credential)
        except exc.ApprovalDecided as error:  # a second click, another tab: the first decision stands
            return self.failed(409, str(error), source, credential)
        except exc.StockadeError as error:
            return self.failed(400, str(error), source, credential)
        return self.redirect(f"{self.prefix}/runs/{quote(run_id)}")


async def _blocking(function: Callable[[], Any]) -> Any:
    return await anyio.to_thread.run_sync(function)


def _look(still: Callable[[], None], source: RunSource, run_id: str, seq: int) -> tuple[int, str] | None:
    still()
    return source.changes(run_id, seq)


async def _changes(
    request: Request, source: RunSource, still: Callable[[], None], run_id: str, after: int,
    status: str | None,
) -> AsyncIterator[bytes]:  # fmt: skip
    """``changed`` each time the run's trail grows or its status moves; ``end`` once it settled
    or waits (a paused run may wait for days: the page comes back for it, not this loop), or
    once ``still`` (asked at each poll) finds the session no longer valid: signed out,
    expired, its token taken out (``signed_out``; the page reloads, to the sign-in)."""
    seq = after
    while True:
        try:
            changed = await _blocking(functools.partial(_look, still, source, run_id, seq))
        except exc.AuthenticationError as error:
            yield f"event: end\ndata: {json.dumps({'signed_out': True, 'reason': str(error)})}\n\n".encode()
            return
        if changed is None:
            yield b"event: end\ndata: {}\n\n"
            return
        last, now = changed
        if last != seq or now != status:
            seq, status = last, now
            yield f"event: changed\ndata: {json.dumps({'seq': seq, 'status': status})}\n\n".encode()
        elif now in SETTLED or now in WAITING:
            waits = now in WAITING  # the page comes back later: a decision sends the run on
            ended = {"seq": seq, "status": status, "waits": waits}
            yield f"event: end\ndata: {json.dumps(ended)}\n\n".encode()
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(POLL_S)


def viewer_router(auth: ViewerAuth, *, prefix: str = "/ui") -> APIRouter:
    """The viewer's routes; ``auth`` says whose runs a cookie shows."""
    viewer = _Viewer(auth, prefix)
    router = APIRouter(prefix=prefix, include_in_schema=False)
    get, post = ["GET"], ["POST"]
    router.add_api_route("/login", viewer.login_form, methods=get)
    router.add_api_route("/login", viewer.login, methods=post)
    router.add_api_route("/logout", viewer.logout, methods=post)
    router.add_api_route("/static/{name}", viewer.static, methods=get)
    router.add_api_route("/", viewer.runs, methods=get)
    router.add_api_route("/runs/{run_id}", viewer.run_page, methods=get)
    router.add_api_route("/runs/{run_id}/body", viewer.run_body, methods=get)
    router.add_api_route("/runs/{run_id}/events", viewer.run_events, methods=get)
    router.add_api_route("/runs/{run_id}/approvals/{request_id}", viewer.decide, methods=post)
    return router


def local_app(source: RunSource, key: str) -> Any:
    """``stockade ui``: the viewer alone, over one machine's stores, behind ``key``."""
    from fastapi import FastAPI

    app = FastAPI(title="stockade runs", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(viewer_router(KeyAuth(source, key)))
    app.add_middleware(ViewerHeaders)

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return Response(status_code=303, headers={**HEADERS, "Location": "/ui/"})

    return app
