"""The compiled judge (``judge.c``) seen from the supervisor: the rules as it reads them,
its thread, and its records taken onto the jobs.

``RulesFastJudge`` is the layer of ``rules.Rules`` that starts the thread (after the
supervisor said it is ready), takes in the records of the execs it let run, and takes the
listener back when the thread gave it up; ``judge_config`` writes the rules as the thread
reads them (``c_entries`` its set-up's too), ``FastJudge`` is the running thread. Apart from
``rules``, which sets up what the kernel holds and confines the shims; a start under rules
imports both (``rules`` builds on this layer). Standard library only.
"""

from __future__ import annotations

import os
import struct

from execrecords import ALLOWED_RECORDS, ALLOWED_REPORT, fits
from protocol import MAX_EXEC_ARGV

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

# Where the programs a rule names are looked for, to know their copies by their content.
PROGRAM_DIRS = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")
# The files of the programs that run another one their arguments name (execruns.carried:
# the dynamic loader, multi-call binaries), so that a copy of one is known by its content as
# a rule's program is.
CARRIER_FILES = (
    "busybox", "toybox", "/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1",
    "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", "/lib/ld-musl-x86_64.so.1", "/lib/ld-musl-aarch64.so.1",
)  # fmt: skip

F_SETPIPE_SZ = 1031
# The records' pipe keeps its default room (64 KiB: over a thousand records between two
# drains; a full pipe sends the exec to Python, which drains first). Not more: pipe pages
# count against the sandbox user's limit, which every sandbox of the host shares.
# Read a page at a time: a command's few records fit one, and a larger buffer is a fresh
# stretch of the heap written at each job's end (pages a shim's fork made shared: each
# write of one is a fault, several a command with 64 KiB).
RECORDS_READ = 4096
RECORD_HEAD = struct.Struct("=IiiI")  # its length, pid, session, argv words kept
RECORD_FILE = 0x80000000  # in the words kept: the file that ran follows them (judge.c's)


class RulesFastJudge:
    """The part of ``rules.Rules`` that runs judge.c's thread: its attributes are set by
    ``Rules.__init__``."""

    def start(self) -> None:
        """Start the compiled judge's thread: after the supervisor said it is ready (off the
        create's path), before it reads any request. The rule is in force from __init__ on:
        an exec before this waits in the kernel until someone answers."""
        if self.notify and self._entry and self.fast is None:
            self.fast = FastJudge.start(
                self._entry, self.listener, judge_config(self.commands, self.masked, self.listed)
            )
            if self.fast is not None:
                self.events = self.fast.forwards

    def _fast_gone(self) -> None:
        """judge.c gave the listener up (it broke under it): judge everything here."""
        forwards = self.events
        self.fast = None
        self.events = self.listener
        try:
            self.sup.sel.unregister(forwards)
            self.sup.sel.register(self.listener, 1, ("exec", None))  # 1: EVENT_READ
        except (KeyError, ValueError, OSError):
            pass

    def drain(self, ending: "Any" = None) -> None:
        """Take in the records of the execs judge.c let run, onto their jobs. ``ending``: the
        job that just ended (its shim is no longer ours to look up)."""
        fast = self.fast
        if fast is None:
            return
        # Each object made or touched here is a page the supervisor writes at every command
        # (a shim's fork shares them all, so each first write is a copy): one loop, one
        # decode per record, no list of them in between.
        data = fast.read_records()
        at, end, head = 0, len(data), RECORD_HEAD.size
        while at + head <= end:
            size, _pid, session, kept = RECORD_HEAD.unpack_from(data, at)
            if size <= head:
                break  # never written so by judge.c; stop rather than loop
            words = data[at + head : at + size - 1].decode("utf-8", "surrogateescape").split("\0")
            at += size
            job = self._job_led_by(session, ending)
            if job is None:
                job = self.between  # what a call left running, run after it returned
            # Its words need no cut (``kept_argv``): judge.c's records are under 4 KiB whole.
            job.exec_count += 1
            if len(job.execs) < ALLOWED_RECORDS:
                done = {"path": words[0], "argv": words[1:], "verdict": "allow", "rule": ""}
                if kept & RECORD_FILE:  # the file that ran, where the path led to another
                    done["file"] = done["argv"].pop()
                if fits(job, done, ALLOWED_REPORT):
                    job.execs.append(done)

    def _job_led_by(self, session: int, ending: "Any") -> "Any":
        """The job whose shim leads ``session`` (judge.c let only such sessions' execs by)."""
        sup = self.sup
        job = sup._job_led_by(session)
        if job is not None:
            return job
        for running in sup.commands.values():
            if running.shim == session:
                return running
        if ending is not None and getattr(ending, "shim", session) == session:
            return ending  # a command's ended job, or the interpreter's (its shim is the only one)
        return None


def _programs(words: "List[str]") -> "Tuple[str, ...]":
    """The program a rule's first word names, the one it is matched as (``git-push`` is
    ``git push``: ``execrules.pattern``), and the programs that are its commands under their
    own name (``npx`` is ``npm exec``: ``execnpm.SHORTHANDS``)."""
    import execnpm  # type: ignore[import-not-found]  # judge_config loads it at every start under rules
    import execrules  # type: ignore[import-not-found]

    name = execrules.pattern(words)[0]
    shorthands = (short for short, (of, _) in execnpm.SHORTHANDS.items() if of == name)
    return tuple(dict.fromkeys((words[0], name, *shorthands)))


def _over_argv(words: "List[str]") -> bool:
    """A rule that judges arguments (``rm -r``, and ``git-push``: ``git push``)."""
    import execrules  # type: ignore[import-not-found]

    return len(execrules.pattern(words)) > 1


def program_names(commands: "Dict[str, List[List[str]]]") -> "Set[str]":
    """The programs whose copies are judged by what they are here: those of the rules over
    argv and approvals, looked for by their size; with them, the files of the programs that
    carry another (``CARRIERS``). A program denied whatever its arguments is masked, and
    its copies known by what the host read of it (``Rules.masked``)."""
    judged = [words for words in commands["approve"] if words]
    judged += [words for words in commands["deny"] if words and _over_argv(words)]
    names = {name for words in judged for name in _programs(words)}
    return names | set(CARRIER_FILES) if names else names


def judge_config(
    commands: "Dict[str, List[List[str]]]",
    masked: "Sequence[Sequence[Any]]" = (),
    listed: "Optional[Dict[str, List[str]]]" = None,
) -> bytes:
    """The rules as judge.c reads them: NUL-ended entries, a letter and its text. The sizes
    of the programs the rules name (``rulespy.program_sizes``) are found by its thread, from
    the folders and names given (``find_sizes``): beside our start, not in it. Those of the
    programs the tier masks (``masked``: what the host read of them) are given: a file of
    such a size, and any file outside the image (its build ID), goes to Python. Under an
    allowlist, the files of the programs ``listed`` by names a rule of one word allows each of
    (``Rules.listed``): the only ones judge.c lets run (by their identity, found by its
    thread as the sizes are); any other exec goes to Python."""
    entries = [f"M{MAX_EXEC_ARGV}"]
    entries += sorted({f"S{int(entry[1])}" for entry in masked if int(entry[1]) > 0})
    for kind in ("deny", "approve"):
        entries += [f"P{name}" for words in commands[kind] if words for name in _programs(words)]
    # What carries a program goes to Python, which judges it as the program it carries: under
    # rules over argv, and under an allowlist (which the loader is on, so that what is listed
    # runs: a link named as a listed program that leads to it would run any file). Under
    # denials alone the masks hold it (no denied file to load), judged alike all the same.
    from execruns import IMAGE_FOLDERS, INTERPRETERS, LOADERS, MULTICALL  # type: ignore[import-not-found]

    entries += [f"P{name}" for name in (*LOADERS, *(f"{name}*" for name in MULTICALL))]
    entries += [f"T{name}" for name in INTERPRETERS] + [f"G{folder}" for folder in IMAGE_FOLDERS]
    if commands["allow"]:
        entries.append("L")
        from execrules import allows  # type: ignore[import-not-found]

        # A file runs as any name it is listed by (argv[0] picks it: execrules.run_as), so
        # only one a rule of one word allows by each of them (not /usr/lib/git-core/git,
        # listed as git-status too, under `git status`) is let run whatever its arguments.
        alone = [words for words in commands["allow"] if words and not _over_argv(words)]
        entries += [
            f"F{path}"
            for path, names in sorted((listed or {}).items())
            if all(any(allows(words, [name]) for words in alone) for name in names)
        ]
    entries += [f"D{folder}" for folder in PROGRAM_DIRS]
    entries += [f"N{name}" for name in sorted(program_names(commands))]
    return c_entries(entries)


def c_entries(entries: "List[str]") -> bytes:
    """Entries as judge.c reads them (its set-up's and its thread's): each NUL-ended, any
    byte of a path kept (surrogateescape)."""
    return b"".join(e.encode("utf-8", "surrogateescape") + b"\0" for e in entries)


class FastJudge:
    """The running thread, seen from the supervisor: ``forwards`` is what its loop waits on
    (the execs left to Python), ``records`` what the thread let run."""

    def __init__(self, forwards: int, records: int, stop: int, tid: int = 0) -> None:
        self.forwards = forwards
        self._records = records
        self._stop = stop
        # Its thread's id: a thread that never forks, whose children the look for strays
        # need not read (``proctree.own_children``: a /proc file opened a command).
        self.tid = tid

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
        tid = _ctypes.call_function(entry, (listener, forward_w, records_w, stop_r, rules, len(rules)))
        if tid <= 0:
            for fd in (forward_r, forward_w, records_r, records_w, stop_r, stop_w):
                os.close(fd)
            return None
        return cls(forward_r, records_r, stop_w, tid)

    def read_records(self) -> bytes:
        """The records of the execs it let run since the last call, as judge.c wrote them
        (``Rules.drain`` reads them): each a RECORD_HEAD, then the path and the argv kept,
        each NUL-ended."""
        try:
            data = os.read(self._records, RECORDS_READ)
        except BlockingIOError:
            return b""
        if len(data) < RECORDS_READ:
            return data  # a pipe's read gives all it holds: it is empty (no second read)
        chunks = [data]
        while True:
            try:
                chunk = os.read(self._records, RECORDS_READ)
            except BlockingIOError:
                break
            chunks.append(chunk)
            if len(chunk) < RECORDS_READ:
                break
        return b"".join(chunks)
