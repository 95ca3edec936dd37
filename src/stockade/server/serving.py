"""Run the API with uvicorn, its access log without the values of a request's query: a
client that puts its token there (``GET /ui/login?key=stk_...``) is answered as any other,
and uvicorn's access line wrote the token whole into the operator's logs."""

from __future__ import annotations

import copy
import logging
import re
import signal
from typing import TYPE_CHECKING, Any

from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service
from stockade.server.tenants import TenantsFile

if TYPE_CHECKING:
    from stockade.server.connections import ConnectionLimits

__all__ = ["RedactedQueries", "advertised", "log_config", "redacted", "serve"]

_TOKEN = re.compile(r"stk_[A-Za-z0-9_-]+")  # one of ours, wherever in the target it is


def redacted(target: str) -> str:
    """A request's target as its access line shows it: the path, and of its query the names
    alone (``/ui/login?key=...``). Any value may be a token a client put there, so none is shown."""
    path, mark, query = target.partition("?")
    path = _TOKEN.sub("stk_...", path)
    if not mark:
        return path
    return path + "?" + "&".join(_redacted_part(part) for part in query.split("&"))


def _redacted_part(part: str) -> str:
    name, equals, _ = part.partition("=")
    if equals:
        return f"{_TOKEN.sub('stk_...', name)}=..."
    return "..." if part else ""  # a bare word may be the token itself


class RedactedQueries(logging.Filter):
    """uvicorn's access line (``'%s - "%s %s HTTP/%s" %d'``: client, method, target, version,
    status) with its target ``redacted``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (*args[:2], redacted(args[2]), *args[3:])
        return True


def log_config() -> dict[str, Any]:
    """uvicorn's own logging configuration, its access logger filtered by ``RedactedQueries``
    (on the logger: whatever handler an operator adds gets the line redacted too)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redacted_queries"] = {"()": RedactedQueries}
    config["loggers"]["uvicorn.access"]["filters"] = ["redacted_queries"]
    return config


def advertised(host: str, port: int) -> str:
    """The URL peers reach this process at: its host, or the machine's name when it listens on
    every address (``--advertise-url`` says otherwise, behind NAT or a container's network)."""
    import socket

    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    config: ServiceConfig, *, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
    connections: ConnectionLimits | None = None,
) -> None:  # fmt: skip
    """Serve until SIGINT or SIGTERM (uvicorn's handlers; SIGHUP loads a ``TenantsFile`` again,
    with the policy files it names, at the next request); then the service closes: sandboxes
    are removed, and runs of the embedded executor end "interrupted" (the next start resumes them).
    ``connections``: how many at once, how long a request's head and an idle one may take."""
    import dataclasses

    import uvicorn

    from stockade.server.connections import ConnectionLimits, guarded_protocol

    if config.advertise_url is None:
        config = dataclasses.replace(config, advertise_url=advertised(host, port))
    limits = (connections or ConnectionLimits()).fitted()
    app = create_app(Service(config))
    if isinstance(config.tenants, TenantsFile):  # SIGHUP: load it again (and its policy files) now
        follow = config.tenants
        signal.signal(signal.SIGHUP, lambda *_: follow.reload_soon())
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, log_config=log_config(), timeout_graceful_shutdown=10,
        # h11, whatever else is installed: the head timeout and the cap are added to its protocol
        http=guarded_protocol(limits), timeout_keep_alive=limits.keep_alive_s,
    )  # fmt: skip
