"""``AsyncClient``: ``Client`` on asyncio: its sandboxes (``AsyncRemoteSandbox``) and its runs.

async with AsyncClient("http://127.0.0.1:8080", token) as client:  # or STOCKADE_URL, _TOKEN
    sandboxes = await asyncio.gather(*(client.sandbox("process") for _ in range(50)))
    run = await client.runs.submit("make the tests pass", workspace="project/", model="openai:gpt-4.1")
    async for event in run.events():
        print(event.kind)
    print((await run.wait()).status, await run.diff())
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade._checks import check_timeout
from stockade._threads import off_loop
from stockade.client._http import DIFF_MAX_BYTES, LIST_MAX_BYTES, AsyncHttp, malformed_archive
from stockade.client._inputs import folder as folder_path
from stockade.client._inputs import host_path, segment
from stockade.client._requests import snapshot_id
from stockade.client.async_sandbox import AsyncRemoteSandbox
from stockade.client.client import (
    TAR_HEADERS,
    EventLines,
    RunEvent,
    answer_field,
    answer_list,
    kill_all_body,
    list_params,
    run_info,
    settled,
    submit_body,
)
from stockade.sandbox._archive import Extraction
from stockade.sandbox._archive_gzip import Inflated
from stockade.sandbox.facade import tar_directory
from stockade.sandbox.ops import DOWNLOAD_MAX_BYTES, DOWNLOAD_MAX_ENTRIES
from stockade.types import Limits, Snapshot

__all__ = ["AsyncClient", "AsyncRemoteRun", "AsyncRuns"]


class AsyncRemoteRun:
    """``RemoteRun`` on asyncio: a run of the service, by id; ``info`` is its last known state."""

    def __init__(self, client: AsyncClient, info: object) -> None:
        self.client = client
        self.info = run_info(client.http.url, info)

    @property
    def id(self) -> str:
        return str(self.info["run_id"])

    @property
    def _at(self) -> str:
        """Its path in the API: the id the service gave, one segment of it (a ``/`` or ``..``
        in it names no other resource)."""
        return f"/v1/runs/{segment(self.id, 'run_id')}"

    @property
    def status(self) -> str:
        return str(self.info["status"])

    async def refresh(self) -> AsyncRemoteRun:
        return self._is((await self.client.http.request("GET", self._at)).json())

    async def wait(
        self, *, timeout_s: float = 600.0, poll_s: float = 0.25, until_paused: bool = True
    ) -> AsyncRemoteRun:
        """See ``RemoteRun.wait``."""
        timeout_s = check_timeout(timeout_s) or 0.0
        poll_s = check_timeout(poll_s, argument="poll_s") or 0.0
        deadline = time.monotonic() + timeout_s
        while True:
            await self.refresh()
            if settled(self.status, until_paused=until_paused):
                return self
            if time.monotonic() > deadline:
                raise exc.RunWaitTimeout(f"run {self.id} is still {self.status} after {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)

    async def events(self, *, after: int = 0) -> AsyncIterator[RunEvent]:
        """The run's events as they happen, until it ends or pauses (Server-Sent Events)."""
        async with self.client.http.stream(
            "GET", f"{self._at}/events", params={"after": after}, timeout=None
        ) as response:
            lines = EventLines(self.client.http.url)
            async for line in self.client.http.lines(response):
                event = lines.feed(line)
                if event is not None:
                    yield event
                    if lines.done:
                        return

    async def approvals(self) -> list[dict[str, str]]:
        found: list[dict[str, str]] = (await self.client.http.request("GET", f"{self._at}/approvals")).json()
        return found

    async def approve(self, request_id: str) -> AsyncRemoteRun:
        return await self._decide(request_id, "approve")

    async def deny(self, request_id: str) -> AsyncRemoteRun:
        return await self._decide(request_id, "deny")

    async def _decide(self, request_id: str, decision: str) -> AsyncRemoteRun:
        path = f"{self._at}/approvals/{segment(request_id, 'request_id')}"
        return self._is((await self.client.http.request("POST", path, json={"decision": decision})).json())

    async def kill(self, reason: str = "killed through the API") -> AsyncRemoteRun:
        path = f"{self._at}/kill"
        return self._is((await self.client.http.request("POST", path, json={"reason": reason})).json())

    async def resume(self) -> AsyncRemoteRun:
        """See ``RemoteRun.resume``."""
        return self._is((await self.client.http.request("POST", f"{self._at}/resume")).json())

    def _is(self, info: object) -> AsyncRemoteRun:
        self.info = run_info(self.client.http.url, info)
        return self

    async def diff(self) -> str:
        return (await self.client.http.request("GET", f"{self._at}/diff", limit=DIFF_MAX_BYTES)).text

    async def artifacts(
        self,
        dest: str | Path,
        *,
        max_bytes: int = DOWNLOAD_MAX_BYTES,
        max_entries: int = DOWNLOAD_MAX_ENTRIES,
    ) -> Path:
        """See ``RemoteRun.artifacts``; the disk work in a worker thread."""
        host_path(dest, "dest")
        unpack = await off_loop(Extraction, dest, max_bytes=max_bytes, max_entries=max_entries)
        inflated = Inflated(unpack.feed)
        try:
            async with self.client.http.stream("GET", f"{self._at}/artifacts") as response:
                async for chunk in self.client.http.bulk(response):
                    await off_loop(inflated.feed, chunk)
            await off_loop(inflated.finish)
            await off_loop(unpack.finish)
        except BaseException as error:
            # Shielded: a second cancellation must not leave half a download behind.
            await asyncio.shield(off_loop(unpack.abort))
            if isinstance(error, exc.ProtocolError):
                raise malformed_archive(self.client.http.url, error) from None
            raise
        return Path(dest)

    async def delete_artifacts(self) -> None:
        """See ``RemoteRun.delete_artifacts``."""
        await self.client.http.request("DELETE", f"{self._at}/artifacts")

    async def delete(self) -> None:
        """See ``RemoteRun.delete``."""
        await self.client.runs.delete(self.id)

    def __repr__(self) -> str:
        return f"<AsyncRemoteRun {self.id} {self.status}>"


class AsyncRuns:
    """``Runs`` on asyncio."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def upload_workspace(self, folder: str | Path) -> str:
        """Send a folder (as a tar, made in a thread); returns the id a run's ``workspace`` takes."""
        data = await off_loop(tar_directory, folder_path(folder, "folder"))
        response = await self.client.http.request("POST", "/v1/workspaces", content=data, headers=TAR_HEADERS)
        return str(answer_field(self.client.http.url, response.json(), "id"))

    async def submit(
        self,
        task: str,
        *,
        model: str | None = None,
        scripted: Sequence[object] | None = None,
        workspace: str | Path | None = None,
        tier: str | None = None,
        trust: str | None = None,
        sandbox_limits: Limits | None = None,
        max_steps: int | None = None,
        max_cost_usd: float | None = None,
        check: str | None = None,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncRemoteRun:
        """See ``Runs.submit``."""
        workspace_id: str | None = None
        if workspace is not None:
            path = folder_path(workspace, "workspace")
            workspace_id = await self.upload_workspace(path) if path.is_dir() else str(workspace)
        body = submit_body(
            task, model=model, scripted=scripted, workspace_id=workspace_id, tier=tier, trust=trust,
            max_steps=max_steps, max_cost_usd=max_cost_usd, check=check, labels=labels,
            idempotency_key=idempotency_key, sandbox_limits=sandbox_limits,
        )  # fmt: skip
        return AsyncRemoteRun(
            self.client, (await self.client.http.request("POST", "/v1/runs", json=body)).json()
        )

    async def kill_all(
        self, reason: str = "killed through the API (kill-all)", *, tenant: str | None = None,
        all_tenants: bool = False,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """See ``Runs.kill_all``."""
        body = kill_all_body(reason, tenant, all_tenants)
        found = (await self.client.http.request("POST", "/v1/runs/kill", json=body)).json()
        return answer_list(
            self.client.http.url, answer_field(self.client.http.url, found, "killed"), "killed"
        )

    async def get(self, run_id: str) -> AsyncRemoteRun:
        path = f"/v1/runs/{segment(run_id, 'run_id')}"
        return AsyncRemoteRun(self.client, (await self.client.http.request("GET", path)).json())

    async def list(
        self, *, status: str | None = None, label: str | None = None, limit: int = 50
    ) -> list[AsyncRemoteRun]:
        found = await self.client.http.request(
            "GET", "/v1/runs", params=list_params(status, label, limit), limit=LIST_MAX_BYTES
        )
        return [
            AsyncRemoteRun(self.client, r) for r in answer_list(self.client.http.url, found.json(), "runs")
        ]

    async def delete(self, run_id: str) -> None:
        """See ``Runs.delete``."""
        await self.client.http.request("DELETE", f"/v1/runs/{segment(run_id, 'run_id')}")


class AsyncClient:
    """The service at ``url`` (``STOCKADE_URL``), with ``token`` (``STOCKADE_TOKEN``)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float | None = 120.0,
        transport: Any = None,
    ) -> None:
        self.http = AsyncHttp(url, token, timeout_s=timeout_s, transport=transport)
        self.runs = AsyncRuns(self)

    async def sandbox(self, tier: str | None = None, **options: Any) -> AsyncRemoteSandbox:
        """``await AsyncRemoteSandbox.create(tier, ..., client=self)``."""
        return await AsyncRemoteSandbox.create(tier, client=self, **options)

    async def sandboxes(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = (
            await self.http.request("GET", "/v1/sandboxes", limit=LIST_MAX_BYTES)
        ).json()
        return found

    async def snapshots(self) -> list[dict[str, Any]]:
        """See ``Client.snapshots``."""
        found: list[dict[str, Any]] = (
            await self.http.request("GET", "/v1/snapshots", limit=LIST_MAX_BYTES)
        ).json()
        return found

    async def delete_snapshot(self, snapshot: Snapshot | str) -> None:
        """See ``Client.delete_snapshot``."""
        await self.http.request("DELETE", f"/v1/snapshots/{segment(snapshot_id(snapshot), 'snapshot')}")

    async def workspaces(self) -> list[dict[str, Any]]:
        """See ``Client.workspaces``."""
        found: list[dict[str, Any]] = (
            await self.http.request("GET", "/v1/workspaces", limit=LIST_MAX_BYTES)
        ).json()
        return found

    async def delete_workspace(self, workspace_id: str) -> None:
        """See ``Client.delete_workspace``."""
        await self.http.request("DELETE", f"/v1/workspaces/{segment(workspace_id, 'workspace_id')}")

    async def verify_audit(self) -> dict[str, Any]:
        found: dict[str, Any] = (await self.http.request("GET", "/v1/audit/verify")).json()
        return found

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
