"""``sbx.commands`` and ``sbx.files``: the namespaces of ``Sandbox`` and their asyncio twins
(``AsyncSandbox``'s), each a thin layer that builds ``ops`` values (``_requests``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, overload

from stockade._checks import check_data, check_host_path, check_number
from stockade._threads import off_loop
from stockade.sandbox._requests import (
    MAX_OFFSET,
    TextCallback,
    check_callbacks,
    check_format,
    check_path,
    command_op,
    file_text,
    list_op,
    range_op,
    text_sink,
    upload_op,
    write_op,
)
from stockade.sandbox.base import AsyncInstance, Instance, OutputSink
from stockade.sandbox.ops import (
    DOWNLOAD_MAX_BYTES,
    DOWNLOAD_MAX_ENTRIES,
    GetArchive,
    MakeDir,
    ReadFile,
    Remove,
    Stat,
)
from stockade.types import CommandResult, DownloadResult, EntryInfo, Listing

__all__ = ["AsyncCommands", "AsyncFiles", "Commands", "Files", "loop_sink", "threadsafe"]


# -- sync --------------------------------------------------------------------------------


class Commands:
    def __init__(self, instance: Instance) -> None:
        self._instance = instance

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
        """Run ``cmd`` (a shell string, or an argv list run without a shell).

        A non-zero exit, a timeout or an OOM kill is reported in the result, never raised.
        """
        op = command_op(cmd, cwd, envs, timeout_s, stdin)
        return self._instance.execute(op, text_sink(on_stdout, on_stderr))


class Files:
    """The workspace (``/workspace`` inside). Paths are relative to it, or absolute under it."""

    def __init__(self, instance: Instance) -> None:
        self._instance = instance

    @overload
    def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        """The file (at most 256 MiB, ``FileTooLarge`` past it), read in chunks: the host holds
        it once, plus a chunk in transit, and as text the string beside the bytes it is decoded
        from."""
        raw = check_format(format)
        data = self._instance.execute(ReadFile(path=check_path(path)))
        return data if raw else file_text(data, path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """At most ``length`` bytes of the file from byte ``offset`` (fewer at its end): the
        host holds that much of it once (plus a chunk in transit), however large the file."""
        return self._instance.execute(range_op(path, offset, length))

    def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> EntryInfo:
        return self._instance.execute(write_op(path, data, mode))

    def list(self, path: str = "", *, depth: int = 1) -> Listing:
        """The entries under ``path`` to ``depth``; ``truncated`` when there were more than a
        listing holds (100,000). The caller's own copy: the op's answer is not shared."""
        found = self._instance.execute(list_op(path, depth))
        return Listing(found, truncated=found.truncated)

    def stat(self, path: str) -> EntryInfo | None:
        return self._instance.execute(Stat(path=check_path(path), follow_symlinks=False))

    def exists(self, path: str) -> bool:
        return self.stat(path) is not None

    def remove(self, path: str) -> None:
        self._instance.execute(Remove(path=check_path(path)))

    def make_dir(self, path: str) -> EntryInfo:
        return self._instance.execute(MakeDir(path=check_path(path)))

    def upload_dir(
        self, source: str | Path, dest: str = "", *, hide: Sequence[str] = (), read: Sequence[str] = ("**",)
    ) -> None:
        """Copy a host directory into the workspace: what ``read`` names, but what ``hide``
        names (workspace globs). The tar is made as it is sent, a chunk at a time, and
        unpacked inside as it comes: neither side holds more than a chunk or two of it,
        whatever the folder holds. All or nothing: what was unpacked moves into place only
        once the whole folder was; a failure (a file that does not fit: ``WorkspaceFull``)
        leaves the workspace as it was."""
        self._instance.execute(upload_op(source, dest, hide, read))

    def download_dir(
        self,
        dest: str | Path,
        source: str = "",
        *,
        max_bytes: int = DOWNLOAD_MAX_BYTES,
        max_entries: int = DOWNLOAD_MAX_ENTRIES,
    ) -> DownloadResult:
        """Copy a workspace folder (the whole workspace by default) into ``dest`` on the host.

        All or nothing, and nothing outside ``dest``: no link is followed while writing,
        symlinks are kept only when they resolve inside ``dest`` by every route (the others
        are left out and listed in the result's ``skipped`` as ``"link out"``; one that
        would lead out through a link already in ``dest`` fails the download), hard links
        stay hard links, FIFOs, sockets and devices are skipped (and listed in the result),
        setuid/setgid and group/other write bits are dropped. ``max_bytes`` caps what the
        download writes (1 GiB by default): the file contents (a sparse file counts by its
        apparent size) and each entry's name plus 256 bytes (4 KiB for a folder; a link's
        target too), and ``max_entries`` the entries: past either, ``FileTooLarge`` and
        nothing is left. A tree whose links take more than 8 million steps to check is refused
        the same way.
        """
        from stockade.sandbox._archive import Extraction

        op = download_op(dest, source, max_bytes, max_entries)
        with Extraction(dest, max_bytes=max_bytes, max_entries=max_entries) as unpack:
            whole = self._instance.execute(op, unpack.sink)
            if whole:  # a backend that answers with the whole archive (the shipped fakes)
                unpack.feed(whole)
            return unpack.finish()


def download_op(dest: object, source: object, max_bytes: object, max_entries: object) -> GetArchive:
    """The download of ``source`` (in the workspace) into ``dest`` (on the host), its caps checked."""
    check_host_path(dest, argument="dest")
    for argument, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
        check_number(value, argument=argument, integer=True, low=0, high=MAX_OFFSET)
    assert isinstance(max_bytes, int) and isinstance(max_entries, int)
    return GetArchive(
        path=check_path(source, argument="source"), max_bytes=max_bytes, max_entries=max_entries
    )


# -- async -------------------------------------------------------------------------------


def threadsafe(callback: TextCallback | None) -> TextCallback | None:
    """Deliver streamed output on the event loop's thread, not the worker's, as the sync API
    would: the worker waits for the callback, and what it raises is raised in the worker (the
    op ends with it, as ``Sandbox``'s does), not left to the loop's exception handler."""
    import asyncio  # lazily: importing stockade must stay cheap
    import concurrent.futures
    import threading

    if callback is None:
        return None
    loop, on_loop = asyncio.get_running_loop(), threading.get_ident()

    def deliver(text: str) -> None:
        if threading.get_ident() == on_loop:  # an async instance streaming from the loop itself
            callback(text)
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def call() -> None:
            try:
                callback(text)
            except BaseException as err:
                done.set_exception(err)
            else:
                done.set_result(None)

        loop.call_soon_threadsafe(call)
        done.result()

    return deliver


def loop_sink(on_stdout: TextCallback | None, on_stderr: TextCallback | None) -> OutputSink | None:
    """``text_sink`` for an async sandbox: the callbacks checked as given (before they are
    wrapped), decoded in the worker, called on the loop (``threadsafe``)."""
    check_callbacks(on_stdout, on_stderr)
    return text_sink(threadsafe(on_stdout), threadsafe(on_stderr))


# Text longer than this is checked and encoded in a worker thread, this much at a time: one
# call that holds the GIL for the whole of it would stall the loop's thread as much as doing it
# there; a slice holds it about a millisecond.
_SLICE = 1 << 20


def _encoded(text: str) -> bytes:
    """``check_data(text)``, a slice at a time (a str has no surrogate pair to split)."""
    return b"".join(
        check_data(text[start : start + _SLICE], argument="data") for start in range(0, len(text), _SLICE)
    )


class AsyncCommands:
    def __init__(self, instance: AsyncInstance) -> None:
        self._instance = instance

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
        op = command_op(cmd, cwd, envs, timeout_s, stdin)
        return await self._instance.aexecute(op, loop_sink(on_stdout, on_stderr))


class AsyncFiles:
    def __init__(self, instance: AsyncInstance) -> None:
        self._instance = instance

    async def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        raw = check_format(format)
        data = await self._instance.aexecute(ReadFile(path=check_path(path)))
        return data if raw else file_text(data, path)

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        """``Files.read_range``'s twin."""
        return await self._instance.aexecute(range_op(path, offset, length))

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> EntryInfo:
        if isinstance(data, str) and len(data) > _SLICE:  # checked and encoded off the loop
            data = await off_loop(_encoded, data)
        return await self._instance.aexecute(write_op(path, data, mode))

    async def list(self, path: str = "", *, depth: int = 1) -> Listing:
        found = await self._instance.aexecute(list_op(path, depth))
        return Listing(found, truncated=found.truncated)

    async def stat(self, path: str) -> EntryInfo | None:
        return await self._instance.aexecute(Stat(path=check_path(path), follow_symlinks=False))

    async def exists(self, path: str) -> bool:
        return await self.stat(path) is not None

    async def remove(self, path: str) -> None:
        await self._instance.aexecute(Remove(path=check_path(path)))

    async def make_dir(self, path: str) -> EntryInfo:
        return await self._instance.aexecute(MakeDir(path=check_path(path)))

    async def upload_dir(
        self, source: str | Path, dest: str = "", *, hide: Sequence[str] = (), read: Sequence[str] = ("**",)
    ) -> None:
        """See ``Files.upload_dir``: the folder is read in the worker thread that sends it."""
        await self._instance.aexecute(upload_op(source, dest, hide, read))

    async def download_dir(
        self,
        dest: str | Path,
        source: str = "",
        *,
        max_bytes: int = DOWNLOAD_MAX_BYTES,
        max_entries: int = DOWNLOAD_MAX_ENTRIES,
    ) -> DownloadResult:
        """See ``Files.download_dir``: the same guarantees, the disk work in a worker thread."""
        import asyncio  # lazily: importing stockade must stay cheap

        from stockade.sandbox._archive import Extraction

        op = download_op(dest, source, max_bytes, max_entries)
        unpack = await off_loop(Extraction, dest, max_bytes=max_bytes, max_entries=max_entries)
        try:
            whole = await self._instance.aexecute(op, unpack.sink)
            if whole:  # a backend that answers with the whole archive (the shipped fakes)
                await off_loop(unpack.feed, whole)
            return await off_loop(unpack.finish)
        except BaseException:
            # Shielded: a second cancellation must not leave half a download behind.
            await asyncio.shield(off_loop(unpack.abort))
            raise
