"""The file requests of a supervised sandbox: each op's request, the chunking of large files
and archives, and the checks on what comes back.

The supervisor lives with the untrusted code, so everything it sends is bounded before it is
kept: a chunk longer than asked for, a trickle of short pieces, a listing or report past its
caps closes the sandbox (``close``) and raises ``ProtocolError``. Kept apart from the rest of
``SupervisedInstance`` because this is where host memory meets sandbox bytes.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from stockade import exceptions as exc
from stockade._gather import Gathered
from stockade.sandbox._channel import LIVENESS_S, Channel, JSONTooLarge, loads_bounded
from stockade.sandbox._replies import WORKSPACE_ERRORS, area_args, entry_info, int_field
from stockade.sandbox.base import OutputSink
from stockade.sandbox.ops import Area, GetArchive, ListDir, MakeDir, PutArchive, ReadFile, Stat, WriteFile
from stockade.sandbox.supervisor.protocol import MAX_CODE_REPLY
from stockade.types import EntryInfo, Listing, SkippedEntry

FILE_OP_TIMEOUT_S = 120.0
# How soon a supervisor that stopped answering (frozen, or hung) is noticed when no other
# file request or reset holds its loop (``LIVENESS_S``): a ping sent just ahead of a request
# is answered before the request is begun, however long the request itself may rightly take.
# One that stopped reading is noticed by the send of the request's body (``Channel.call``).
TRANSFER_CHUNK = 4 * 1024 * 1024
# The largest frame the host needs is a run_code report: files move in TRANSFER_CHUNK pieces.
MAX_FRAME = MAX_CODE_REPLY
# A listing: the supervisor sends at most 100,000 entries of eight keys (28 values each, 30
# with ``lossy``).
MAX_LIST_ENTRIES = 100_000
MAX_LIST_VALUES = 30 * MAX_LIST_ENTRIES


class FileRequests:
    """One sandbox's file ops over its channel; ``close`` ends the sandbox when it lies."""

    def __init__(self, channel: Channel, *, close: Callable[[], None], alive: Callable[[], bool]) -> None:
        self._channel = channel
        self._close = close
        self._alive = alive
        self._lock = threading.Lock()
        self._in_flight = 0  # requests of ours the supervisor serves in its loop, one by one

    def answer(self, header: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """Send a request the supervisor serves before it reads the next one (a file op, a
        reset) and wait up to ``FILE_OP_TIMEOUT_S`` for its answer (``TimeoutError``). Alone
        in flight, it goes behind a ping: a supervisor that does not answer that within
        ``LIVENESS_S`` is taken for frozen, and the sandbox closed (``SandboxCrashed``), not
        waited on for two minutes."""
        with self._lock:
            alone = self._in_flight == 0
            self._in_flight += 1
        try:
            ping = self._channel.call({"op": "ping"}) if alone else None
            call = self._channel.call(header, body, time.monotonic() + FILE_OP_TIMEOUT_S)
            if ping is not None:
                try:
                    ping.result(time.monotonic() + LIVENESS_S)
                except TimeoutError:
                    self._close()
                    message = f"the supervisor did not answer within {LIVENESS_S:g}s: frozen or hung"
                    raise exc.SandboxCrashed(message, cause="unresponsive") from None
            return call.result(time.monotonic() + FILE_OP_TIMEOUT_S)
        finally:
            with self._lock:
                self._in_flight -= 1

    def request(self, op: str, args: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """One request and its answer; the supervisor's refusals as typed workspace errors."""
        try:
            header, data = self.answer({"op": op, **args}, body)
        except TimeoutError:
            self._close()
            message = f"supervisor did not answer a {op} in time"
            raise exc.SandboxCrashed(message, cause="unresponsive") from None
        if header.get("ev") == "error":
            kind = str(header.get("kind", ""))
            message = str(header.get("message", ""))
            path = str(args.get("path", ""))
            if kind == "internal":
                raise exc.ProtocolError(f"supervisor could not {op} {path!r}: {message}")
            raise WORKSPACE_ERRORS.get(kind, exc.WorkspaceError)(f"{op} {path!r}: {message}", path=path)
        return header, data

    def make_dir(self, op: MakeDir) -> EntryInfo:
        return entry_info(self.request("mkdir", {"path": op.path, "parents": op.parents})[0].get("entry"))

    def stat(self, op: Stat) -> EntryInfo | None:
        raw = self.request("stat", {"path": op.path, "follow": op.follow_symlinks})[0].get("entry")
        return None if raw is None else entry_info(raw)

    def list_dir(self, op: ListDir) -> Listing:
        header, body = self.request("list", {"path": op.path, "depth": op.depth})
        entries = self.json_body(body, max_values=MAX_LIST_VALUES, what="listing")
        if not isinstance(entries, list) or len(entries) > MAX_LIST_ENTRIES:
            raise exc.ProtocolError("malformed listing")
        return Listing((entry_info(e) for e in entries), truncated=header.get("truncated") is True)

    def read(self, op: ReadFile) -> bytes:
        """Read in chunks: the supervisor never holds a whole large file in memory, and the
        host holds one buffer of it, filled in place (``Gathered``), never longer than
        ``op.length`` or ``op.max_bytes``, and the chunk in transit: about the result's size,
        not twice it. The buffer is set aside for the size the supervisor announces; one that
        lies, or a file that grows or shrinks meanwhile, changes how much is read, within
        those bounds, never what is returned for what was read."""
        gathered: Gathered | None = None
        offset = op.offset
        ranged = op.length is not None  # a range of a file of any size; else the whole, capped
        end = op.offset + min(op.length, op.max_bytes) if op.length is not None else op.max_bytes
        while offset < end:
            asked = min(TRANSFER_CHUNK, end - offset)
            args = {"path": op.path, "max_bytes": op.max_bytes, "offset": offset, "length": asked}
            h, data = self.request("read", {**args, "range": True} if ranged else args)
            size = int_field(h.get("size"))
            if len(data) > asked or (size > op.max_bytes and not ranged):
                # The supervisor is untrusted: one that keeps sending must not fill our memory
                # (an honest one refuses a file over max_bytes rather than send any of it).
                self._close()
                raise exc.ProtocolError(f"the supervisor sent more of {op.path!r} than asked for")
            offset += len(data)
            last = len(data) < asked or offset >= size
            if gathered is None:
                if last:
                    return data  # one chunk: as it came, no copy
                gathered = Gathered(min(size, end) - op.offset)
            gathered.add(data)
            del data  # not held while the next chunk comes in
            if last:
                break
        return b"" if gathered is None else gathered.take()

    def get_archive(self, op: GetArchive, sink: OutputSink | None) -> bytes:
        """Pull the archive a chunk at a time: neither side ever holds more than one chunk.

        The sink (the host's extractor) gets each chunk as ``sink(0, chunk)`` and stops the
        transfer by raising; without a sink the chunks are joined, at most ``max_bytes``.
        """
        caps = {
            "path": op.path,
            "max_bytes": op.max_bytes,
            "max_entries": op.max_entries,
            **({"deep": "refuse"} if op.refuse_deep else {}),
            **area_args(op.area),
        }
        tx = self._archive_step(op, {**caps, "stage": "open"})[0].get("tx")
        if not isinstance(tx, str) or not 0 < len(tx) <= 64:
            raise exc.ProtocolError("the supervisor opened a download without a usable id")
        kept: list[bytes] = []
        size = 0
        over = False
        try:
            while True:
                args = {
                    "path": op.path,
                    "stage": "next",
                    "tx": tx,
                    "length": TRANSFER_CHUNK,
                    **area_args(op.area),
                }
                h, data = self._archive_step(op, args)
                end = h.get("eof") is True
                if len(data) > TRANSFER_CHUNK or (len(data) < TRANSFER_CHUNK and not end):
                    # The supervisor is untrusted: one that sends more than asked must not
                    # fill our memory, nor one that sends less hold us in a loop of trickles
                    # (an honest one fills every piece but the last).
                    self._close()
                    raise exc.ProtocolError(f"the supervisor sent a malformed piece of {op.path!r}")
                size += len(data)
                if sink is not None:
                    if data:
                        sink(0, data)
                elif size > op.max_bytes:
                    raise exc.FileTooLarge(
                        f"the archive of {op.path!r} is over {op.max_bytes} bytes (max_bytes)", path=op.path
                    )
                else:
                    kept.append(data)
                if end:
                    over = True
                    return b"".join(kept)
        finally:
            if not over and self._alive():  # tell the supervisor to let go of the transfer
                with contextlib.suppress(exc.StockadeError):
                    self.request(
                        "get_archive", {"path": op.path, "stage": "close", "tx": tx, **area_args(op.area)}
                    )

    def _archive_step(self, op: GetArchive, args: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        try:
            return self.request("get_archive", args)
        except exc.WorkspaceError as err:  # the sandbox refused: a cap, a missing folder, ...
            said = str(err).removeprefix(f"get_archive {op.path!r}: ")
            what = (
                f"cannot snapshot the sandbox's {op.area}"  # only a snapshot refuses deep folders
                if op.refuse_deep
                else f"cannot download {op.path or '/workspace'!r}"
            )
            raise type(err)(f"{what}: {said}", path=op.path) from None

    def put_stream(
        self, area: Area, chunks: Iterator[bytes], path: str = "", keep: dict[str, object] | None = None
    ) -> list[SkippedEntry]:
        """Unpack a tar stream into ``path`` of ``area`` (``workspace``, ``tmp``) a chunk at a
        time: neither side holds more than one chunk (``supervisor/unpack.py``). What is
        unpacked is moved into place only once ``chunks`` ended without raising (a snapshot's
        object iterator raises after its last chunk when it does not hash to its name); on any
        failure the supervisor is told to drop it, and nothing of it is left in place.
        ``keep``: what of the stream the rules let in (``_globs.unpack_filter``). Returns the
        entries left out as no workspace content (FIFOs, sockets, devices)."""
        where = {"path": path, **area_args(area)}
        opening = {"stage": "open", **where, **({"keep": keep} if keep is not None else {})}
        tx = self.request("put_archive", opening)[0].get("tx")
        if not isinstance(tx, str) or not 0 < len(tx) <= 64:
            raise exc.ProtocolError("the supervisor opened a restore without a usable id")
        try:
            for chunk in chunks:
                if len(chunk) > TRANSFER_CHUNK:  # pragma: no cover (the caller's bug)
                    raise exc.ProtocolError(f"a chunk of {len(chunk)} bytes is over {TRANSFER_CHUNK}")
                self.request("put_archive", {"stage": "append", "tx": tx, **where}, chunk)
            done = self.request("put_archive", {"stage": "commit", "tx": tx, **where})[0]
        except BaseException:
            if self._alive():
                with contextlib.suppress(exc.StockadeError):
                    self.request("put_archive", {"stage": "abort", "tx": tx, **where})
            raise
        skipped = done.get("skipped")
        return [
            SkippedEntry(path=str(e.get("path", "")), kind=str(e.get("kind", "")))
            for e in (skipped if isinstance(skipped, list) else [])
            if isinstance(e, dict)
        ]

    def write(self, op: WriteFile) -> EntryInfo:
        args: dict[str, Any] = {"path": op.path, "mode": op.mode, "parents": op.parents}
        if len(op.data) <= TRANSFER_CHUNK:
            return entry_info(self.request("write", args, op.data)[0].get("entry"))
        view = memoryview(op.data)
        # Named here, not by the supervisor: an interrupt while the open is answered (the
        # temporary file made, its name not heard yet) can still remove it.
        tmp = f".{op.path.rpartition('/')[2]}"[:200] + f".stockade-{secrets.token_hex(8)}"
        try:
            self.request("write", {**args, "stage": "open", "tmp": tmp}, bytes(view[:TRANSFER_CHUNK]))
            for start in range(TRANSFER_CHUNK, len(view), TRANSFER_CHUNK):
                chunk = bytes(view[start : start + TRANSFER_CHUNK])
                self.request("write", {**args, "stage": "append", "tmp": tmp}, chunk)
            return entry_info(self.request("write", {**args, "stage": "commit", "tmp": tmp})[0].get("entry"))
        except BaseException:  # refused, or interrupted between chunks: no partial file left
            if self._alive():
                with contextlib.suppress(exc.StockadeError):
                    self.request("write", {**args, "stage": "abort", "tmp": tmp})
            raise

    def json_body(self, body: bytes, *, max_values: int, what: str) -> Any:
        """A JSON payload from the supervisor, bounded in bytes and values before parsing.

        A payload over the bounds is no answer the supervisor and interpreter give: code in
        the sandbox wrote it (to the interpreter's reply pipe), or took the supervisor over.
        The sandbox is closed, as for any other lie, and the caller gets a ProtocolError.
        """
        try:
            return loads_bounded(body, max_bytes=MAX_FRAME, max_values=max_values)
        except JSONTooLarge as err:
            self._close()
            raise exc.ProtocolError(f"the sandbox sent an oversized {what} ({err}); it was closed") from None
        except (ValueError, RecursionError) as err:
            raise exc.ProtocolError(f"malformed {what}: {str(err)[:200]}") from None


def archive_chunks(op: PutArchive) -> Iterator[bytes]:
    """What a ``PutArchive`` sends, ``TRANSFER_CHUNK`` at a time: its host folder's tar as it
    is made, or its archive's bytes cut into chunks."""
    if op.folder is not None:
        return op.folder.chunks(TRANSFER_CHUNK)
    view = memoryview(op.data)
    return (bytes(view[at : at + TRANSFER_CHUNK]) for at in range(0, len(view), TRANSFER_CHUNK))
