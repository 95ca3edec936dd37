"""The headers every page of the viewer carries (``HEADERS``: its Content-Security-Policy, no
sniffing, no framing, no caching), and the middleware that adds them to the responses FastAPI
makes itself (``ViewerHeaders``). Apart from the routes: the service's app adds the middleware.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CSP", "HEADERS", "ViewerHeaders"]

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
