"""The operations a sandbox instance executes: one value per kind of request.

The facade (``Sandbox``) turns friendly calls into these; backends, wrappers (retry, audit,
policy) and the shipped ``FakeBackend`` all see the same small set of values. Each is an
``Op[R]``, where ``R`` is what the sandbox answers (``RunCommand`` is an ``Op[CommandResult]``),
so that ``instance.execute(op)`` and ``await instance.aexecute(op)`` are typed by the op.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Literal, TypeVar

from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import CommandResult, EntryInfo, Execution, JudgedExecs, Listing, Snapshot

__all__ = [
    "DOWNLOAD_MAX_BYTES",
    "DOWNLOAD_MAX_ENTRIES",
    "LISTING_TRUNCATED_HEADER",
    "Area",
    "GetArchive",
    "HostFolder",
    "ListDir",
    "MakeDir",
    "Op",
    "Pause",
    "PutArchive",
    "ReadFile",
    "Remove",
    "Reset",
    "RunCode",
    "RunCommand",
    "Stat",
    "TakeExecs",
    "TakeSnapshot",
    "WriteFile",
    "as_inline",
    "program_command",
]

R_co = TypeVar("R_co", covariant=True)
# The writable places an archive may be taken from or put into: the workspace (paths are
# relative to it), or /tmp (for snapshots: where HOME is, so packages installed --user).
Area = Literal["workspace", "tmp"]


class Op(Generic[R_co]):
    """A request a sandbox answers with an ``R_co``. Code that handles any op takes ``Op[Any]``."""

    __slots__ = ()


@dataclass(frozen=True, kw_only=True)
class RunCommand(Op[CommandResult]):
    argv: tuple[str, ...]
    cwd: str | None = None
    envs: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    stdin: bytes | None = None


# A shell that reads its whole program from standard input first, then runs it with standard
# input at /dev/null: what `sh -c PROGRAM` does, without the program being an argument.
_SHELL_READS_STDIN = 'c=$(cat) && exec </dev/null && eval "$c"'

# run_code's languages other than Python run as fresh processes whose program comes on standard
# input, never as an argument: the kernel caps one argument at 128 KiB (and all of them at a few
# MiB). language -> (the argv reading the program from stdin, the inline argv it amounts to).
# Each of these reads its whole program before running it, so the program's own reads of
# standard input see its end, as they would under `-c`.
PROGRAM_ON_STDIN: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "bash": (("bash", "-c", _SHELL_READS_STDIN), ("bash", "-c")),
    "sh": (("sh", "-c", _SHELL_READS_STDIN), ("sh", "-c")),
    "python3": (("python3", "-"), ("python3", "-c")),
    "node": (("node", "-"), ("node", "-e")),
    "ruby": (("ruby", "-"), ("ruby", "-e")),
    "perl": (("perl", "-"), ("perl", "-e")),
    "php": (("php", "-r", "eval(stream_get_contents(STDIN));"), ("php", "-r")),
    "r": (("Rscript", "-e", "source(file('stdin'))"), ("Rscript", "-e")),
}
_INLINE = {reading: inline for reading, inline in PROGRAM_ON_STDIN.values()}


def program_command(language: str, code: str, timeout_s: float | None = None) -> RunCommand:
    """The command running ``code`` in ``language`` (a key of ``PROGRAM_ON_STDIN``)."""
    reading, _ = PROGRAM_ON_STDIN[language]
    return RunCommand(argv=reading, stdin=code.encode(), timeout_s=timeout_s)


def as_inline(op: RunCommand) -> tuple[str, ...]:
    """The argv ``op`` amounts to: a program read from standard input by one of the
    ``PROGRAM_ON_STDIN`` forms is put back inline (``bash -c PROGRAM``), so that policy rules,
    approvals and the audit trail judge and show the program, not the reader."""
    inline = _INLINE.get(tuple(op.argv)) if op.stdin is not None else None
    if inline is None or op.stdin is None:
        return tuple(op.argv)
    return (*inline, op.stdin.decode("utf-8", "replace"))


@dataclass(frozen=True, kw_only=True)
class RunCode(Op[Execution]):
    """Run Python in the sandbox's persistent interpreter."""

    code: str
    timeout_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class ReadFile(Op[bytes]):
    """The file's bytes from ``offset``: ``length`` of them at most (None: to its end). A
    whole file (no ``length``) over ``max_bytes`` is refused; a range is at most ``max_bytes``
    of a file of any size, from anywhere in it (a sparse file of a TiB costs code nothing, and
    refusing its every range left the run's diff, which hashes large files a range at a time,
    unavailable as a whole: found from outside)."""

    path: str
    max_bytes: int = 256 * 1024 * 1024
    offset: int = 0
    length: int | None = None


@dataclass(frozen=True, kw_only=True)
class WriteFile(Op[EntryInfo]):
    path: str
    data: bytes
    mode: int = 0o644
    parents: bool = True


@dataclass(frozen=True, kw_only=True)
class MakeDir(Op[EntryInfo]):
    path: str
    parents: bool = True


@dataclass(frozen=True, kw_only=True)
class Stat(Op[EntryInfo | None]):
    path: str
    follow_symlinks: bool = True


@dataclass(frozen=True, kw_only=True)
class ListDir(Op[Listing]):
    path: str = ""
    depth: int = 1


# The service's answer to a listing is its entries (a JSON array); this header, "true", says the
# listing was cut at its cap (``Listing.truncated``).
LISTING_TRUNCATED_HEADER = "Stockade-Listing-Truncated"


@dataclass(frozen=True, kw_only=True)
class Remove(Op[None]):
    path: str
    recursive: bool = True


@dataclass(frozen=True, kw_only=True)
class HostFolder:
    """A folder of the host to copy in: what ``read`` names (workspace globs), but what
    ``hide`` names. Its tar is made as it is sent (``chunks``), never held whole."""

    source: Path
    hide: tuple[str, ...] = ()
    read: tuple[str, ...] = ("**",)

    def chunks(self, size: int = 4 * 1024 * 1024) -> Iterator[bytes]:
        """The folder as a tar stream, in pieces of ``size`` bytes; each call walks it anew."""
        from stockade.sandbox._requests import tar_chunks  # lazily: it imports the tiers' code

        return tar_chunks(self.source, self.hide, self.read, size)

    def names(self) -> list[str]:
        """The names its tar holds (what ``chunks`` sends), folders before what they hold."""
        from stockade.sandbox._requests import upload_entries  # lazily, as chunks

        kept, _ = upload_entries(self.source, self.hide, self.read)
        return [name for _, name, _ in kept]


@dataclass(frozen=True, kw_only=True)
class PutArchive(Op[None]):
    """Extract a tar archive into ``path`` (a directory of the workspace, or of /tmp): ``data``,
    one held in memory, or ``folder``, a host folder made into a tar as it is sent (what
    ``files.upload_dir`` sends). Either way the sandbox gets it a chunk at a time and moves
    what it unpacked into place only once the whole archive was unpacked."""

    data: bytes = b""
    folder: HostFolder | None = None
    path: str = ""
    area: Area = "workspace"

    def names(self) -> list[str] | None:
        """The names the archive holds, relative to ``path``; None for ``data`` that is no tar
        the host can read (the sandbox refuses it too)."""
        if self.folder is not None:
            return self.folder.names()
        try:
            with tarfile.open(fileobj=io.BytesIO(self.data), mode="r:*") as tar:
                return tar.getnames()
        except (tarfile.TarError, EOFError, OSError):
            return None


# What one download may bring to the host unless the caller says otherwise.
DOWNLOAD_MAX_BYTES = 1024 * 1024 * 1024
DOWNLOAD_MAX_ENTRIES = 100_000


@dataclass(frozen=True, kw_only=True)
class GetArchive(Op[bytes]):
    """A tar archive of ``path`` (the whole workspace by default), made as it is sent.

    With a sink, ``execute(op, sink)`` streams it: each piece arrives as ``sink(0, chunk)``
    (at most 4 MiB), the result is ``b""``, and an exception raised by the sink stops the
    transfer. Without one, the whole archive is the result, and at most ``max_bytes`` long.
    ``max_bytes`` caps the files' contents (apparent sizes, a hard-linked file once) and
    ``max_entries`` the number of entries: the sandbox refuses a tree over either.
    """

    path: str = ""
    max_bytes: int = DOWNLOAD_MAX_BYTES
    max_entries: int = DOWNLOAD_MAX_ENTRIES
    area: Area = "workspace"
    # A folder more than 128 deep: left out and reported (a download), or ``TreeTooDeep``.
    refuse_deep: bool = False


@dataclass(frozen=True, kw_only=True)
class TakeExecs(Op[JudgedExecs]):
    """The execs the sandbox judged while no call ran (what a call left running, after it
    returned) that no call's result listed yet: each is handed over once, here or first in
    the next call's ``execs``. The audit layer takes them before a reset and at close. A
    sandbox that judges no execs answers none."""


@dataclass(frozen=True, kw_only=True)
class Reset(Op[None]):
    """Kill every process, forget interpreter state, empty the workspace and ``/tmp``.

    ``warm_interpreter`` starts a fresh interpreter right away, so that the next
    ``run_code`` does not pay for its start (what pools want).
    """

    warm_interpreter: bool = False


@dataclass(frozen=True, kw_only=True)
class TakeSnapshot(Op[Snapshot]):
    """Save the sandbox into ``store`` and let it go on; the snapshot is kept until deleted.

    ``memory``: ``None`` keeps the memory of every process where the tier can, the files
    elsewhere; ``True`` requires it (``LimitNotEnforceable`` where the tier cannot);
    ``False`` keeps the files only. Calls running meanwhile are waited for.
    """

    store: SnapshotStore
    memory: bool | None = None


@dataclass(frozen=True, kw_only=True)
class Pause(Op[Snapshot]):
    """Save the sandbox as ``TakeSnapshot`` does, then stop it: it is kept under its id until
    ``Sandbox.resume(id)`` (in any process of this host) brings it back."""

    store: SnapshotStore
    memory: bool | None = None
