"""Read a file a person configures stockade with: a policy, a tenants file, scripted turns, a key.

Each is read whole, so each is read with a bound: only a regular file (a symlink to one is
fine), opened without blocking and checked after it is open (``fstat`` of what was opened,
not of what the name led to a moment before), and no more than ``MAX_CONFIG_BYTES`` of it.
A path to ``/dev/zero`` grew memory until ``MemoryError``; a FIFO hung the command forever.
"""

from __future__ import annotations

import os
import stat

from stockade.exceptions import ConfigurationError, InvalidArgument

__all__ = ["MAX_CONFIG_BYTES", "audit_key", "read_config_bytes", "read_config_text", "read_key_file"]

MAX_CONFIG_BYTES = 16 << 20  # far above any real policy or tenants file, far below a host's memory

_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def read_config_bytes(
    path: str | os.PathLike[str], *, what: str, max_bytes: int = MAX_CONFIG_BYTES, fix: str = ""
) -> bytes:
    """The bytes of the regular file at ``path``; ``what`` names it in errors ("the policy
    file"). ``InvalidArgument`` for anything but a regular file, or one over ``max_bytes``;
    ``ConfigurationError`` for a file that cannot be read (missing, no permission). Given a
    ``fix`` (what a command's argument takes instead), every error is an ``InvalidArgument``
    of ``what`` that says it."""
    shown = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO waits for a writer otherwise; fstat refuses it just after
        fd = os.open(shown, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as error:
        raise _refused(f"cannot read {what} {shown!r}: {error.strerror}", what, fix) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise InvalidArgument(
                f"{what} {shown!r} is {kind}", argument=what, fix=fix or "give the path of a regular file"
            )
        if info.st_size > max_bytes:
            raise _too_big(what, shown, max_bytes, fix)
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:  # st_size may be stale (a file still growing): count what comes
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise _too_big(what, shown, max_bytes, fix)
        return b"".join(chunks)
    except OSError as error:
        raise _refused(f"cannot read {what} {shown!r}: {error.strerror}", what, fix) from None
    finally:
        os.close(fd)


def read_config_text(
    path: str | os.PathLike[str], *, what: str, max_bytes: int = MAX_CONFIG_BYTES, fix: str = ""
) -> str:
    """``read_config_bytes`` as UTF-8 text; bytes that are no UTF-8 are a ``ConfigurationError``
    naming the first one (with a ``fix``, an ``InvalidArgument`` that says it)."""
    data = read_config_bytes(path, what=what, max_bytes=max_bytes, fix=fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        said = f"{what} {os.fspath(path)!r}: byte {error.start} is not UTF-8 (it must be UTF-8 text)"
        raise _refused(said, what, fix) from None


def _refused(message: str, what: str, fix: str) -> ConfigurationError:
    return InvalidArgument(message, argument=what, fix=fix) if fix else ConfigurationError(message)


def _too_big(what: str, shown: str, max_bytes: int, fix: str) -> InvalidArgument:
    return InvalidArgument(
        f"{what} {shown!r} is over {max_bytes >> 20} MiB, more than any {what.removeprefix('the ')} needs",
        argument=what,
        fix=fix or "give the path of the file meant",
    )


def audit_key(key_file: str | os.PathLike[str] | None = None) -> bytes | None:
    """The audit chain's HMAC key: what ``key_file`` holds (``read_key_file``), else the bytes of
    ``STOCKADE_AUDIT_KEY``, else None. The variable's bytes as the OS holds them: a key is bytes,
    not text (one that is no UTF-8 made `.encode()` raise)."""
    if key_file is not None:
        return read_key_file(key_file)
    value = os.environ.get("STOCKADE_AUDIT_KEY")
    return os.fsencode(value) if value else None


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The audit key a key file holds: its bytes, less one line ending at the end (``\\n`` or
    ``\\r\\n``, what ``echo`` and editors add). Nothing else is taken off: a key is bytes, and
    a random one may begin or end with a space or a tab (stripping all whitespace made about
    one random 32-byte key in 20 another key, and a genuine trail failed to verify). Give the
    SDK (``AuditLog(key=)``) a key file's key read by this too. ``InvalidArgument`` for a file
    that holds no key: taken as none, a keyed trail was checked as if unkeyed."""
    data = read_config_bytes(path, what="the key file", max_bytes=1 << 20)
    key = data[:-2] if data.endswith(b"\r\n") else data.removesuffix(b"\n")
    if not key:
        raise InvalidArgument(
            f"the key file {os.fspath(path)!r} holds no key",
            argument="the key file",
            fix="write the key in it",
        )
    return key
