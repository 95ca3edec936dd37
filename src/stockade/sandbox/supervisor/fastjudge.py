"""The compiled exec judge's Python side: loading ``judge.so`` (from ``judge.c``), starting its
thread, stopping it, and taking in the records of the execs it let run.

Where the host shipped the library, a thread of ours in C owns the seccomp listener, answers
at once the execs the rules allow whatever their arguments, and writes their records to a
pipe drained when a job ends (``records``). Everything else it forwards unchanged, on
another pipe, to the Python judge (``execjudge``). Standard library only; ``_ctypes``, never
ctypes (which costs milliseconds to import).
"""

from __future__ import annotations

import os
import struct

import confine
from protocol import MAX_EXEC_ARGV
from rules import EPERM, PROGRAM_DIRS, program_names

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Tuple

LIBRARY = "judge.so"  # beside these modules, when the host built it
F_SETPIPE_SZ = 1031
# The records' pipe keeps its default room (64 KiB: over a thousand records between two
# drains; a full pipe sends the exec to Python, which drains first). Not more: pipe pages
# count against the sandbox user's limit, which every sandbox of the host shares.
# Read a page at a time: a command's few records fit one, and a larger buffer is a fresh
# stretch of the heap written at each job's end (pages a shim's fork made shared: each
# write of one is a fault, several a command with 64 KiB).
RECORDS_READ = 4096
RECORD_HEAD = struct.Struct("=IiiI")  # its length, pid, session, argv words kept


def load() -> "Optional[Tuple[int, int]]":
    """judge.c's two entry points (the judge's thread, the shims' confinement), or None if
    the host shipped no library or it does not load."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY)
    if not os.path.exists(path):
        return None
    try:
        import _ctypes

        library = _ctypes.dlopen(path, os.RTLD_NOW | os.RTLD_LOCAL)
        return _ctypes.dlsym(library, "stockade_judge"), _ctypes.dlsym(library, "stockade_confine")
    except (OSError, AttributeError, ImportError):
        return None


def config(commands: "Dict[str, List[List[str]]]") -> bytes:
    """The rules as judge.c reads them: NUL-ended entries, a letter and its text. The sizes
    of the programs the rules name (``rules.program_sizes``) are found by its thread, from
    the folders and names given (``find_sizes``): beside our start, not in it."""
    entries = [f"M{MAX_EXEC_ARGV}"]
    for kind in ("deny", "approve"):
        entries += [f"P{words[0]}" for words in commands[kind] if words]
    if commands["allow"]:
        entries.append("L")
        entries += [f"A{words[0]}" for words in commands["allow"] if len(words) == 1]
    entries += [f"D{folder}" for folder in PROGRAM_DIRS]
    entries += [f"N{name}" for name in sorted(program_names(commands))]
    return b"".join(e.encode("utf-8", "surrogateescape") + b"\0" for e in entries)


class FastJudge:
    """The running thread, seen from the supervisor: ``forwards`` is what its loop waits on
    (the execs left to Python), ``records`` what the thread let run."""

    def __init__(self, forwards: int, records: int, stop: int) -> None:
        self.forwards = forwards
        self._records = records
        self._stop = stop

    @classmethod
    def start(cls, entry: int, listener: int, rules: bytes) -> "Optional[FastJudge]":
        """Start judge.c on a thread of ours: from then on it owns the listener. None (and
        every exec to Python) for rules it cannot hold."""
        import _ctypes

        if b"\0\0" in rules or rules.count(b"\0") > 1000:
            return None  # an empty program name, or more rules than it holds
        forward_r, forward_w = os.pipe2(os.O_CLOEXEC)
        records_r, records_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)  # a full pipe: to Python
        stop_r, stop_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(forward_r, False)
        import fcntl

        for small in (forward_w, stop_w):  # one page each is room enough (see stop)
            try:
                fcntl.fcntl(small, F_SETPIPE_SZ, 4096)
            except OSError:
                pass
        # A thread of its own making (a raw clone), that never takes the GIL: the call
        # returns once it runs, and it owns the listener from then on.
        if _ctypes.call_function(entry, (listener, forward_w, records_w, stop_r, rules, len(rules))):
            for fd in (forward_r, forward_w, records_r, records_w, stop_r, stop_w):
                os.close(fd)
            return None
        return cls(forward_r, records_r, stop_w)

    def forwarded(self) -> "Optional[Tuple[int, int, int, Tuple[int, ...]]]":
        """The next exec left to Python (as ``confine.receive`` gives it); a notification of
        id 0 says the thread stopped on a broken listener; None: nothing whole to read."""
        try:
            data = os.read(self.forwards, confine.NOTIF.size)
        except BlockingIOError:
            return None
        if len(data) != confine.NOTIF.size:
            return None
        nid, pid, _, nr, _, _, *args = confine.NOTIF.unpack(data)
        return nid, pid, nr, tuple(args)

    def stop(self, listener: int) -> None:
        """Stop the thread (before our own exec at a reset): the listener is ours again.
        Until the thread says it stopped (a notification of id 0), what it forwards is
        refused: a reset has killed every process, and a full pipe would hold the thread."""
        import select

        os.write(self._stop, b"q")
        deadline = 50  # tenths of a second: a thread that does not answer dies with our exec
        stopped = False
        while not stopped and deadline > 0:
            if not select.select([self.forwards], [], [], 0.1)[0]:
                deadline -= 1
                continue
            try:
                data = os.read(self.forwards, confine.NOTIF.size * 51)  # whole notifications
            except BlockingIOError:
                continue
            for at in range(0, len(data) - confine.NOTIF.size + 1, confine.NOTIF.size):
                nid = confine.NOTIF.unpack_from(data, at)[0]
                if nid:
                    confine.answer(listener, nid, False, EPERM)
                else:
                    stopped = True

    def records(self) -> "List[Tuple[int, str, List[str]]]":
        """The execs it let run since the last call: (session, path, argv) each."""
        data = b""
        while True:
            try:
                chunk = os.read(self._records, RECORDS_READ)
            except BlockingIOError:
                break
            data += chunk
            if len(chunk) < RECORDS_READ:
                break  # a pipe's read gives all it holds: it is empty (no second read)
        found = []
        at = 0
        while at + RECORD_HEAD.size <= len(data):
            size, _pid, session, _kept = RECORD_HEAD.unpack_from(data, at)
            if size <= RECORD_HEAD.size:
                break  # never written so by judge.c; stop rather than loop
            words = data[at + RECORD_HEAD.size : at + size].split(b"\0")[:-1]
            at += size
            text = [w.decode("utf-8", "surrogateescape") for w in words]
            found.append((session, text[0], text[1:]))
        return found
