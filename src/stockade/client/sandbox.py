"""``RemoteSandbox``: ``stockade.Sandbox``'s surface, over the service's API.

    from stockade.client import RemoteSandbox as Sandbox     # the one line that changes

    with Sandbox.create(tier="process", limits=Limits(memory_mb=512)) as sbx:
        sbx.commands.run("echo hi", on_stdout=print)
        sbx.run_code("x = 41\\nx + 1").text
        sbx.files.write("a.txt", "hello"); sbx.files.download_dir("out/")

The service's URL and token come from ``STOCKADE_URL`` and ``STOCKADE_TOKEN`` unless a
``Client`` is given. Results are the SDK's values (``CommandResult``, ``Execution``,
``EntryInfo``, ``DownloadResult``) and errors its classes; ``files.download_dir`` unpacks
with the same checks as the local one (nothing outside ``dest``, all or nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from stockade import exceptions as exc
from stockade._checks import check_envs, check_id, check_labels
from stockade.client import _inputs
from stockade.client._http import ANSWER_MAX_BYTES, LIST_MAX_BYTES, error_from
from stockade.sandbox._requests import code_op, command_op, range_op, upload_op
from stockade.sandbox.facade import tar_directory
from stockade.sandbox.ops import DOWNLOAD_MAX_BYTES, DOWNLOAD_MAX_ENTRIES, LISTING_TRUNCATED_HEADER, ReadFile
from stockade.types import (
    CommandResult,
    DownloadResult,
    Enforcement,
    EntryInfo,
    EntryType,
    ExecRecord,
    Execution,
    ExecutionError,
    HostShare,
    Limits,
    Listing,
    Logs,
    Mechanism,
    NetworkPolicy,
    Result,
    Snapshot,
    SnapshotKind,
    Trust,
)

if TYPE_CHECKING:
    from stockade.client.client import Client

__all__ = ["RemoteSandbox"]

TextCallback = Callable[[str], object]
_T = TypeVar("_T")


def _decoder(function: Callable[[Any], _T]) -> Callable[[Any], _T]:
    """``function`` turning a field the service left out or sent of another type (a hostile or
    broken service: KeyError, TypeError, ValueError) into ``ServiceError``: the same request
    gets the same answer, so retrying cannot help."""

    @functools.wraps(function)
    def decode(data: Any) -> _T:
        try:
            return function(data)
        except exc.StockadeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise exc.ServiceError(
                f"the service sent an answer the client cannot use ({function.__name__}): {error!r}"
            ) from None

    return decode


def _execs(data: Mapping[str, Any]) -> dict[str, Any]:
    """A result's ``execs`` as ``ExecRecord``s (JSON gives dicts and lists) and its count of
    those left out."""
    names = {f.name for f in dataclasses.fields(ExecRecord)}
    records: list[ExecRecord] = []
    for record in data.get("execs") or ():
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in names
        }
        records.append(ExecRecord(**fields))
    return {"execs": tuple(records), "execs_omitted": int(data.get("execs_omitted", 0))}


@_decoder
def command_result(data: Mapping[str, Any]) -> CommandResult:
    fields = {f.name for f in dataclasses.fields(CommandResult)} - {"execs", "execs_omitted"}
    return CommandResult(**{k: v for k, v in data.items() if k in fields}, **_execs(data))


@_decoder
def execution(data: Mapping[str, Any]) -> Execution:
    error = data.get("error")
    return Execution(
        results=tuple(Result(data=dict(r["data"])) for r in data.get("results", ())),
        logs=Logs(**data.get("logs", {})),
        error=ExecutionError(**error) if error else None,
        duration_s=float(data.get("duration_s", 0.0)),
        timed_out=bool(data.get("timed_out", False)),
        truncated=bool(data.get("truncated", False)),
        **_execs(data),
    )


@_decoder
def entry(data: Mapping[str, Any]) -> EntryInfo:
    return EntryInfo(
        path=data["path"], name=data["name"], type=EntryType(data["type"]), size=int(data["size"]),
        mode=int(data["mode"]), mtime=float(data["mtime"]), ctime_ns=int(data.get("ctime_ns", 0)),
        inode=int(data.get("inode", 0)), lossy=data.get("lossy") is True,
    )  # fmt: skip


def listing(data: Sequence[Mapping[str, Any]], headers: Mapping[str, str]) -> Listing:
    """A listing from the service: its entries, cut where the service's header says so."""
    return Listing((entry(e) for e in data), truncated=headers.get(LISTING_TRUNCATED_HEADER) == "true")


@_decoder
def enforcement(data: Mapping[str, Any]) -> Enforcement:
    host = data.get("host")
    names = ("memory", "cpus", "pids", "disk", "network", "timeout", "files", "ptys")
    return Enforcement(
        **{name: Mechanism(data[name]) for name in names if name in data},
        host=HostShare(**host) if host else None,
        weakened=tuple(data.get("weakened", ())),
        timeout_margin_s=float(data.get("timeout_margin_s", Enforcement.timeout_margin_s)),
    )


def snapshot_value(data: Mapping[str, Any], url: str) -> Snapshot:
    """A snapshot the service keeps (``store`` is the service's URL: it never leaves it)."""
    return Snapshot(
        id=str(data["id"]), kind=SnapshotKind(data["kind"]), tier=str(data["tier"]),
        source=str(data.get("source", "")), taken_at=float(data.get("taken_at", 0.0)),
        size_bytes=int(data.get("size_bytes", 0)), store=url,
    )  # fmt: skip


def snapshot_id(snapshot: Snapshot | str) -> str:
    if isinstance(snapshot, Snapshot):
        return snapshot.id
    if isinstance(snapshot, str):
        return check_id(snapshot, argument="snapshot")
    raise exc.InvalidArgument(
        f"snapshot must be a Snapshot or its id, got {type(snapshot).__name__}", argument="snapshot"
    )


def limits_body(limits: Limits | None) -> dict[str, Any] | None:
    """A ``Limits`` as the service takes it (a sandbox's, a run's sandbox's)."""
    if limits is None:
        return None
    if not isinstance(limits, Limits):
        raise exc.InvalidArgument(
            f"limits must be a Limits, got {type(limits).__name__}", argument="limits",
            fix="give Limits(memory_mb=..., timeout_s=...)",
        )  # fmt: skip
    body = {k: v for k, v in dataclasses.asdict(limits).items() if v is not None}
    if body["approval_wait_s"] == Limits.approval_wait_s:  # a service older than it refuses the field
        del body["approval_wait_s"]
    return body


def _network(network: NetworkPolicy) -> dict[str, Any]:
    """What the service is told of a network: on or off, and the hosts. The rest (ports and
    methods, addresses, limits, credentials) is the tenant policy's to say; the service
    applies its own, so a client's would be dropped without a word: refused instead."""
    extra = [
        name
        for name in ("rules", "allow_addresses", "resolve", "credentials", "upstream_ca",
                     "max_requests_per_minute", "max_bytes_per_minute")
        if getattr(network, name) != getattr(_NO_NETWORK, name)
    ]  # fmt: skip
    if extra:
        raise exc.InvalidArgument(
            f"a remote sandbox's network is its hosts alone; {', '.join(extra)} come from the "
            "tenant's policy on the service",
            argument="network",
            fix='NetworkPolicy(allow_hosts=("pypi.org",)); put ports, methods and credentials in the '
            "tenant's policy ([network] allow, [credentials])",
        )
    return {"enabled": network.enabled, "allow_hosts": list(network.allow_hosts)}


_NO_NETWORK = NetworkPolicy()


def create_body(
    tier: str | None, *, trust: Trust | str | None, limits: Limits | None, network: NetworkPolicy | None,
    envs: Mapping[str, str] | None, allow_weaker: bool, labels: Mapping[str, str] | None,
    prefer: str | None, idle_timeout_s: float | None, snapshot: Snapshot | str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The body of ``POST /v1/sandboxes``."""
    body: dict[str, Any] = {
        "tier": tier, "trust": str(trust) if trust is not None else None, "limits": limits_body(limits),
        "envs": check_envs(envs), "allow_weaker": allow_weaker, "labels": check_labels(labels),
        "prefer": prefer, "idle_timeout_s": idle_timeout_s,
        "snapshot": snapshot_id(snapshot) if snapshot is not None else None,
    }  # fmt: skip
    if network is not None:
        if not isinstance(network, NetworkPolicy):
            raise exc.InvalidArgument(
                f"network must be a NetworkPolicy, got {type(network).__name__}", argument="network",
                fix='give NetworkPolicy(allow_hosts=("pypi.org",))',
            )  # fmt: skip
        body["network"] = _network(network)
    return {k: v for k, v in body.items() if v is not None}


def command_body(
    cmd: str | Sequence[str], *, cwd: str | None, envs: Mapping[str, str] | None, timeout_s: float | None,
    stdin: str | bytes | bytearray | memoryview | None,
) -> dict[str, Any]:  # fmt: skip
    """The body of a command: checked as the local SDK checks it (``command_op``), and as text
    the service can take (UTF-8; stdin bytes only when they are UTF-8)."""
    argv = _inputs.argv(cmd)
    cwd = None if cwd is None else _inputs.text(cwd, "cwd")
    text = _inputs.stdin_text(stdin)
    op = command_op(argv, cwd, check_envs(envs), timeout_s, text)
    return {"cmd": argv, "cwd": cwd, "envs": dict(op.envs), "timeout_s": op.timeout_s, "stdin": text}


def code_body(code: str, language: str, timeout_s: float | None) -> dict[str, Any]:
    """The body of a ``run_code``: checked as the local SDK checks it (``code_op``), in UTF-8."""
    for value, argument in ((code, "code"), (language, "language")):
        if isinstance(value, str):
            _inputs.utf8(value, argument)
    op = code_op(code, language, timeout_s)
    return {"code": code, "language": language, "timeout_s": op.timeout_s}


def path_params(path: object, **more: object) -> dict[str, Any]:
    """A files call's query: the path checked as the local SDK checks it, in UTF-8."""
    return {"path": _inputs.path(path), **more}


def archive_params(dest: object, *, source: object, max_bytes: object, max_entries: object) -> dict[str, Any]:
    """A download's query, once ``dest`` is a host path (the limits: ``Extraction`` checks them)."""
    _inputs.host_path(dest, "dest")
    return path_params(source, max_bytes=max_bytes, max_entries=max_entries)


def upload_body(
    source: str | Path, dest: str, hide: Sequence[str], read: Sequence[str]
) -> tuple[dict[str, Any], bytes]:
    """An upload's query and tar: the local SDK's ``upload_op`` checks (a folder, a workspace
    ``dest``); the tar is whole (the service takes one body)."""
    op = upload_op(_inputs.folder(source, "source"), _inputs.path(dest, "dest"), hide, read)
    folder = op.folder
    assert folder is not None  # upload_op's is a host folder's
    return {"path": op.path}, tar_directory(folder.source, folder.hide, folder.read)


def range_params(path: object, offset: object, length: object) -> dict[str, Any]:
    op = range_op(_inputs.path(path), _inputs.offset(offset, "offset"), _inputs.offset(length, "length"))
    return {"path": op.path, "offset": op.offset, "length": op.length}


def streamed_line(
    line: str, on_stdout: TextCallback | None, on_stderr: TextCallback | None
) -> dict[str, Any] | None:
    """One NDJSON line of a streamed command: output to its callback (None), the result (the
    result), or the problem that ended it (raised as the SDK's error)."""
    if not line:
        return None
    try:
        item = json.loads(line)
    except ValueError:
        item = None
    if not isinstance(item, dict):
        raise exc.ServiceError("the service sent a line of a stream that is no JSON object")
    kind = item.get("type")
    if kind in ("stdout", "stderr"):
        callback = on_stdout if kind == "stdout" else on_stderr
        if callback is not None and isinstance(item.get("data"), str):
            callback(item["data"])
        return None
    if kind == "result" and isinstance(item.get("result"), dict):
        result: dict[str, Any] = item["result"]
        return result
    if kind == "error" and isinstance(item.get("problem"), dict):
        problem = item["problem"]
        status = problem.get("status")
        raise error_from(problem, status if isinstance(status, int) and not isinstance(status, bool) else 500)
    if kind in ("result", "error"):
        raise exc.ServiceError(f"the service sent a {kind} line without its {kind}")
    return None


def result_max_bytes(info: Mapping[str, Any]) -> int:
    """What a command's or a ``run_code``'s result may take as JSON: its stdout, its stderr
    and a ``run_code``'s results, each up to the sandbox's ``output_bytes`` (as the service
    said it), each byte up to six escaped (``\\u0000``); at most a file read's cap."""
    limits = info.get("limits")
    output = limits.get("output_bytes") if isinstance(limits, Mapping) else None
    if isinstance(output, bool) or not isinstance(output, int) or output < 1:
        output = Limits().output_bytes
    return min(ReadFile.max_bytes, ANSWER_MAX_BYTES + 3 * 6 * output)


def ended_without_result() -> exc.ServiceUnavailable:
    return exc.ServiceUnavailable("the service ended the stream without a result")


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
