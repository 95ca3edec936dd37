"""Paths stockade runs, loads or mounts from: what it built into its cache (the launcher it
execs as root, the libraries it loads into sandboxes and QEMU, the microVM's images) and its
state folder (the supervisor every container runs first, the initramfs).

Whoever can change one of these, or any folder on the way to it, runs code as the caller:
another user who owns a shared ``STOCKADE_CACHE``, or who made ``/tmp/stockade-<uid>``
before we did, could swap a file, or rename a folder and put their own in its place. So each
is used only once it and every folder from ``/`` down to it are the caller's or root's,
writable by no group and no one else (a world-writable folder only with the sticky bit, as
``/tmp``: there only an entry's owner can rename it), and no symlink. Such a chain stays
ours: no one else can change it afterwards, so a path checked once may be used by name.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from pathlib import Path

from stockade import exceptions as exc

__all__ = ["check", "folder", "owner_name"]


def owner_name(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    return f"uid {uid}"


def _refuse(at: str, st: os.stat_result, euid: int) -> None:
    fix = ""
    if stat.S_ISLNK(st.st_mode):
        what = "is a symlink that changed while it was checked"
        fix = "point the setting at the folder itself"
    elif st.st_uid not in (euid, 0):
        what = f"is owned by {owner_name(st.st_uid)}, not by {owner_name(euid)} or root"
        fix = "use a folder of your own (STOCKADE_CACHE, XDG_RUNTIME_DIR, state_dir), or remove it"
    elif st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        what = f"is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):o})"
        fix = f"chmod go-w {at}"
    else:
        return
    raise exc.UntrustedPath(
        f"stockade will not use {at}: it {what}, so another user could put their own code there",
        path=at,
        fix=fix,
    )


def check(path: Path) -> Path:
    """``path`` with its symlinks resolved, once it and every folder above it are trusted
    (see the module); a part not there yet is not checked. Use the path returned: the
    symlinks on the way to ``path`` may be another user's to change."""
    real = os.path.realpath(path)
    euid = os.geteuid()
    at = "/"
    for part in ["", *real.split("/")[1:]]:
        at = os.path.join(at, part)
        try:
            st = os.lstat(at)
        except (FileNotFoundError, NotADirectoryError):  # to be made (or never can be)
            break
        _refuse(at, st, euid)
    return Path(real)


def folder(path: Path, mode: int = 0o755) -> Path:
    """``path`` (symlinks resolved), trusted, made if it is missing: each folder made ``mode``,
    whatever the umask adds (a folder made by ``mkdir -p`` under umask 002 is
    group-writable). OSError if it cannot be made."""
    real = check(path)
    missing: list[Path] = []
    at = real
    while not os.path.lexists(at):
        missing.append(at)
        at = at.parent
    for new in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(new, mode)
    return check(real) if missing else real
