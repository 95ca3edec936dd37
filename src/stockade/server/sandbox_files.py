"""A sandbox's files over HTTP: ``/v1/sandboxes/{id}/files`` and ``/v1/sandboxes/{id}/archive``.

List, stat, read (whole or a range), write, remove and make a folder; a folder uploaded or
downloaded as a tar. Apart from ``server/sandboxes.py`` because bytes cross here: a body read
under the service's caps, content counted against the tenant's ``bodies_mb`` until its client
has read it (``server/held.py``), tars unpacked and packed again on the host in scratch space.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from stockade import exceptions as exc
from stockade.sandbox.ops import LISTING_TRUNCATED_HEADER, ReadFile
from stockade.server.authz import check_sandbox_tool
from stockade.server.bodies import JSONRoute, raw_body, read_body
from stockade.server.deps import Caller, get_service
from stockade.server.downloads import entries_that_fit, pack_folder
from stockade.server.held import CHUNK, HeldResponse, Hold, held_bytes, unpacking
from stockade.server.sandbox_calls import call, registry_of
from stockade.server.scratch import scratch
from stockade.server.uploads import unpack_within
from stockade.types import EntryInfo, Listing

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"], route_class=JSONRoute)

PathQuery = Annotated[str, Query(description="relative to the workspace, or under /workspace")]


def _entry(entry: EntryInfo) -> dict[str, Any]:
    return dataclasses.asdict(entry)


@router.get(
    "/{sandbox_id}/files",
    summary="List a folder",
    description=f"At most 100,000 entries: past them the listing is cut, and the response has "
    f"the header `{LISTING_TRUNCATED_HEADER}: true`.",
)
async def list_files(
    sandbox_id: str,
    request: Request,
    response: Response,
    caller: Caller,
    path: PathQuery = "",
    depth: Annotated[int, Query(ge=1, le=32)] = 1,
) -> list[dict[str, Any]]:
    check_sandbox_tool(caller, "list")
    registry = registry_of(request)

    def work() -> Listing:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.files.list(path, depth=depth)

    listing = await call(request, caller, work)
    if listing.truncated:
        response.headers[LISTING_TRUNCATED_HEADER] = "true"
    return [_entry(e) for e in listing]


@router.get("/{sandbox_id}/files/stat", summary="One entry (404 when there is none)")
async def stat_file(sandbox_id: str, request: Request, caller: Caller, path: PathQuery) -> dict[str, Any]:
    check_sandbox_tool(caller, "stat")
    registry = registry_of(request)

    def work() -> EntryInfo | None:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.files.stat(path)

    entry = await call(request, caller, work)
    if entry is None:
        raise exc.SandboxFileNotFound(f"nothing at {path!r}", path=path)
    return _entry(entry)


@router.get("/{sandbox_id}/files/content", summary="Read a file (or, with length, a range of it)",
            response_class=Response)  # fmt: skip
async def read_file(
    sandbox_id: str, request: Request, caller: Caller, path: PathQuery,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    length: Annotated[int | None, Query(ge=0, le=2**62)] = None,
) -> Response:  # fmt: skip
    check_sandbox_tool(caller, "read")
    registry = registry_of(request)

    held = held_bytes(request)

    def work() -> tuple[bytes, Hold]:
        # counted before it is read (its size, or the range's length), so a tenant's share
        # bounds its reads in flight too, then as it came
        with registry.use(caller, sandbox_id) as sandbox:
            if length is not None:
                expected = min(length, ReadFile.max_bytes)
            else:
                entry = sandbox.files.stat(path)
                expected = entry.size if entry is not None else 0
            hold = held.hold(caller.tenant, expected, what="a file's content")
            try:
                if length is not None:
                    data = sandbox.files.read_range(path, offset, length)
                else:
                    data = sandbox.files.read(path, format="bytes")
                hold.resize(len(data), what="a file's content")
            except BaseException:
                hold.release()
                raise
            return data, hold

    data, hold = await call(request, caller, work)
    return HeldResponse.of(data, hold=hold, media_type="application/octet-stream")


@router.put("/{sandbox_id}/files/content", summary="Write a file (the body is its content)")
@raw_body
async def write_file(
    sandbox_id: str, request: Request, caller: Caller, path: PathQuery,
    mode: Annotated[int, Query(ge=0, le=0o777)] = 0o644,  # as the SDK's: no setuid, setgid or sticky
) -> dict[str, Any]:  # fmt: skip
    check_sandbox_tool(caller, "write")  # before its body is read
    registry = registry_of(request)
    registry.get(caller, sandbox_id)
    data = await read_body(request, get_service(request).config.max_file_bytes, caller)

    def work() -> EntryInfo:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.files.write(path, data, mode=mode)

    return _entry(await call(request, caller, work))


@router.delete("/{sandbox_id}/files", status_code=204, summary="Remove a file or folder")
async def remove_file(sandbox_id: str, request: Request, caller: Caller, path: PathQuery) -> Response:
    check_sandbox_tool(caller, "remove")
    registry = registry_of(request)

    def work() -> None:
        with registry.use(caller, sandbox_id) as sandbox:
            sandbox.files.remove(path)

    await call(request, caller, work)
    return Response(status_code=204)


@router.post("/{sandbox_id}/files/dir", summary="Make a folder (and its parents)")
async def make_dir(sandbox_id: str, request: Request, caller: Caller, path: PathQuery) -> dict[str, Any]:
    check_sandbox_tool(caller, "make_dir")
    registry = registry_of(request)

    def work() -> EntryInfo:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.files.make_dir(path)

    return _entry(await call(request, caller, work))


@router.put("/{sandbox_id}/archive", status_code=204, summary="Upload a folder (a tar) into the workspace")
@raw_body
async def upload_archive(sandbox_id: str, request: Request, caller: Caller, path: PathQuery = "") -> Response:
    check_sandbox_tool(caller, "upload")  # before its body is read
    service = get_service(request)
    registry = registry_of(request)
    registry.get(caller, sandbox_id)
    data = await read_body(request, service.config.max_upload_bytes, caller)

    def work(room: int) -> None:
        with scratch("upload", service.config.temp_dir) as tmp:
            unpack_within(data, Path(tmp) / "in", room, service.config.max_upload_bytes)
            with registry.use(caller, sandbox_id) as sandbox:
                sandbox.files.upload_dir(Path(tmp) / "in", path)

    with unpacking(request, caller, service.config.max_upload_bytes) as room:
        await call(request, caller, lambda: work(room))
    return Response(status_code=204)


@router.get("/{sandbox_id}/archive", summary="Download a folder as a tar (checked on the server first)",
            response_class=Response)  # fmt: skip
async def download_archive(
    sandbox_id: str, request: Request, caller: Caller, path: PathQuery = "",
    max_bytes: Annotated[int | None, Query(ge=1, le=2**62)] = None,
    max_entries: Annotated[int, Query(ge=1, le=1_000_000)] = 100_000,
) -> Response:  # fmt: skip
    check_sandbox_tool(caller, "download")
    service = get_service(request)
    registry = registry_of(request)
    cap = min(max_bytes or service.config.max_upload_bytes, service.config.max_upload_bytes)

    def work() -> tuple[IO[bytes], int]:
        # the sandbox's tar is untrusted: it is unpacked with every check of files.download_dir
        # (nothing outside the folder, links resolved inside), then packed again from the host
        # into a file on disk, the whole tar (headers too) under the service's cap
        whole = service.config.max_upload_bytes
        entries = min(max_entries, entries_that_fit(whole))  # the unpack's memory: ~1 KB an entry
        with scratch("download", service.config.temp_dir) as tmp:
            dest = Path(tmp) / "out"
            with registry.use(caller, sandbox_id) as sandbox:
                try:
                    sandbox.files.download_dir(dest, path, max_bytes=cap, max_entries=entries)
                except exc.FileTooLarge as error:
                    if entries == max_entries:
                        raise
                    raise exc.FileTooLarge(
                        f"{error} (the service takes at most {entries:,}: no more fit in a tar "
                        f"under its cap of {whole:,} bytes)",
                        path=error.path,
                    ) from None
            return pack_folder(dest, tmp, cap=whole, what=path or "/")

    packed, size = await call(request, caller, work)
    try:  # a temporary file's disk until its client has read it
        hold = held_bytes(request).hold(caller.tenant, size, what="a packed folder")
    except exc.QuotaExceeded:
        packed.close()
        raise
    return HeldResponse(_read_out(packed), hold=hold, media_type="application/x-tar",
                        headers={"Content-Length": str(size)})  # fmt: skip


def _read_out(file: IO[bytes]) -> Iterator[bytes]:
    """``file``'s bytes a chunk at a time, then closed (when the client leaves, as the
    iterator is collected)."""
    with file:
        while chunk := file.read(CHUNK):
            yield chunk
