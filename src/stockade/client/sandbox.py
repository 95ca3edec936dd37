"""``RemoteSandbox``: ``stockade.Sandbox``'s surface, over the service's API.

    from stockade.client import RemoteSandbox as Sandbox     # the one line that changes

    with Sandbox.create(tier="process", limits=Limits(memory_mb=512)) as sbx:
        sbx.commands.run("echo hi", on_stdout=print)
        sbx.run_code("x = 41\\nx + 1").text
        sbx.files.write("a.txt", "hello"); sbx.files.download_dir("out/")

The service's URL and token come from ``STOCKADE_URL`` and ``STOCKADE_TOKEN`` unless a
``Client`` is given. Results are the SDK's values (``CommandResult``, ``Execution``,
``EntryInfo``, ``DownloadResult``) and errors its classes; ``files.download_dir`` unpacks
with the same checks as the local one (nothing outside ``dest``, all or nothing). The bodies
it sends (``_requests``) and its reading of the answers (``_answers``) are ``AsyncRemoteSandbox``'s
too: this module holds the sandbox and its ``commands`` and ``files``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

from stockade import exceptions as exc
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
    from stockade.client.client import Client

__all__ = ["RemoteSandbox"]


class RemoteCommands:
    def __init__(self, sandbox: RemoteSandbox) -> None:
        self._sbx = sandbox

    def run(
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
        """As ``Sandbox.commands.run``: a non-zero exit is a result; output streams to the
        callbacks while the command runs."""
        body = command_body(cmd, cwd=cwd, envs=envs, timeout_s=timeout_s, stdin=stdin)
        data = self._sbx._call("commands", body, on_stdout, on_stderr)
        return command_result(data)


class RemoteFiles:
    def __init__(self, sandbox: RemoteSandbox) -> None:
        self._sbx = sandbox

    @property
    def _base(self) -> str:
        return self._sbx._at

    @overload
    def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        data = self._sbx.client.http.content(f"{self._base}/files/content", path_params(path))
        return data if format == "bytes" else data.decode("utf-8", "replace")

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        params = range_params(path, offset, length)
        return self._sbx.client.http.content(f"{self._base}/files/content", params)

    def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> EntryInfo:
        params, raw = path_params(path, mode=mode), _inputs.byte_data(data)
        response = self._sbx.client.http.request(
            "PUT", f"{self._base}/files/content", params=params, content=raw,
            headers={"Content-Type": "application/octet-stream"},
        )  # fmt: skip
        return entry(response.json())

    def list(self, path: str = "", *, depth: int = 1) -> Listing:
        response = self._sbx.client.http.request(
            "GET", f"{self._base}/files", params=path_params(path, depth=depth), limit=LIST_MAX_BYTES
        )
        return listing(response.json(), response.headers)

    def stat(self, path: str) -> EntryInfo | None:
        try:
            params = path_params(path)
            response = self._sbx.client.http.request("GET", f"{self._base}/files/stat", params=params)
        except exc.SandboxFileNotFound:
            return None
        return entry(response.json())

    def exists(self, path: str) -> bool:
        return self.stat(path) is not None

    def remove(self, path: str) -> None:
        self._sbx.client.http.request("DELETE", f"{self._base}/files", params=path_params(path))

    def make_dir(self, path: str) -> EntryInfo:
        return entry(
            self._sbx.client.http.request("POST", f"{self._base}/files/dir", params=path_params(path)).json()
        )

    def upload_dir(
        self, source: str | Path, dest: str = "", *, hide: Sequence[str] = (), read: Sequence[str] = ("**",)
    ) -> None:
        """Copy a local directory into the workspace (sent as a tar, checked by the server): what
        ``read`` names, but what ``hide`` names (globs, as ``Sandbox.files.upload_dir``)."""
        params, data = upload_body(source, dest, hide, read)
        self._sbx.client.http.request(
            "PUT", f"{self._base}/archive", params=params, content=data,
            headers={"Content-Type": "application/x-tar"},
        )  # fmt: skip

    def download_dir(
        self, dest: str | Path, source: str = "", *, max_bytes: int = DOWNLOAD_MAX_BYTES,
        max_entries: int = DOWNLOAD_MAX_ENTRIES,
    ) -> DownloadResult:  # fmt: skip
        """As ``Sandbox.files.download_dir``: all or nothing, nothing outside ``dest``; the
        archive is unpacked as it arrives, never held whole."""
        from stockade.sandbox._archive import Extraction

        params = archive_params(dest, source=source, max_bytes=max_bytes, max_entries=max_entries)
        with (
            Extraction(dest, max_bytes=max_bytes, max_entries=max_entries) as unpack,
            self._sbx.client.http.stream("GET", f"{self._base}/archive", params=params) as response,
        ):
            for chunk in self._sbx.client.http.bulk(response):
                unpack.feed(chunk)
            return unpack.finish()


class RemoteSandbox:
    """One sandbox of the service. Use ``RemoteSandbox.create(...)`` as a context manager."""

    def __init__(self, client: Client, info: Mapping[str, Any]) -> None:
        self.client = client
        self.info = dict(info)
        self.commands = RemoteCommands(self)
        self.files = RemoteFiles(self)
        self._closed = False
        self._owns_client = False  # made by ``create`` for this sandbox alone: closed with it

    @classmethod
    def create(
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
        client: Client | None = None,
        snapshot: Snapshot | str | None = None,
    ) -> RemoteSandbox:
        """As ``Sandbox.create``; the tier is chosen (and checked against your role) by the service.
        ``snapshot`` (one of your tenant's, or its id) starts it from a snapshot, as many times
        as wanted: on its tier and with its settings unless others are given."""
        from stockade.client.client import Client

        body = create_body(
            tier, trust=trust, limits=limits, network=network, envs=envs, allow_weaker=allow_weaker,
            labels=labels, prefer=prefer, idle_timeout_s=idle_timeout_s, snapshot=snapshot,
        )  # fmt: skip
        if workspace is not None:
            _inputs.host_path(workspace, "workspace")
        own = client is None
        client = client or Client()
        try:
            info = client.http.request("POST", "/v1/sandboxes", json=body)
        except BaseException:
            if own:
                client.close()
            raise
        sbx = cls(client, info.json())
        sbx._owns_client = own
        if workspace is not None:
            try:
                sbx.files.upload_dir(workspace)
            except BaseException:
                sbx.close()
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
        if self._closed:
            return False
        try:
            info = self.client.http.request("GET", self._at).json()
        except exc.ResourceNotFound:
            return False
        return bool(info.get("state") == "running")

    def _call(
        self, what: str, body: dict[str, Any], on_stdout: TextCallback | None, on_stderr: TextCallback | None
    ) -> dict[str, Any]:
        path, limit = f"{self._at}/{what}", result_max_bytes(self.info)
        if on_stdout is None and on_stderr is None:
            data: dict[str, Any] = self.client.http.request("POST", path, json=body, limit=limit).json()
            return data
        with self.client.http.stream("POST", path, json={**body, "stream": True}) as response:
            for line in self.client.http.lines(response, limit):
                result = streamed_line(line, on_stdout, on_stderr)
                if result is not None:
                    return result
        raise ended_without_result()

    def run_code(
        self, code: str, language: str = "python", *, timeout_s: float | None = None,
        on_stdout: TextCallback | None = None, on_stderr: TextCallback | None = None,
    ) -> Execution:  # fmt: skip
        """As ``Sandbox.run_code``: Python state persists between calls; other languages run fresh."""
        return execution(self._call("code", code_body(code, language, timeout_s), on_stdout, on_stderr))

    def reset(self) -> None:
        self.client.http.request("POST", f"{self._at}/reset")

    def snapshot(self, *, memory: bool | None = None) -> Snapshot:
        """As ``Sandbox.snapshot``: save the sandbox and go on. Kept by the service, in your
        tenant's store, until deleted (``client.delete_snapshot``)."""
        path = f"{self._at}/snapshot"
        response = self.client.http.request("POST", path, json={"memory": memory})
        return snapshot_value(response.json(), self.client.http.url)

    def pause(self, *, memory: bool | None = None) -> Snapshot:
        """As ``Sandbox.pause``: save and stop it; ``RemoteSandbox.resume(sbx.id)``, from any
        client of your tenant, brings it back. Paused, it holds none of your live quota."""
        path = f"{self._at}/pause"
        response = self.client.http.request("POST", path, json={"memory": memory})
        self._closed = True  # nothing to delete any more; a client made for it is closed
        if self._owns_client:
            self.client.close()
        return snapshot_value(response.json(), self.client.http.url)

    @classmethod
    def resume(cls, sandbox_id: str, *, client: Client | None = None) -> RemoteSandbox:
        """As ``Sandbox.resume``: the paused sandbox ``sandbox_id``, running again under its id.
        One resume wins: the others get ``SnapshotNotFound``."""
        from stockade.client.client import Client

        path = f"/v1/sandboxes/{_inputs.segment(sandbox_id, 'sandbox_id')}/resume"
        own = client is None
        client = client or Client()
        try:
            info = client.http.request("POST", path)
        except BaseException:
            if own:
                client.close()
            raise
        sbx = cls(client, info.json())
        sbx._owns_client = own
        return sbx

    def kill(self) -> None:
        """Stop it now, even mid-command (a command in flight ends with ``SandboxClosed``)."""
        self.client.http.request("POST", f"{self._at}/kill")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(exc.ResourceNotFound, exc.SandboxClosed):  # closed already (idle, gone)
                self.client.http.request("DELETE", self._at)
        finally:
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RemoteSandbox {self.id} tier={self.tier}>"
