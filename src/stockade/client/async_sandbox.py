"""``AsyncRemoteSandbox``: ``stockade.AsyncSandbox``'s surface, over the service's API.

    from stockade.client import AsyncRemoteSandbox as AsyncSandbox   # the one line that changes

    async with await AsyncSandbox.create(tier="process", limits=Limits(memory_mb=512)) as sbx:
        await sbx.commands.run("echo hi", on_stdout=print)
        (await sbx.run_code("x = 41\\nx + 1")).text
        await sbx.files.write("a.txt", "hello"); await sbx.files.download_dir("out/")

On ``httpx2.AsyncClient``, the sync client's library: no thread per call, so one event loop
holds as many sandboxes as the service gives it. Output callbacks run on the event loop, as
the line arrives. Results are the SDK's values and errors its classes, as ``RemoteSandbox``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

from stockade import exceptions as exc
from stockade._threads import off_loop
from stockade.client import _inputs
from stockade.client._answers import (
    TextCallback,
    command_result,
    ended_without_result,
    enforcement,
    entry,
    execution,
    listing,
    result_max_bytes,
    snapshot_value,
    streamed_line,
)
from stockade.client._http import LIST_MAX_BYTES
from stockade.client._requests import (
    archive_params,
    code_body,
    command_body,
    create_body,
    path_params,
    range_params,
    upload_body,
)
from stockade.sandbox.ops import DOWNLOAD_MAX_BYTES, DOWNLOAD_MAX_ENTRIES
from stockade.types import (
    CommandResult,
    DownloadResult,
    Enforcement,
    EntryInfo,
    Execution,
    Limits,
    Listing,
    NetworkPolicy,
    Snapshot,
    Trust,
)

if TYPE_CHECKING:
    from stockade.client.async_client import AsyncClient

__all__ = ["AsyncRemoteSandbox"]


class AsyncRemoteCommands:
    def __init__(self, sandbox: AsyncRemoteSandbox) -> None:
        self._sbx = sandbox

    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        stdin: str | bytes | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
    ) -> CommandResult:
        """As ``AsyncSandbox.commands.run``: a non-zero exit is a result; output streams to the
        callbacks while the command runs."""
        body = command_body(cmd, cwd=cwd, envs=envs, timeout_s=timeout_s, stdin=stdin)
        return command_result(await self._sbx._call("commands", body, on_stdout, on_stderr))


class AsyncRemoteFiles:
    def __init__(self, sandbox: AsyncRemoteSandbox) -> None:
        self._sbx = sandbox

    @property
    def _base(self) -> str:
        return self._sbx._at

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        return await self._sbx.client.http.request(method, f"{self._base}{path}", **kwargs)

    @overload
    async def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    async def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    async def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        data = await self._sbx.client.http.content(f"{self._base}/files/content", path_params(path))
        return data if format == "bytes" else data.decode("utf-8", "replace")

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        params = range_params(path, offset, length)
        return await self._sbx.client.http.content(f"{self._base}/files/content", params)

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> EntryInfo:
        params, raw = path_params(path, mode=mode), _inputs.byte_data(data)
        response = await self._request(
            "PUT", "/files/content", params=params, content=raw,
            headers={"Content-Type": "application/octet-stream"},
        )  # fmt: skip
        return entry(response.json())

    async def list(self, path: str = "", *, depth: int = 1) -> Listing:
        response = await self._request(
            "GET", "/files", params=path_params(path, depth=depth), limit=LIST_MAX_BYTES
        )
        return listing(response.json(), response.headers)

    async def stat(self, path: str) -> EntryInfo | None:
        try:
            response = await self._request("GET", "/files/stat", params=path_params(path))
        except exc.SandboxFileNotFound:
            return None
        return entry(response.json())

    async def exists(self, path: str) -> bool:
        return await self.stat(path) is not None

    async def remove(self, path: str) -> None:
        await self._request("DELETE", "/files", params=path_params(path))

    async def make_dir(self, path: str) -> EntryInfo:
        return entry((await self._request("POST", "/files/dir", params=path_params(path))).json())

    async def upload_dir(
        self, source: str | Path, dest: str = "", *, hide: Sequence[str] = (), read: Sequence[str] = ("**",)
    ) -> None:
        """Copy a local directory into the workspace (sent as a tar, checked by the server): what
        ``read`` names, but what ``hide`` names (globs, as ``AsyncSandbox.files.upload_dir``)."""
        params, data = await off_loop(upload_body, source, dest, hide, read)
        await self._request(
            "PUT", "/archive", params=params, content=data,
            headers={"Content-Type": "application/x-tar"},
        )  # fmt: skip

    async def download_dir(
        self, dest: str | Path, source: str = "", *, max_bytes: int = DOWNLOAD_MAX_BYTES,
        max_entries: int = DOWNLOAD_MAX_ENTRIES,
    ) -> DownloadResult:  # fmt: skip
        """As ``AsyncSandbox.files.download_dir``: all or nothing, nothing outside ``dest``; the
        archive is unpacked as it arrives, the disk work in a worker thread."""
        from stockade.sandbox._archive import Extraction

        params = archive_params(dest, source=source, max_bytes=max_bytes, max_entries=max_entries)
        unpack = await off_loop(Extraction, dest, max_bytes=max_bytes, max_entries=max_entries)
        try:
            async with self._sbx.client.http.stream(
                "GET", f"{self._base}/archive", params=params
            ) as response:
                async for chunk in self._sbx.client.http.bulk(response):
                    await off_loop(unpack.feed, chunk)
            return await off_loop(unpack.finish)
        except BaseException:
            # Shielded: a second cancellation must not leave half a download behind.
            await asyncio.shield(off_loop(unpack.abort))
            raise


class AsyncRemoteSandbox:
    """One sandbox of the service: ``sbx = await AsyncRemoteSandbox.create(...)``."""

    def __init__(self, client: AsyncClient, info: Mapping[str, Any]) -> None:
        self.client = client
        self.info = dict(info)
        self.commands = AsyncRemoteCommands(self)
        self.files = AsyncRemoteFiles(self)
        self._closed = False
        self._owns_client = False  # made by ``create`` for this sandbox alone: closed with it

    @classmethod
    async def create(
        cls,
        tier: str | None = None,
        *,
        trust: Trust | str | None = None,
        limits: Limits | None = None,
        network: NetworkPolicy | None = None,
        envs: Mapping[str, str] | None = None,
        workspace: str | Path | None = None,
        allow_weaker: bool = False,
        labels: Mapping[str, str] | None = None,
        prefer: Literal["cheapest", "strongest"] | None = None,
        idle_timeout_s: float | None = None,
        client: AsyncClient | None = None,
        snapshot: Snapshot | str | None = None,
    ) -> AsyncRemoteSandbox:
        """As ``AsyncSandbox.create``; the tier is chosen (and checked against your role) by the
        service. Without ``client``, one is made from ``STOCKADE_URL`` and ``STOCKADE_TOKEN``."""
        from stockade.client.async_client import AsyncClient

        body = create_body(
            tier, trust=trust, limits=limits, network=network, envs=envs, allow_weaker=allow_weaker,
            labels=labels, prefer=prefer, idle_timeout_s=idle_timeout_s, snapshot=snapshot,
        )  # fmt: skip
        if workspace is not None:
            _inputs.host_path(workspace, "workspace")
        own = client is None
        client = client or AsyncClient()
        try:
            info = await client.http.request("POST", "/v1/sandboxes", json=body)
        except BaseException:
            if own:
                await client.aclose()
            raise
        sbx = cls(client, info.json())
        sbx._owns_client = own
        if workspace is not None:
            try:
                await sbx.files.upload_dir(workspace)
            except BaseException:
                await asyncio.shield(sbx.close())
                raise
        return sbx

    @property
    def id(self) -> str:
        return str(self.info["id"])

    @property
    def _at(self) -> str:
        """Its path in the API: the id the service gave, one segment of it (a ``/`` or ``..``
        in it names no other resource)."""
        return f"/v1/sandboxes/{_inputs.segment(self.id, 'sandbox_id')}"

    @property
    def tier(self) -> str:
        return str(self.info["tier"])

    @property
    def enforcement(self) -> Enforcement:
        return enforcement(self.info["enforcement"])

    @property
    def started_from(self) -> str:
        """What the sandbox started from, as the service's tier says (``Sandbox.started_from``)."""
        return str(self.info.get("started_from", ""))

    @property
    def alive(self) -> bool:
        """As the service last said (a property cannot ask it without blocking the event loop,
        as ``RemoteSandbox.alive`` does); False once closed."""
        return not self._closed and self.info.get("state", "running") == "running"

    async def _call(
        self, what: str, body: dict[str, Any], on_stdout: TextCallback | None, on_stderr: TextCallback | None
    ) -> dict[str, Any]:
        path, limit = f"{self._at}/{what}", result_max_bytes(self.info)
        if on_stdout is None and on_stderr is None:
            data: dict[str, Any] = (
                await self.client.http.request("POST", path, json=body, limit=limit)
            ).json()
            return data
        async with self.client.http.stream("POST", path, json={**body, "stream": True}) as response:
            async for line in self.client.http.lines(response, limit):
                result = streamed_line(line, on_stdout, on_stderr)
                if result is not None:
                    return result
        raise ended_without_result()

    async def run_code(
        self, code: str, language: str = "python", *, timeout_s: float | None = None,
        on_stdout: TextCallback | None = None, on_stderr: TextCallback | None = None,
    ) -> Execution:  # fmt: skip
        """As ``AsyncSandbox.run_code``: Python state persists between calls; other languages run fresh."""
        return execution(await self._call("code", code_body(code, language, timeout_s), on_stdout, on_stderr))

    async def reset(self) -> None:
        await self.client.http.request("POST", f"{self._at}/reset")

    async def snapshot(self, *, memory: bool | None = None) -> Snapshot:
        """See ``RemoteSandbox.snapshot``."""
        path = f"{self._at}/snapshot"
        response = await self.client.http.request("POST", path, json={"memory": memory})
        return snapshot_value(response.json(), self.client.http.url)

    async def pause(self, *, memory: bool | None = None) -> Snapshot:
        """See ``RemoteSandbox.pause``."""
        path = f"{self._at}/pause"
        response = await self.client.http.request("POST", path, json={"memory": memory})
        self._closed = True
        if self._owns_client:
            await self.client.aclose()
        return snapshot_value(response.json(), self.client.http.url)

    @classmethod
    async def resume(cls, sandbox_id: str, *, client: AsyncClient | None = None) -> AsyncRemoteSandbox:
        """See ``RemoteSandbox.resume``."""
        from stockade.client.async_client import AsyncClient

        path = f"/v1/sandboxes/{_inputs.segment(sandbox_id, 'sandbox_id')}/resume"
        own = client is None
        client = client or AsyncClient()
        try:
            info = await client.http.request("POST", path)
        except BaseException:
            if own:
                await client.aclose()
            raise
        sbx = cls(client, info.json())
        sbx._owns_client = own
        return sbx

    async def kill(self) -> None:
        """Stop it now, even mid-command (a command in flight ends with ``SandboxClosed``)."""
        await self.client.http.request("POST", f"{self._at}/kill")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(exc.ResourceNotFound, exc.SandboxClosed):  # closed already (idle, gone)
                await self.client.http.request("DELETE", self._at)
        finally:
            if self._owns_client:
                await self.client.aclose()

    async def __aenter__(self) -> AsyncRemoteSandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncRemoteSandbox {self.id} tier={self.tier}>"
