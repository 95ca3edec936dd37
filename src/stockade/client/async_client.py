"""``AsyncClient``: ``Client`` on asyncio, for its sandboxes (``AsyncRemoteSandbox``).

async with AsyncClient("http://127.0.0.1:8080", token) as client:  # or STOCKADE_URL, _TOKEN
    sandboxes = await asyncio.gather(*(client.sandbox("process") for _ in range(50)))
"""

from __future__ import annotations

from typing import Any

from stockade.client._http import AsyncHttp
from stockade.client.async_sandbox import AsyncRemoteSandbox
from stockade.client.sandbox import snapshot_id
from stockade.types import Snapshot

__all__ = ["AsyncClient"]


class AsyncClient:
    """The service at ``url`` (``STOCKADE_URL``), with ``token`` (``STOCKADE_TOKEN``)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 120.0,
        transport: Any = None,
    ) -> None:
        self.http = AsyncHttp(url, token, timeout_s=timeout_s, transport=transport)

    async def sandbox(self, tier: str | None = None, **options: Any) -> AsyncRemoteSandbox:
        """``await AsyncRemoteSandbox.create(tier, ..., client=self)``."""
        return await AsyncRemoteSandbox.create(tier, client=self, **options)

    async def sandboxes(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = (await self.http.request("GET", "/v1/sandboxes")).json()
        return found

    async def snapshots(self) -> list[dict[str, Any]]:
        """See ``Client.snapshots``."""
        found: list[dict[str, Any]] = (await self.http.request("GET", "/v1/snapshots")).json()
        return found

    async def delete_snapshot(self, snapshot: Snapshot | str) -> None:
        """See ``Client.delete_snapshot``."""
        await self.http.request("DELETE", f"/v1/snapshots/{snapshot_id(snapshot)}")

    async def verify_audit(self) -> dict[str, Any]:
        found: dict[str, Any] = (await self.http.request("GET", "/v1/audit/verify")).json()
        return found

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
