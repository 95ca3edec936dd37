"""Small freestanding C programs and libraries, built once per host: the libraries stockade
ships into sandboxes, the process tier's launcher.

Each is compiled with the host's C compiler into the cache, named after its source and
flags (a changed source is a new file, never a stale one), and written whole or not at all.
Without a compiler, off x86_64 (the system calls are inlined for it), or without a writable
cache there is no library, and its caller takes its slower way (never a weaker one). A cache
another user could change (``_trusted``) is refused: what is in it runs as the caller.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from stockade.sandbox import _trusted

__all__ = ["FREESTANDING", "FREESTANDING_PROGRAM", "build", "built"]

# No C library (system calls inline): one build loads into any image's programs.
FREESTANDING = (
    "-O2", "-shared", "-fPIC", "-nostdlib", "-ffreestanding", "-fno-builtin",
    "-fno-stack-protector", "-fvisibility=hidden", "-Wall", "-Werror",
)  # fmt: skip
# A program of its own (its own _start, no C library, no dynamic loader): -static, not a PIE.
FREESTANDING_PROGRAM = (
    "-O2", "-static", "-no-pie", "-nostdlib", "-ffreestanding", "-fno-builtin",
    "-fno-stack-protector", "-Wall", "-Werror",
)  # fmt: skip


def _target(source: Path, flags: tuple[str, ...], folder: Path) -> Path:
    digest = hashlib.sha256(source.read_bytes() + repr(flags).encode()).hexdigest()[:16]
    suffix = ".so" if "-shared" in flags else ""  # a library, else a program
    return folder / f"{source.stem}-{digest}{suffix}"


def built(source: Path, flags: tuple[str, ...], folder: Path) -> Path | None:
    """The build if it is in ``folder`` (the cache) already; never compiles. UntrustedPath
    if it, or a folder above it, is another user's to change."""
    if platform.machine() != "x86_64":
        return None
    target = _trusted.check(_target(source, flags, folder))
    return target if target.is_file() else None


def build(source: Path, flags: tuple[str, ...], folder: Path) -> Path | None:
    """The library or program, compiled into ``folder`` unless it is there; None without a
    compiler, a writable ``folder``, or off x86_64; UntrustedPath if ``folder`` or the build
    is another user's to change."""
    found = built(source, flags, folder)
    if found is not None or platform.machine() != "x86_64":
        return found
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    try:  # a user without a writable cache (a service account's home) goes without
        folder = _trusted.folder(folder)
        fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".tmp", dir=folder)
    except OSError:
        return None
    os.close(fd)
    try:
        argv = [cc, *flags, "-o", tmp, str(source)]
        done = subprocess.run(argv, capture_output=True, timeout=120, check=False)
        if done.returncode != 0:
            return None
        os.chmod(tmp, 0o644 if "-shared" in flags else 0o755)
        target = _target(source, flags, folder)
        os.replace(tmp, target)  # whole or not at all: another process may be building it too
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        with_tmp = Path(tmp)
        if with_tmp.exists():
            with_tmp.unlink()
    return target
