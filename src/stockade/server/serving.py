"""Run the API with uvicorn."""

from __future__ import annotations

from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service

__all__ = ["serve"]


def serve(
    config: ServiceConfig, *, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info"
) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers); then the service closes: sandboxes
    are removed, and runs of the embedded executor end "interrupted" (the next start resumes them)."""
    import uvicorn

    app = create_app(Service(config))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
