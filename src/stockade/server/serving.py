"""Run the API with uvicorn."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service
from stockade.server.tenants import TenantsFile

if TYPE_CHECKING:
    from stockade.server.connections import ConnectionLimits

__all__ = ["advertised", "serve"]


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
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10,
        # h11, whatever else is installed: the head timeout and the cap are added to its protocol
        http=guarded_protocol(limits), timeout_keep_alive=limits.keep_alive_s,
    )  # fmt: skip
