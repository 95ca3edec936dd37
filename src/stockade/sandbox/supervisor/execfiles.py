"""What the file an exec runs is: the name it has, its content, and the programs the rules
name that it is a copy of.

A copy of a program goes by that program's name: found by content, or outside the image by
ELF build ID (``ExecFiles``, the base of the judge's verdicts, ``execverdicts``, which weigh
those names against the rules). What is read of a file is kept by its stamp once settled
(``stamp``, ``settled``), and read without waiting on a lease the code holds (``read_head``).
Standard library only.
"""

from __future__ import annotations

import os

import execruns
from execrules import build_id

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Sequence, Set, Tuple


class ExecFiles:
    """What the judge reads of the files execs run (their names, digests, build IDs), kept
    by each file's stamp."""

    def __init__(self, sizes: "Dict[int, List[str]]", masked: "Sequence[Sequence[Any]]") -> None:
        # A masked program can be read by no one here, so what it is comes from the host: a
        # copy of one (from the seed, an upload, the network) is that program.
        self._masked: "Dict[int, Dict[str, Set[str]]]" = {}  # size -> sha256 -> names
        self._masked_builds: "Dict[bytes, Set[str]]" = {}
        self._masked_names: "Set[str]" = set()
        for names, size, digest, build in masked:
            if int(size) > 0:  # an empty file is a copy of nothing
                self._masked.setdefault(int(size), {}).setdefault(str(digest), set()).update(names)
            if build:
                self._masked_builds.setdefault(bytes.fromhex(build), set()).update(names)
            self._masked_names.update(names)
        self._names: "Dict[Tuple[int, int, int], str]" = {}  # file -> the name it has
        # What is kept of a file's content is kept by its stamp (stamp: its ctime among
        # them, which every change moves and no process can set back), and only once settled.
        self._identity: "Dict[Tuple[int, ...], str]" = {}  # stamp -> digest
        self._sizes = sizes  # size -> paths of the programs rules name (rulespy.program_sizes)
        self._builds: "Dict[Tuple[int, ...], Optional[bytes]]" = {}  # stamp -> ELF build ID
        self._program_builds: "Optional[Dict[bytes, Set[str]]]" = None  # build ID -> rule programs

    def _read(self, target: str, st: "os.stat_result", outside: bool) -> "Tuple[bytes, Set[str]]":
        """What the judge reads of the file: its head (a script's first line) and the names of
        the programs the rules name that it is a copy of, by content or, ``outside`` the
        image, by ELF build ID (a copy changed by a byte: padded, patched). ``OSError``
        where it cannot be read, or not as far as it goes."""
        head = read_head(target)
        known = st.st_size in self._sizes or st.st_size in self._masked
        copies = self._copies_of(target, st) if known else set()
        if not copies and (self._sizes or self._masked_builds) and outside:
            copies = self._same_build(target, st)
        return head, copies

    def _real_name(self, target: str, st: "os.stat_result") -> "Optional[str]":
        """The name of the file ``target`` leads to (symlinks followed), cached by the file;
        None where ``target`` led to another file than ``st``'s by then (a link swapped
        between the two looks). Kept by ``st``'s file, the name of another one stayed: a link
        raced between ``ls`` and the ELF loader left ``ls`` judged as the loader for the
        sandbox's life (``ls /`` refused: "/" read as the program it loads)."""
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        name = self._names.get(key)
        if name is None:
            real = os.path.realpath(target)
            try:
                now = os.stat(real)
            except OSError:  # a name no file has (a descriptor's: "memfd:x (deleted)"): not kept
                return os.path.basename(real)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return None
            if len(self._names) > 4096:
                self._names.clear()
            name = self._names[key] = os.path.basename(real)
        return name

    def _digest(self, path: str, st: "os.stat_result") -> str:
        """The SHA-256 of the file ``path`` (``st``: its stat, before it is read), kept by its
        stamp once settled. ``OSError`` where it cannot be read whole."""
        key = stamp(st)
        digest = self._identity.get(key)
        if digest is None:
            import hashlib  # lazily: it loads OpenSSL, and few execs ever need it

            h = hashlib.sha256()
            fd = _open(path)
            try:
                size, done = os.fstat(fd).st_size, 0
                for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
                    h.update(chunk)
                    done += len(chunk)
            finally:
                os.close(fd)
            if done != size:
                raise OSError(EIO, "a short read")
            digest = h.hexdigest()
            if settled(st):
                if len(self._identity) > 4096:
                    self._identity.clear()
                self._identity[key] = digest
        return digest

    def _program_digest(self, path: str) -> "Optional[str]":
        """The digest of a program a rule names; None where it is not there or cannot be read
        (a masked one: the host read it before, ``self._masked``)."""
        try:
            return self._digest(path, os.stat(path))
        except OSError:
            return None

    def _same_build(self, path: str, st: "os.stat_result") -> "Set[str]":
        """Names of the programs the rules name that ``path`` (a file the code can have
        written) was built as: the same ELF build ID, which a copy keeps when bytes are added
        or changed elsewhere. One changed there too is judged by its names only. ``OSError``
        where it cannot be read."""
        key = stamp(st)
        if key in self._builds:
            found = self._builds[key]
        else:
            found = build_id(path)
            if settled(st):
                if len(self._builds) > 4096:
                    self._builds.clear()
                self._builds[key] = found
        if found is None:
            return set()
        if self._program_builds is None:
            self._program_builds = {made: set(names) for made, names in self._masked_builds.items()}
            for paths in self._sizes.values():
                for original in paths:
                    try:
                        made = build_id(original)
                    except OSError:  # masked: the host read it before (self._masked_builds)
                        continue
                    if made is not None:
                        self._program_builds.setdefault(made, set()).add(os.path.basename(original))
        return self._program_builds.get(found, set())

    def _copies_of(self, path: str, st: "os.stat_result") -> "Set[str]":
        """Names of the programs the rules name whose content ``path`` holds. ``OSError``
        where it cannot be read whole."""
        found: "Set[str]" = set()
        mine: "Optional[str]" = None
        for original in self._sizes.get(st.st_size, ()):
            if original == path:
                continue
            theirs = self._program_digest(original)
            if theirs is None:
                continue
            if mine is None:
                mine = self._digest(path, st)
            if theirs == mine:
                found.add(os.path.basename(original))
        masked = self._masked.get(st.st_size)
        if masked:
            mine = mine or self._digest(path, st)
            found |= masked.get(mine, set())
        return found


# What the judge keeps of a file's content it keeps by the file's stamp, once the stamp is
# older than this: a change within the same tick of the clock timestamps are taken from (up
# to 10 ms), or the same second where a filesystem keeps seconds, may leave ctime as it was.
SETTLED_NS = 2_000_000_000


def stamp(st: "os.stat_result") -> "Tuple[int, int, int, int, int]":
    """A file, and its content as it was when ``st`` was taken: device, inode, size, mtime
    and ctime. mtime can be set back (utime); ctime cannot: every write, utime, chmod or
    rename moves it to the clock's time, which code cannot set."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def settled(st: "os.stat_result") -> bool:
    """Whether ``st``'s file last changed long enough ago that any later change moves its
    ctime past the one in ``st`` (SETTLED_NS)."""
    import time  # built in: no file to load

    return time.time_ns() - st.st_ctime_ns > SETTLED_NS


def _open(path: str) -> int:
    """``path`` opened for the judge to read, without waiting: a lease the code holds on it
    makes this fail (EWOULDBLOCK) where a blocking open would stop every exec for up to the
    lease's break time."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)


def read_head(path: str) -> bytes:
    """The first bytes of the file ``path``: what the kernel reads to tell a script (it needs
    only the execute right for that, so a file the judge cannot read may still be one).
    ``OSError`` where it cannot be read, or not as far as the file goes."""
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        head = os.read(fd, execruns.SCRIPT_HEAD)
    finally:
        os.close(fd)
    if len(head) < min(size, execruns.SCRIPT_HEAD):
        raise OSError(EIO, "a short read")
    return head


EIO = 5
