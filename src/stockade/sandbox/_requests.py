"""What the facades share: friendly calls turned into ``ops`` values, and results shaped.

``Sandbox`` and ``AsyncSandbox`` (and their ``commands`` and ``files``) build their requests
here, so that the twins differ only in ``await``.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import itertools
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from stockade import exceptions as exc
from stockade._checks import (
    check_data,
    check_envs,
    check_host_folder,
    check_number,
    check_strings,
    check_text,
    check_timeout,
)
from stockade.sandbox._archive_members import MAX_DEPTH as ARCHIVE_DEPTH
from stockade.sandbox._supervised_config import WORKSPACE
from stockade.sandbox._transfers import TRANSFER_CHUNK
from stockade.sandbox.base import OutputSink
from stockade.sandbox.ops import (
    HostFolder,
    ListDir,
    PutArchive,
    ReadFile,
    RunCode,
    RunCommand,
    WriteFile,
    program_command,
)

if TYPE_CHECKING:
    import tarfile
from stockade.types import CommandResult, Execution, ExecutionError, Logs

__all__ = [
    "INTERPRETERS",
    "MAX_DEPTH",
    "MAX_OFFSET",
    "TextCallback",
    "as_execution",
    "check_format",
    "check_path",
    "code_op",
    "command_op",
    "list_op",
    "open_entry",
    "range_op",
    "tar_chunks",
    "tar_directory",
    "text_sink",
    "unreadable",
    "upload_op",
    "write_op",
]

TextCallback = Callable[[str], object]

# run_code's language names -> the keys of ops.PROGRAM_ON_STDIN ("python" is the persistent
# interpreter; "python3" a fresh process).
INTERPRETERS: dict[str, str] = {
    "bash": "bash",
    "sh": "sh",
    "python3": "python3",
    "node": "node",
    "javascript": "node",
    "ruby": "ruby",
    "perl": "perl",
    "php": "php",
    "r": "r",
}


def file_text(data: bytes, path: str, cap: int = ReadFile.max_bytes) -> str:
    """A file's bytes as text (UTF-8, undecodable bytes replaced), refused where the text
    would take more than ``cap`` bytes: Python holds a string at the width of its widest
    character, so one character past U+FFFF in 256 MiB of ASCII makes 1 GiB of text. The
    width is known before decoding, from the bytes that lead UTF-8 sequences (a byte it
    cannot decode becomes U+FFFD, two bytes wide)."""
    if len(data) * 4 > cap:
        width = 4 if re.search(rb"[\xf0-\xff]", data) else 1
        if width == 1 and re.search(rb"[\x80-\xc1\xc4-\xef]", data):
            width = 2  # past U+00FF, or a byte it cannot decode
        if len(data) * width > cap:
            raise exc.FileTooLarge(
                f"{path!r} as text would take {len(data) * width} bytes ({width} a character: the widest "
                f"character sets the width of all), over the {cap} allowed; read it with format='bytes'",
                path=path,
            )
    return data.decode("utf-8", "replace")


# The most a file read may start at or take: a file offset is a signed 64-bit number.
MAX_OFFSET = 2**63 - 1
# The deepest listing: a path holds at most 4096 bytes, so no folder is deeper than that.
MAX_DEPTH = 4096


def range_op(path: object, offset: object, length: object) -> ReadFile:
    """The read of ``length`` bytes of ``path`` from ``offset``, refused when it names no range."""
    for argument, value in (("offset", offset), ("length", length)):
        check_number(value, argument=argument, integer=True, low=0, high=MAX_OFFSET, unit="bytes")
    assert isinstance(offset, int) and isinstance(length, int)
    return ReadFile(path=check_path(path), offset=offset, length=length)


def write_op(path: object, data: object, mode: object) -> WriteFile:
    """The write of ``data`` (text as UTF-8, or bytes) to ``path`` with permission bits ``mode``."""
    check_number(mode, argument="mode", integer=True, low=0, high=0o777)
    assert isinstance(mode, int)
    return WriteFile(path=check_path(path), data=check_data(data, argument="data"), mode=mode)


def list_op(path: object, depth: object) -> ListDir:
    check_number(depth, argument="depth", integer=True, low=1, high=MAX_DEPTH, unit="levels")
    assert isinstance(depth, int)
    return ListDir(path=check_path(path), depth=depth)


def check_format(value: object) -> bool:
    """Whether ``read`` answers bytes (``format="bytes"``) rather than text (``"text"``)."""
    if value not in ("text", "bytes") or not isinstance(value, str):
        raise exc.InvalidArgument(
            f"format is {value!r}", argument="format", fix="give 'text' (decoded as UTF-8) or 'bytes'"
        )
    return value == "bytes"


# The longest path sent on (Linux's PATH_MAX), in bytes of UTF-8: a longer one names nothing.
# A path of a million characters went to the sandbox, whole into the audit trail (twice, the
# error repeating it) and came back as WorkspaceFull.
PATH_MAX = 4096


def check_path(path: object, *, argument: str = "path") -> str:
    """Refuse, before anything reaches the sandbox, paths that cannot be in the workspace."""
    if not isinstance(path, str):
        raise exc.InvalidArgument(
            f"{argument} must be a str, got {type(path).__name__}",
            argument=argument,
            fix="give a workspace path as text, relative to it or under /workspace",
        )
    if (size := len(path.encode("utf-8", "surrogatepass"))) > PATH_MAX:
        raise exc.InvalidArgument(
            f"{argument} {path[:60]!r}... is {size} bytes long (as UTF-8), past the {PATH_MAX} a path"
            " may hold (PATH_MAX)",
            argument=argument,
            fix=f"give a workspace path of at most {PATH_MAX} bytes",
        )
    if "\x00" in path:
        raise exc.PathEscapeError(f"{path!r} contains a NUL byte", path=path)
    check_text(path, argument=argument)
    if path.startswith("/") and not (path == WORKSPACE or path.startswith(WORKSPACE + "/")):
        raise exc.PathEscapeError(f"{path!r} is outside the workspace ({WORKSPACE})", path=path)
    relative = path[len(WORKSPACE) :] if path.startswith(WORKSPACE) else path
    depth = 0
    for part in relative.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                raise exc.PathEscapeError(f"{path!r} leads outside the workspace", path=path)
        elif part not in ("", "."):
            depth += 1
    return path


def command_op(
    cmd: object, cwd: object, envs: Mapping[str, str] | None, timeout_s: object, stdin: object
) -> RunCommand:
    """A shell string, or an argv list (of str, not empty) run without a shell."""
    if isinstance(cmd, str):
        argv: tuple[str, ...] = ("/bin/sh", "-c", check_text(cmd, argument="cmd"))
    else:
        argv = check_strings(cmd, argument="cmd", empty=False)
    fix = "give the folder inside the sandbox as a str, or leave it out"
    folder = None if cwd is None else check_text(cwd, argument="cwd", fix=fix)
    data = None if stdin is None else check_data(stdin, argument="stdin")
    return RunCommand(
        argv=argv, cwd=folder, envs=check_envs(envs), timeout_s=check_timeout(timeout_s), stdin=data
    )


def text_sink(on_stdout: TextCallback | None, on_stderr: TextCallback | None) -> OutputSink | None:
    """Adapt byte chunks to text callbacks; a UTF-8 character split across chunks survives."""
    check_callbacks(on_stdout, on_stderr)
    if on_stdout is None and on_stderr is None:
        return None
    callbacks = {1: on_stdout, 2: on_stderr}
    decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in (1, 2)}

    def sink(fd: int, data: bytes) -> None:
        callback = callbacks.get(fd)
        if callback is not None:
            text = decoders[fd].decode(data)
            if text:
                callback(text)

    return sink


def check_callbacks(on_stdout: object, on_stderr: object) -> None:
    for argument, given in (("on_stdout", on_stdout), ("on_stderr", on_stderr)):
        if given is not None and not callable(given):
            raise exc.InvalidArgument(
                f"{argument} must be callable, got {type(given).__name__}",
                argument=argument,
                fix="give a function of one str (print, list.append), or leave it out",
            )


def as_execution(result: CommandResult) -> Execution:
    """A fresh-process run_code (bash, node, ...) reported like a Python one."""
    error = None
    if result.timed_out:
        error = ExecutionError(name="TimeoutError", value="the code ran past its timeout", traceback="")
    elif result.exit_code != 0:
        error = ExecutionError(
            name="NonZeroExit", value=f"exit code {result.exit_code}", traceback=result.stderr
        )
    return Execution(
        logs=Logs(stdout=result.stdout, stderr=result.stderr),
        error=error,
        duration_s=result.duration_s,
        timed_out=result.timed_out,
        truncated=result.truncated,
    )


def code_op(code: str, language: str, timeout_s: float | None) -> RunCode | RunCommand:
    check_text(code, argument="code", nul=True, fix="give the source as text")
    timeout_s = check_timeout(timeout_s)
    lang = language.lower() if isinstance(language, str) else ""
    if lang in ("python", "py"):
        return RunCode(code=code, timeout_s=timeout_s)
    key = INTERPRETERS.get(lang)
    if key is None:
        raise exc.InvalidArgument(
            f"unknown language {language!r}",
            argument="language",
            fix=f"use python or one of {', '.join(sorted(INTERPRETERS))}",
        )
    # on standard input, never as an argument: the kernel caps one argument at 128 KiB
    return program_command(key, code, timeout_s)


def upload_op(source: object, dest: object, hide: object, read: object) -> PutArchive:
    """The upload of a host folder: its tar is made as it is sent (``tar_chunks``), never whole.
    ``hide`` and ``read`` are taken normalised (``_globs.workspace_glob``), as the walk matches them."""
    from stockade._globs import workspace_globs

    folder = check_host_folder(source, argument="source")
    hide = workspace_globs(check_strings(hide, argument="hide"), setting="hide")
    read = workspace_globs(check_strings(read, argument="read"), setting="read")
    return PutArchive(
        path=check_path(dest, argument="dest"), folder=HostFolder(source=folder, hide=hide, read=read)
    )


def tar_directory(source: Path, hide: Sequence[str] = (), read: Sequence[str] = ("**",)) -> bytes:
    """``source`` as a tar archive, whole in memory (the service's client sends it so); see
    ``tar_chunks``, which ``files.upload_dir`` streams instead."""
    return b"".join(tar_chunks(source, hide, read))


def tar_chunks(
    source: Path, hide: Sequence[str] = (), read: Sequence[str] = ("**",), size: int = TRANSFER_CHUNK
) -> Iterator[bytes]:
    """``source`` as a tar stream, made as it is consumed, in chunks of ``size`` bytes (the
    last shorter): what ``read`` names (workspace globs), but what ``hide`` names (a folder
    left out is left out with what it holds). Memory stays about two chunks whatever the
    tree holds: the archive of a 560 MiB folder built whole took 1.2 GB and was sent as one
    frame that the sandbox's supervisor died of.

    When anything is hidden, what holds it under another name stays out too: a hard link to
    a hidden file (the same file), and every repository store (git's by its shape, whatever
    its name: a bare mirror, a ``--separate-git-dir``; other systems' by their folders'
    names), whose history holds every file it ever had. A file that shrinks while it is
    read is a ``WorkspaceError`` (the archive already promised its size).

    stockade's own records are never sent, whatever ``hide`` says: ``.stockade`` folders but
    the run's own bookkeeping in them (``stockade._state``)."""
    import tarfile

    if not source.is_dir():
        raise exc.ConfigurationError(f"workspace {str(source)!r} is not a directory")
    kept, hidden_files = upload_entries(source, hide, read)
    # gettarinfo only: it names a file's further names as hard links to its first
    tar = tarfile.TarFile(fileobj=io.BytesIO(), mode="w")
    buf = bytearray()
    total = 0  # bytes of the archive so far: its end pads it to whole records
    for path, name, st in kept:
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) in hidden_files:
            continue  # another name of a hidden file
        described = _described(tar, path, name, st)
        if described is None:
            continue
        info, data = described
        header = info.tobuf(tar.format, tar.encoding, tar.errors)
        buf += header
        total += len(header)
        # a header that filled the chunk is sent first: a read of the 0 bytes left of it was
        # taken for a file that shrank (a folder of 6,000 small files failed to upload)
        yield from _full_chunks(buf, size)
        if data is not None and info.isreg():
            with data:
                left = info.size
                while left:
                    # what completes the buffer's chunk; whole chunks straight from the file
                    try:
                        piece = data.read(min(left, size - len(buf)))
                    except OSError as error:
                        raise unreadable(path, error) from None
                    if not piece:
                        raise exc.ConfigurationError(f"{str(path)!r} shrank while it was uploaded")
                    left -= len(piece)
                    if not buf and len(piece) == size:
                        yield piece
                        continue
                    buf += piece
                    yield from _full_chunks(buf, size)
            pad = -info.size % tarfile.BLOCKSIZE
            buf += bytes(pad)
            total += info.size + pad
        elif data is not None:
            data.close()  # replaced by a folder or a FIFO since the walk: sent as what it is now
        yield from _full_chunks(buf, size)
    # the end, as tarfile's close writes it: two zero blocks, then zeros to a whole record
    end = 2 * tarfile.BLOCKSIZE
    buf += bytes(end + -(total + end) % tarfile.RECORDSIZE)
    yield from _full_chunks(buf, size)
    if buf:
        yield bytes(buf)


def open_entry(path: Path) -> BinaryIO:
    """A file the walk found, opened without following a link (one put in its place since)
    nor waiting on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    return open(fd, "rb", buffering=0)  # closed by the caller


def _full_chunks(buf: bytearray, size: int) -> Iterator[bytes]:
    """Take ``size``-byte chunks off the front of ``buf`` while it holds one."""
    while len(buf) >= size:
        with memoryview(buf) as view:
            chunk = bytes(view[:size])
        del buf[:size]
        yield chunk


def upload_entries(
    source: Path, hide: Sequence[str], read: Sequence[str]
) -> tuple[list[tuple[Path, str, os.stat_result]], set[tuple[int, int]]]:
    """The entries of ``source`` to send (path, name in the archive, lstat), folders before
    what they hold, and the hidden files that have other names (a regular file among the
    entries whose (st_dev, st_ino) is there is a hidden file under another name: left out).
    A run's kept seed (``stockade.runs.seeds``) is chosen by the same function, so that it
    never holds what the sandbox was not given.

    A kept entry more than ``ARCHIVE_DEPTH`` folders deep is ``TreeTooDeep``: what no
    archive of the workspace takes (a download leaves it out, a snapshot refuses it). What
    is removed while the walk reads its folder is left out; a folder it cannot read is a
    ``ConfigurationError``. The walk keeps a stack, not recursion (a tree 1,100 deep made a
    RecursionError), and the hidden folders it walks for other names have no depth limit."""
    from stockade._globs import covers, glob_matches, may_hold
    from stockade._state import STATE_DIR, is_state

    everything = "**" in (g.strip("/") for g in read)
    kept: list[tuple[Path, str, os.stat_result]] = []
    hidden_files: set[tuple[int, int]] = set()
    # per folder being walked: its children still to see, their names' prefix, whether it
    # is left out (walked only for the other names of its files)
    stack: list[tuple[Iterator[Path], str, bool]] = [(iter(_listing(source)), "", False)]
    while stack:
        children, prefix, hidden = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            continue
        name = f"{prefix}{child.name}"
        try:
            st = child.lstat()
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed since its folder was listed
        except OSError as error:
            raise unreadable(child, error) from None
        is_dir = stat.S_ISDIR(st.st_mode)
        gone = (
            hidden
            or is_state(name)
            or (is_dir and child.name == STATE_DIR and not _carries(child))
            or (bool(hide) and (covers(hide, name) or (is_dir and _repository(child))))
        )
        if gone:
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                hidden_files.add((st.st_dev, st.st_ino))
            elif is_dir:
                stack.append((iter(_listing(child)), f"{name}/", True))
        elif everything or glob_matches(read, name) or (is_dir and may_hold(read, name)):
            if name.count("/") >= ARCHIVE_DEPTH:
                top = "/".join(name.split("/")[:ARCHIVE_DEPTH])
                raise exc.TreeTooDeep(
                    f"{str(source)!r} holds {top[:200]!r}..., {ARCHIVE_DEPTH} folders deep: what is "
                    "in it is past what an archive of the workspace takes",
                    path=name,
                )
            kept.append((child, name, st))
            if is_dir:
                stack.append((iter(_listing(child)), f"{name}/", False))
    return kept, hidden_files


def _listing(folder: Path) -> list[Path]:
    """``folder``'s children, sorted; none when it was removed (or replaced) meanwhile."""
    try:
        return sorted(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as error:
        raise unreadable(folder, error) from None


def unreadable(path: Path, error: OSError) -> exc.ConfigurationError:
    """What a host entry the upload walk cannot read (but one gone meanwhile) is."""
    return exc.ConfigurationError(f"cannot read {str(path)!r} to upload it: {error.strerror or error}")


def _carries(folder: Path) -> bool:
    """Whether a ``.stockade`` folder holds any of what a copy carries of it (else it is left
    out whole: not even its name enters)."""
    from stockade._state import CARRIED

    return any(os.path.lexists(folder / name) for name in CARRIED)


# Folders of version-control systems other than git, by name: their stores hold past files.
VCS_FOLDERS = frozenset({".hg", ".svn", ".bzr", "_darcs", ".jj", "CVS", ".fossil-settings"})


def _described(
    tar: tarfile.TarFile, path: Path, name: str, st: os.stat_result
) -> tuple[tarfile.TarInfo, BinaryIO | None] | None:
    """The header of ``path`` and, for a file, its open descriptor; None for what an upload
    leaves out: an entry removed since the walk saw it, a socket, a FIFO, a device (none is
    workspace content, as a run's seed leaves them out; a device node made every unpacking
    in the sandbox fail, "put_archive '': Operation not permitted")."""
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        return None
    try:
        # a file is opened first, and described by its descriptor: what is read is what the
        # header says, even if its name goes meanwhile
        data = open_entry(path) if stat.S_ISREG(st.st_mode) else None
        info = tar.gettarinfo(path, arcname=name, fileobj=data)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        raise unreadable(path, error) from None
    if info is None or not (info.isreg() or info.islnk() or info.isdir() or info.issym()):
        if data is not None:  # it became a socket, a FIFO or a device since the walk
            data.close()
        return None
    return info, data


def _repository(folder: Path) -> bool:
    """Whether ``folder`` is a repository's store: git's (named ``.git``; or by its shape,
    whatever the folder is called, an object store in it or itself one, ``HEAD`` and
    ``refs`` or not: a copied ``objects/`` alone holds every past file), or another
    system's folder (by name)."""
    if folder.name in VCS_FOLDERS or folder.name == ".git":
        return True
    return _object_store(folder / "objects") or _object_store(folder)


_LOOSE_OBJECT = re.compile(r"[0-9a-f]{2}")


def _object_store(folder: Path) -> bool:
    """Whether ``folder`` looks like git's ``objects/``: ``pack/`` holding packs or indexes,
    ``info/`` beside ``pack/`` (what ``git init`` makes), or a loose object's folder (two hex
    digits) among its first entries."""
    pack = folder / "pack"
    if pack.is_dir():
        if (folder / "info").is_dir():
            return True
        with contextlib.suppress(OSError), os.scandir(pack) as entries:
            if any(e.name.endswith((".pack", ".idx")) for e in itertools.islice(entries, 64)):
                return True
    if folder.name != "objects":
        return False  # listing every folder for loose objects would cost each walk a read
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        return any(_LOOSE_OBJECT.fullmatch(e.name) and e.is_dir() for e in itertools.islice(entries, 300))
    return False
