"""The supervisor's file operations: one handler per op of the protocol that touches files
(``read``, ``write``, ``mkdir``, ``stat``, ``list``, ``remove``, ``put_archive``,
``get_archive``), each called as ``handler(sup, rid, header, body)``.

Apart from the supervisor, which keeps the event loop, commands and the interpreter, because
these handlers share nothing with them but ``sup.send`` and ``sup.workspace``. How a path is
resolved inside the workspace (symlinks followed only while they stay inside) is
``fileops.py``; how a folder becomes a tar stream is ``archive.py``, how a tar stream
becomes files again ``unpack.py``.

Standard library only; runs on any Python >= 3.8 found inside the sandbox.
"""

from __future__ import annotations

import os
import stat

from fileops import DirWalk, PathRefused, Workspace, _entry, _write_all
from protocol import MAX_LIST_JSON, dumps

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Optional

    from supervisor import Supervisor

MAX_READ_FILE = 256 << 20
MAX_LIST = 100_000
ENTRY_JSON = 160  # an entry's JSON but its path and name: its keys, type, size, mode, times, inode


def op_read(sup: "Supervisor", rid: int, h: dict[str, Any], body: bytes) -> None:
    parent, name = sup.workspace.resolve(h["path"], follow_last=True)
    try:
        if not name:
            raise PathRefused("type", f"{h['path']!r} is a directory")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(name, flags, dir_fd=parent)
    finally:
        os.close(parent)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise PathRefused("type", f"{h['path']!r} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise PathRefused("type", f"{h['path']!r} is not a regular file")
        limit = int(h.get("max_bytes", MAX_READ_FILE))
        offset = int(h.get("offset", 0))
        if h.get("range"):  # a range: of a file of any size, never more than the cap
            data = os.pread(fh.fileno(), max(min(int(h["length"]), limit), 0), offset)
        else:
            if st.st_size > limit:
                raise PathRefused("too_large", f"{h['path']!r} is {st.st_size} bytes (cap {limit})")
            length = min(int(h.get("length", limit + 1)), limit + 1 - offset)
            data = os.pread(fh.fileno(), max(length, 0), offset)
            if offset + len(data) > limit:
                raise PathRefused("too_large", f"{h['path']!r} grew past the cap {limit}")
    sup.send({"id": rid, "ev": "done", "size": st.st_size}, data)


def op_write(sup: "Supervisor", rid: int, h: dict[str, Any], body: bytes) -> None:
    """Write a file atomically (temp file + rename). Large files come in stages:
    ``open`` (creates the temp file), ``append``..., then ``commit`` or ``abort``;
    no stage means all at once. Staging keeps our memory small: the workspace is
    a tmpfs charged to the same memory limit as the code."""
    path = h["path"]
    stage = h.get("stage", "")
    parent, name = sup.workspace.resolve(path, follow_last=True, create_dirs=h.get("parents", True))
    try:
        if not name:
            raise PathRefused("type", f"{path!r} is a directory")
        tmp = str(h.get("tmp") or f".{name}.stockade-{os.getpid()}-{rid}"[:255])
        if "/" in tmp or not tmp.startswith("."):
            raise PathRefused("internal", "bad temporary name")
        mode = int(h.get("mode", 0o644)) & 0o777  # never setuid/setgid/sticky
        if stage == "abort":
            try:
                os.unlink(tmp, dir_fd=parent)
            except FileNotFoundError:
                pass
            sup.send({"id": rid, "ev": "done"})
            return
        if stage in ("", "open"):
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise PathRefused("type", f"{path!r} is a directory")
            except FileNotFoundError:
                pass
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, mode, dir_fd=parent)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            _write_all(fd, body)
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=parent)
            raise
        os.close(fd)
        if stage in ("open", "append"):
            sup.send({"id": rid, "ev": "done", "tmp": tmp})
            return
        os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    finally:
        os.close(parent)
    sup.send({"id": rid, "ev": "done", "entry": _entry(_rel(sup, path), st)})


def op_mkdir(sup: "Supervisor", rid: int, h: dict[str, Any], body: bytes) -> None:
    path = h["path"]
    parent, name = sup.workspace.resolve(path, follow_last=True, create_dirs=h.get("parents", True))
    try:
        if name:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    raise PathRefused("type", f"{path!r} exists and is not a directory")
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        else:
            st = os.fstat(parent)
    finally:
        os.close(parent)
    sup.send({"id": rid, "ev": "done", "entry": _entry(_rel(sup, path), st)})


def op_stat(sup: "Supervisor", rid: int, h: dict[str, Any], body: bytes) -> None:
    try:
        parent, name = sup.workspace.resolve(h["path"], follow_last=h.get("follow", True))
    except PathRefused as exc:
        if exc.kind == "missing":
            sup.send({"id": rid, "ev": "done", "entry": None})
            return
        raise
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False) if name else os.fstat(parent)
        entry: Optional[dict[str, Any]] = _entry(_rel(sup, h["path"]), st)
    except FileNotFoundError:
        entry = None
    finally:
        os.close(parent)
    sup.send({"id": rid, "ev": "done", "entry": entry})


def op_list(sup: "Supervisor", rid: int, h: dict[str, Any], body: bytes) -> None:
    path = h["path"]
    depth = int(h.get("depth", 1))
    parent, name = sup.workspace.resolve(path, follow_last=True)
    try:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=parent) if name else os.dup(parent)
        except NotADirectoryError:
            raise PathRefused("type", f"{path!r} is not a directory") from None
    finally:
        os.close(parent)
    base = _rel(sup, path)
    entries: list[dict[str, Any]] = []
    room = [MAX_LIST_JSON]
    _walk(fd, base, depth, entries, room)
    # The entries go in the body: a header is capped at 1 MiB, a few thousand entries. Over
    # MAX_LIST_JSON, refused: 65,521 entries of 4 KB paths made a frame of 268 MB, past what
    # the host takes from the sandbox, which it then ended.
    raw = b"" if room[0] < 0 else dumps(entries[:MAX_LIST]).encode()
    if room[0] < 0 or len(raw) > MAX_LIST_JSON:  # escapes (six bytes) past the walk's count
        more = "list a folder inside it, or to a smaller depth"
        raise PathRefused("listing", f"the listing is over {MAX_LIST_JSON >> 20} MiB of paths; {more}")
    sup.send({"id": rid, "ev": "done", "truncated": len(entries) > MAX_LIST}, raw)


def _walk(fd: int, base: str, depth: int, out: list[dict[str, Any]], room: list[int]) -> None:
    """``room``: the bytes of JSON the listing has left (its entries' paths and names, and
    ``ENTRY_JSON`` each), counted as the walk goes so that it holds no more in memory. One
    descriptor open whatever the depth (``DirWalk``); each level keeps its names to come."""
    walk = DirWalk(fd)
    try:
        levels = [(_names(walk.fd), base, depth)]
        while levels:
            names, prefix, left = levels[-1]
            if not names:
                levels.pop()
                if levels:
                    walk.up()
                continue
            if len(out) > MAX_LIST:
                return
            name = names.pop()
            try:
                st = os.stat(name, dir_fd=walk.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since the folder was read
            rel = f"{prefix}/{name}" if prefix else name
            room[0] -= len(rel) + len(name) + ENTRY_JSON
            if room[0] < 0:
                return
            out.append(_entry(rel, st))
            if left > 1 and stat.S_ISDIR(st.st_mode):
                try:
                    walk.down(name)
                except OSError:
                    continue
                levels.append((_names(walk.fd), rel, left - 1))
    finally:
        walk.close()


def _names(fd: int) -> list[str]:
    """A folder's names, last first (the walk pops them in order)."""
    return sorted(os.listdir(fd), reverse=True)


def op_remove(sup: "Supervisor", rid: int, h: dict[str, Any], body: bytes) -> None:
    path = h["path"]
    parent, name = sup.workspace.resolve(path, follow_last=False)
    try:
        if not name:
            raise PathRefused("type", "refusing to remove the workspace root")
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            if not h.get("recursive", True):
                os.rmdir(name, dir_fd=parent)
            else:
                import shutil  # lazily: most sandboxes never remove a tree

                shutil.rmtree(name, dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)
    finally:
        os.close(parent)
    sup.send({"id": rid, "ev": "done"})


def op_put_archive(sup: "Supervisor", rid: int, h: dict[str, Any], body: bytes) -> None:
    """Unpack a tar archive that comes a chunk at a time, in stages (see unpack.py)."""
    import unpack  # lazily: most sandboxes never take an archive

    sup.send({"id": rid, "ev": "done", **unpack.handle(_area(sup, h), h, body)})


def op_get_archive(sup: "Supervisor", rid: int, h: dict[str, Any], body: bytes) -> None:
    """A folder as a tar stream the host pulls a chunk at a time (``stage``: ``open``,
    then ``next`` until ``eof``, or ``close``); see archive.py."""
    import archive  # lazily: it imports tarfile, which costs more than starting the supervisor

    reply, data = archive.handle(_area(sup, h), h)
    sup.send({"id": rid, "ev": "done", **reply}, data)


def _area(sup: "Supervisor", h: dict[str, Any]) -> Workspace:
    """Where an archive is taken or put: the workspace, or /tmp (a snapshot's files)."""
    return Workspace("/tmp", links=sup.workspace.links) if h.get("root") == "tmp" else sup.workspace


def _rel(sup: "Supervisor", path: str) -> str:
    parts = sup.workspace._split(path)
    return "/".join(parts)


# The handlers by op name, for the supervisor's dispatch.
OPS = {
    "read": op_read,
    "write": op_write,
    "mkdir": op_mkdir,
    "stat": op_stat,
    "list": op_list,
    "remove": op_remove,
    "put_archive": op_put_archive,
    "get_archive": op_get_archive,
}
