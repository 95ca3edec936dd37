"""``stockade serve``: the SDK behind HTTP (FastAPI), sandboxes and runs per tenant.

    from stockade.server import ServiceConfig, TenantsFile, serve
    serve(ServiceConfig(tenants=TenantsFile("tenants.toml")), host="127.0.0.1", port=8080)

Routes are thin shells over the SDK (``sandboxes``: ``stockade.Sandbox``; ``runs``:
``build_agent`` over the run store); ``problems`` maps the error tree to RFC 9457 responses
in one place; ``tenants`` binds API tokens to tenants and roles; ``runner`` runs a submitted
run in this process or on a Celery worker (``stockade.distributed``). Needs the ``server``
extra: ``pip install "stockade[server]"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stockade.server.app import create_app
    from stockade.server.connections import ConnectionLimits
    from stockade.server.context import ServiceConfig
    from stockade.server.service import Service
    from stockade.server.serving import serve
    from stockade.server.tenants import Quotas, Tenant, Tenants, TenantsFile, new_token

_LAZY = {
    "create_app": "stockade.server.app",
    "ConnectionLimits": "stockade.server.connections",
    "ServiceConfig": "stockade.server.context",
    "serve": "stockade.server.serving",
    "Service": "stockade.server.service",
    "Quotas": "stockade.server.tenants",
    "Tenant": "stockade.server.tenants",
    "Tenants": "stockade.server.tenants",
    "TenantsFile": "stockade.server.tenants",
    "new_token": "stockade.server.tenants",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stockade.server' has no attribute {name!r}")
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] in ("fastapi", "starlette", "uvicorn", "anyio"):
            from stockade.exceptions import ConfigurationError

            raise ConfigurationError('the service needs its extra: pip install "stockade[server]"') from None
        raise


__all__ = [
    "ConnectionLimits",
    "Quotas",
    "Service",
    "ServiceConfig",
    "Tenant",
    "Tenants",
    "TenantsFile",
    "create_app",
    "new_token",
    "serve",
]
