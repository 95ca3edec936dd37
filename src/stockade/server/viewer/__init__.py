"""The run viewer: the runs, each as a timeline, its approvals, its diff and its audit chain.

Served by ``stockade serve`` (``/ui``, a tenant signs in with an API token) and by
``stockade ui`` on a laptop (127.0.0.1, the local SQLite stores). ``values`` are what the
pages show, ``timeline`` makes a run's audit events their entries, ``data`` reads the stores;
``web`` routes and renders the pages, ``auth`` says who holds a cookie. Needs the ``server``
extra (FastAPI, Jinja2).
"""

from __future__ import annotations

from stockade.server.viewer.auth import KeyAuth, ServiceAuth, ViewerAuth
from stockade.server.viewer.headers import ViewerHeaders
from stockade.server.viewer.web import viewer_router

__all__ = ["KeyAuth", "ServiceAuth", "ViewerAuth", "ViewerHeaders", "viewer_router"]
