"""The real application (``create_app``) called in this process through httpx2's ASGI
transport, as the server's unit tests call it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx2

from stockade.server.app import create_app
from stockade.server.service import Service


@contextlib.asynccontextmanager
async def asgi_client(service: Service) -> AsyncIterator[httpx2.AsyncClient]:
    transport = httpx2.ASGITransport(app=create_app(service))
    async with httpx2.AsyncClient(transport=transport, base_url="http://service") as client:
        yield client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
