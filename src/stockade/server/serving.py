"""Run the API with uvicorn."""

from __future__ import annotations

from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service

__all__ = ["advertised", "serve"]


def advertised(host: str, port: int) -> str:
    """The URL peers reach this process at: its host, or the machine's name when it listens on
    every address (``--advertise-url`` says otherwise, behind NAT or a container's network)."""
    import socket

    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    config: ServiceConfig, *, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info"
) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers); then the service closes: sandboxes
    are removed, and runs of the embedded executor end "interrupted" (the next start resumes them)."""
    import dataclasses

    import uvicorn

    if config.advertise_url is None:
        config = dataclasses.replace(config, advertise_url=advertised(host, port))
    app = create_app(Service(config))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
