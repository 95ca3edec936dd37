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

Apart from the routes: who a cookie is (``auth.py``), the headers every page carries
(``headers.py``), the templates and their filters (``rendering.py``), what a posted form is
checked for (``forms.py``) and a live page's event stream (``live.py``).
"""

from __future__ import annotations

import functools
import hmac
import importlib.resources
import re
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import Response

from stockade import __version__
from stockade import exceptions as exc
from stockade.policy.approval_book import Choice
from stockade.server.streams import HeldStream
from stockade.server.viewer.auth import KeyAuth, ServiceAuth, ViewerAuth
from stockade.server.viewer.forms import CROSS_SITE, csrf_token, parse_time, same_site
from stockade.server.viewer.headers import CSP, HEADERS, ViewerHeaders
from stockade.server.viewer.live import blocking, changes
from stockade.server.viewer.rendering import templates
from stockade.server.viewer.values import (
    LATEST,
    STATUSES,
    Filters,
    RunSource,
    RunView,
    Window,
)

__all__ = ["CSP", "KeyAuth", "ServiceAuth", "ViewerAuth", "ViewerHeaders", "local_app", "viewer_router"]

COOKIE = "stockade_viewer"
STATIC = {
    "viewer.css": "text/css; charset=utf-8",
    "viewer.js": "text/javascript; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
MAX_SEQ = 2**62  # as the API's `after`: a bigger number is no sequence number the database holds
# where a sign-in may go on to: a plain path (printable ASCII: it becomes a Location header)
_PLAIN_PATH = re.compile(r"[!-~]*")


class _Viewer:
    """The routes' bodies, over one ``auth``."""

    def __init__(self, auth: ViewerAuth, prefix: str) -> None:
        self.auth = auth
        self.prefix = prefix
        self.env = templates()

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
            return await blocking(lambda: self.auth.source(credential)), credential
        except exc.AuthenticationError:
            return None

    def to_login(self, request: Request) -> Response:
        return self.redirect(f"{self.prefix}/login?{urlencode({'next': request.url.path})}")

    def failed(self, status: int, message: str, source: RunSource, credential: str) -> Response:
        return self.page("error.html", status, message=message, source=source, csrf=csrf_token(credential))

    # -- sign-in -------------------------------------------------------------------------------

    async def login_form(self, request: Request, key: str | None = None, next: str = "") -> Response:
        target = self.target(next)
        if key and self.auth.link_sign_in:  # the link `stockade ui` prints
            try:
                cookie = await blocking(lambda: self.auth.sign_in(key))
            except exc.AuthenticationError as error:
                return self.page("login.html", 401, error=str(error), hint=self.auth.hint, next=target)
            return self.redirect(target, cookie=cookie, request=request)
        return self.page("login.html", error=None, hint=self.auth.hint, next=target)

    async def login(
        self, request: Request, token: Annotated[str, Form()] = "", next: Annotated[str, Form()] = ""
    ) -> Response:
        target = self.target(next)
        if not same_site(request):  # another site's form would sign this browser in to its tenant
            return self.page("login.html", 403, error=CROSS_SITE, hint=self.auth.hint, next=target)
        try:
            cookie = await blocking(lambda: self.auth.sign_in(token.strip()))
        except exc.StockadeError as error:
            return self.page("login.html", 401, error=str(error), hint=self.auth.hint, next=target)
        return self.redirect(target, cookie=cookie, request=request)

    async def logout(self, request: Request) -> Response:
        if not same_site(request):
            return self.page("login.html", 403, error=CROSS_SITE, hint=self.auth.hint, next=f"{self.prefix}/")
        cookie = request.cookies.get(COOKIE)
        if cookie:  # a copy of the cookie elsewhere signs in no more
            await blocking(lambda: self.auth.sign_out(cookie))
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
            "csrf": csrf_token(credential),
            "statuses": STATUSES,
            "form": form,
        }
        try:
            filters = Filters(
                status=status or None,
                model=model or None,
                since=parse_time(since, "since"),
                until=parse_time(until, "until"),
                limit=max(1, min(limit, 1000)),
            )
        except exc.InvalidArgument as error:
            return self.page("runs.html", 400, runs=[], error=str(error), **values)
        found = await blocking(lambda: source.runs(filters))
        return self.page("runs.html", runs=found, error=None, **values)

    async def view(
        self, request: Request, run_id: str, *, verified: bool, window: Window = LATEST
    ) -> tuple[RunView, RunSource, str] | Response:
        who = await self.signed_in(request)
        if who is None:
            return self.to_login(request)
        source, credential = who
        found: RunView | None = await blocking(lambda: source.run(run_id, verified=verified, window=window))
        if found is None:
            return self.page("missing.html", 404, run_id=run_id, source=source, csrf=csrf_token(credential))
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
            csrf=csrf_token(credential),
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
        return self.page(template, run=run, source=source, csrf=csrf_token(credential))

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
            changes(
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
        if not hmac.compare_digest(csrf, csrf_token(credential)):
            return self.failed(403, "the form is stale or forged: reload the page", source, credential)
        if decision not in ("approve", "deny"):
            return self.failed(400, "decide approve or deny", source, credential)
        choice = Choice.APPROVED if decision == "approve" else Choice.DENIED
        try:
            await blocking(lambda: source.decide(run_id, request_id, choice))
        except exc.PolicyDenied as error:
            return self.failed(403, str(error), source, credential)
        except exc.ResourceNotFound as error:
            return self.failed(404, str(error), source, credential)
        except exc.ApprovalDecided as error:  # a second click, another tab: the first decision stands
            return self.failed(409, str(error), source, credential)
        except exc.StockadeError as error:
            return self.failed(400, str(error), source, credential)
        return self.redirect(f"{self.prefix}/runs/{quote(run_id)}")


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
