"""Which programs of an image the rules mask: those denied (``program_masks``: by name,
anywhere, and their other names and copies), those an allowlist leaves out of the view
(``view_masks``), and what the exec judge inside is told of them (``masked_identities``).

Apart from the plan (``_rules``) because it reads the image, not the rules: each walk of its
trees is made once per image and state (``image_stamp``), whatever the policy.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import re
import stat
from pathlib import Path
from typing import Any

from stockade.sandbox.supervisor import execrules, execruns

# Where programs live in an image; their copies under other names are found by content.
PROGRAM_DIRS = ("usr/local/bin", "usr/bin", "bin", "usr/sbin", "sbin", "usr/libexec", "usr/lib/git-core")
# Where a denied program's other files are looked for: the whole image, not its program folders
# only (klibc's own uname, in /usr/lib/klibc/bin, was copied and ran under `deny uname`); the
# trees every tier shows (the process tier binds these of the host, and no /opt).
IMAGE_TREES = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Changed by the package manager at every install and removal: part of an image's stamp.
PACKAGE_STATE = ("var/lib/dpkg/info", "var/lib/rpm", "lib/apk/db")
MULTI_CALL = execruns.MULTICALL  # one binary, many programs: denied with any of them


def image_stamp(root: Path) -> tuple[int, ...]:
    """The state of the image at ``root`` (``programs_stamp``), the key of what is read of it."""
    return programs_stamp(root)


def programs_stamp(root: Path | None) -> tuple[int, ...]:
    """When each program folder of ``root``, and its package manager's state, last changed
    (0: none there)."""
    if root is None:
        return ()
    stamps = []
    for folder in (*PROGRAM_DIRS, *PACKAGE_STATE):
        try:
            stamps.append(os.stat(root / folder).st_mtime_ns)
        except OSError:
            stamps.append(0)
    return tuple(stamps)


@functools.lru_cache(maxsize=64)
def view_masks(
    root: str, globs: tuple[str, ...], runs: tuple[str, ...], stamp: tuple[int, ...] = ()
) -> tuple[str, ...]:
    """Under an allowlist of ``globs``, every ELF program of the image at ``root`` that may not
    run: not listed, no interpreter a listed script names, no loader, no shared library
    (``*.so``, ``*.so.*``), none of the tier's own (``runs``). The exec judge reads a path the
    caller can change after the answer (a link swapped, a relative path under another
    thread's chdir), and Landlock must let the loader run: a raced exec of the loader ran
    any program of the image it was handed. Masked, those have nothing to map: neither a
    raced exec nor the loader run by hand can start one (files the code wrote are on
    ``noexec`` mounts). Once per image, allowlist and state (``stamp``: the cache's key)."""
    image = Path(root)
    kept = allowed_programs(image, globs, runs)
    inodes = set()
    for inside in kept:
        try:
            st = os.stat(image / inside.lstrip("/"))
        except OSError:
            continue
        inodes.add((st.st_dev, st.st_ino))
    return tuple(
        sorted(
            inside
            for inside, st in elf_programs(image, stamp)
            if inside not in kept and (st.st_dev, st.st_ino) not in inodes
        )
    )


def allowed_programs(root: Path, globs: tuple[str, ...], runs: tuple[str, ...] = ()) -> set[str]:
    """The files (inside paths, links resolved in the image) an allowlist of ``globs`` lets
    run, as the supervisor finds them (``execrules.allowlisted``, one list for the view,
    Landlock and the exec judge): the programs named so in the program folders and their
    helper folders, what they need (their scripts' interpreters, the loaders); and ``runs``."""
    listed, needed = execrules.allowlisted(
        globs, str(root).rstrip("/"), lambda path: resolve_inside(root, path)
    )
    files = {*listed, *needed}
    for folder in execrules.ALLOW_FOLDERS:
        for name in runs:
            if not name.startswith("/") and (root / folder.lstrip("/") / name).exists():
                files.add(resolve_inside(root, f"{folder}/{name}"))
    files.update(resolve_inside(root, path) for path in runs if path.startswith("/"))
    return files


def resolve_inside(root: Path, path: str) -> str:
    """``path`` as the sandbox resolves it (every link followed, absolute ones from ``root``):
    the image's links point inside the image, never at the host's files."""
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        if here.is_symlink() and hops < 40:
            hops += 1
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        done.append(part)
    return "/" + "/".join(done)


@functools.lru_cache(maxsize=8)
def elf_programs(root: Path, stamp: tuple[int, ...] = ()) -> tuple[tuple[str, os.stat_result], ...]:
    """The executable ELF files of the image (``image_programs``) that are no shared library
    by their name (``*.so``, ``*.so.*``: the loader maps them for every program): (path
    inside, stat). A script needs an interpreter, which an allowlist judges as a program."""
    found = []
    for name, inside, st in image_programs(root, stamp):
        if name.endswith(".so") or ".so." in name:
            continue
        try:
            with open(root / inside.lstrip("/"), "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
        except OSError:
            continue
        found.append((inside, st))
    return tuple(found)


def program_masks(root: Path | None, names: list[str], stamp: tuple[int, ...] = ()) -> list[str]:
    """Paths (inside the sandbox) to mask so that the programs ``names`` (globs) cannot run:
    every executable file of the image named so, wherever it is (``named_anywhere``), every
    other name in the program folders of the same file or of a copy of it, and a multi-call
    binary (busybox: its applets cannot be told apart from the file). Without an image to
    look in, the usual places of each name. ``stamp``: the image's state (the cache's key)."""
    if root is None or not root.is_dir():
        return sorted({f"/{d}/{n}" for d in PROGRAM_DIRS for n in names if not any(c in n for c in "*?[")})
    files: list[tuple[str, os.stat_result, str]] = []  # inside path, its file's stat, host path
    for folder in PROGRAM_DIRS:
        base = root / folder
        if base.is_symlink() or not base.is_dir():
            continue  # /bin -> usr/bin: the same files
        for entry in os.scandir(base):
            try:
                # a link leads to a file that is masked, or to none; a folder named as a
                # program (/usr/libexec/dpkg) is none, and no file can be bound over it
                if not entry.is_file(follow_symlinks=False):
                    continue
                files.append((f"/{folder}/{entry.name}", entry.stat(), entry.path))
            except OSError:
                continue
    wanted = [*names, *MULTI_CALL]
    targets = {inside: st for inside, st, _ in files if _named(inside.rsplit("/", 1)[1], wanted)}
    targets.update(named_anywhere(root, tuple(wanted), stamp))
    same_file = {(st.st_dev, st.st_ino) for st in targets.values()}
    sizes = {st.st_size for st in targets.values()}
    digests: set[str] | None = None
    for inside, st, host in files:
        if inside in targets or not (st.st_mode & 0o111):
            continue
        if (st.st_dev, st.st_ino) in same_file:
            targets[inside] = st  # a hard link: another name of the same file
        elif st.st_size in sizes:
            if digests is None:
                digests = {d for i in targets if (d := _digest(root / i.lstrip("/"))) is not None}
            if _digest(Path(host)) in digests:
                targets[inside] = st  # a copy under another name
    return sorted(targets)


def _named(name: str, globs: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, glob) for glob in globs)


def named_anywhere(
    root: Path, globs: tuple[str, ...], stamp: tuple[int, ...] = ()
) -> dict[str, os.stat_result]:
    """The executable files of the image at ``root`` named as one of ``globs``, in any of its
    folders (``IMAGE_TREES``, links not followed): klibc's own uname, in /usr/lib/klibc/bin,
    was another file than /usr/bin/uname, and its copy ran under `deny uname`."""
    exact = {glob for glob in globs if not any(c in glob for c in "*?[")}
    pattern = re.compile("|".join(fnmatch.translate(glob) for glob in globs if glob not in exact) or "(?!)")
    return {
        inside: st for name, inside, st in image_programs(root, stamp) if name in exact or pattern.match(name)
    }


@functools.lru_cache(maxsize=8)
def image_programs(root: Path, stamp: tuple[int, ...] = ()) -> tuple[tuple[str, str, os.stat_result], ...]:
    """Every executable regular file of the image at ``root`` (``IMAGE_TREES``, links not
    followed): (name, path inside, stat), once per image and ``stamp`` (its state,
    ``programs_stamp``): a host's /usr of 150,000 files in ~0.6 s, once a process, rather
    than a walk for each policy (~0.3 s each; the properties draw many)."""
    found: list[tuple[str, str, os.stat_result]] = []
    todo = [(root / top, f"/{top}") for top in IMAGE_TREES]
    while todo:
        folder, inside = todo.pop()
        try:
            if folder.is_symlink():
                continue  # /bin -> usr/bin: the same files
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    todo.append((Path(entry.path), f"{inside}/{entry.name}"))
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
                found.append((entry.name, f"{inside}/{entry.name}", st))
    return tuple(found)


def _digest(path: Path) -> str | None:
    try:
        h = hashlib.sha256()
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def masked_identities(root: str, masks: tuple[str, ...], stamp: tuple[int, ...] = ()) -> list[list[Any]]:
    """What the programs ``masks`` are in the image at ``root``, for the exec judge inside:
    ``[names, size, sha256, ELF build ID in hex or ""]``, one entry per content (the names
    it has among the masked). Inside, no one can read a masked program, so a byte-for-byte
    copy of one the code brought in (from the seed, an upload, the network: `curl` as
    `fetch`) had nothing to be compared with and ran, and one with bytes appended too.
    Once per image, masks and state of its program folders (``stamp``: the cache's key);
    the plan that holds it is shared, so nobody may change it."""
    by_content: dict[str, list[Any]] = {}
    for inside in masks:
        path = Path(root) / inside.lstrip("/")
        try:
            st = path.stat()
            digest = _digest(path)
            build = execrules.build_id(str(path))
        except OSError:
            continue
        if digest is None or not stat.S_ISREG(st.st_mode):
            continue
        entry = by_content.setdefault(digest, [[], st.st_size, digest, build.hex() if build else ""])
        name = inside.rsplit("/", 1)[1]
        if name not in entry[0]:
            entry[0].append(name)
    return list(by_content.values())
