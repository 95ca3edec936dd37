"""The rules' paths off a start under judge.c (``rules.py``): the set-up in Python where
the compiled library does not ship or ``STOCKADE_EXEC_JUDGE=python`` asks for it, the
allowlist's files, the Python judge's program sizes, and what a reset or a broken listener
does. Apart from ``rules`` because a start imports that module whole: these were two fifths
of its bytecode. Standard library only.
"""

from __future__ import annotations

import os
import struct

from fastjudge import PROGRAM_DIRS, program_names
from rules import EPERM

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple


def setup_python(rules: "Any", needs_landlock: bool) -> None:
    """The rules' set-up where judge.c is not loaded: through confine's calls."""
    import confine

    rules.landlock = confine.landlock_abi() if needs_landlock else 0
    rules.notify = any(rules.commands.values()) and confine.notify_available()
    if rules.notify and rules.listener < 0:
        # On ourselves: every process of the sandbox descends from us and inherits it;
        # we exec only at a reset, and answer that exec ourselves (let_own_exec_through).
        rules.listener = confine.install_exec_listener(no_memfd=rules.executable is not None)
        confine.wake_on_this_cpu(rules.listener)
    make_written_folders(rules)
    if rules.landlock:
        build_ruleset(rules)
    # What each shim calls, prepared here once: a fork then finds it ready.
    from libc import PR_SET_DUMPABLE, prctl

    prctl(PR_SET_DUMPABLE, 0)
    if rules._confine_c is None and (rules.landlock or rules.notify):
        confine.warm()  # the call prototypes the shims' confinement in Python needs


def make_written_folders(rules: "Any") -> None:
    for path in rules.folders():
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            pass


def build_ruleset(rules: "Any") -> None:
    import confine

    if rules._ruleset >= 0:
        os.close(rules._ruleset)
        rules.rebuilt = True
    writable = rules._writable()
    rules._ruleset = confine.ruleset(rules.landlock, writable, rules.executable, rules.root)
    rules._inodes = {}
    for path in writable or ():
        try:
            # The path's own inode, not a link's target: a written folder the seed replaced by
            # a link is replaced (and gets no rule), a link that is not replaced stays so.
            st = os.lstat(path)
        except OSError:
            continue
        rules._inodes[path] = (st.st_dev, st.st_ino)
    rules._inode_blob = b"".join(
        struct.pack("=QQ", dev, ino) + path.encode("utf-8", "surrogateescape") + b"\0"
        for path, (dev, ino) in rules._inodes.items()
    )
    rules._set_confine_args()


def current_ruleset(rules: "Any") -> int:
    """The ruleset, rebuilt if a written folder was replaced (a rule holds its inode)."""
    if rules._inode_blob is None:  # judge.c built it, and found one replaced: rebuilt here
        build_ruleset(rules)
        return rules._ruleset
    for path, inode in rules._inodes.items():
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) != inode:
            build_ruleset(rules)
            break
    return rules._ruleset


def let_own_exec_through(rules: "Any", listener: int) -> None:
    """Answer the judge's question about our own exec (a reset's): the exec waits in the
    kernel, holding our one thread (and the GIL), until someone does. A forked helper
    does, then ends; any other exec waiting is refused (every other process is dead)."""
    rules.stop_fast()  # else its thread could take our exec's notification
    me = os.getpid()
    if os.fork() != 0:
        return
    try:
        import select

        import confine

        while True:
            select.select([listener], [], [], 30)
            got = confine.receive(listener)
            if got is None:
                continue
            nid, pid, _, _ = got
            confine.answer(listener, nid, pid == me, EPERM)
            if pid == me:
                break
    finally:
        os._exit(0)


def program_sizes(commands: "Dict[str, List[List[str]]]") -> "Dict[int, List[str]]":
    """The sizes of the programs the rules name, and their paths: a file of another size is
    no copy of one (neither judge hashes it). judge.c's find_sizes finds the same, but for
    the interpreters' files (``execruns.INTERPRETER_FILES``), which Python alone looks for:
    judge.c sends every file outside the image here under such rules, and a copy of one can
    only be there; a size of theirs in judge.c would send the image's own shells too."""
    from execruns import INTERPRETER_FILES

    names = program_names(commands)
    names = names | set(INTERPRETER_FILES) if names else names
    sizes: "Dict[int, List[str]]" = {}
    for folder in PROGRAM_DIRS:
        for name in names:
            if any(c in name for c in "*?["):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            same = sizes.setdefault(st.st_size, [])
            if path not in same:  # an absolute name: the same path from every folder
                same.append(path)
    return sizes


def allowlist(allow: "List[List[str]]") -> "Tuple[Dict[str, List[str]], List[str]]":
    """What an allowlist lets run, as files (``execrules.allowlisted``): the files of the
    programs it names, each with the names it is listed by (the exec judge allows an exec by
    what its file is), and what Landlock lets execute besides for them (their scripts'
    interpreters, the ELF loader). Landlock then lets nothing else be executed, from any
    path, a copy or a file the code wrote itself included."""
    from execrules import allowlisted, pattern

    return allowlisted({pattern(words)[0] for words in allow if words}, "", os.path.realpath)


def forwarded(fast: "Any") -> "Optional[Tuple[int, int, int, Tuple[int, ...]]]":
    """The next exec left to Python (as ``confine.receive`` gives it); a notification of
    id 0 says the thread stopped on a broken listener; None: nothing whole to read."""
    import confine  # only for what reaches Python: not part of the start

    try:
        data = os.read(fast.forwards, confine.NOTIF.size)
    except BlockingIOError:
        return None
    if len(data) != confine.NOTIF.size:
        return None
    nid, pid, _, nr, _, _, *args = confine.NOTIF.unpack(data)
    return nid, pid, nr, tuple(args)


def stop(fast: "Any", listener: int) -> None:
    """Stop the thread (before our own exec at a reset): the listener is ours again.
    Until the thread says it stopped (a notification of id 0), what it forwards is
    refused: a reset has killed every process, and a full pipe would hold the thread."""
    import select

    import confine

    os.write(fast._stop, b"q")
    deadline = 50  # tenths of a second: a thread that does not answer dies with our exec
    stopped = False
    while not stopped and deadline > 0:
        if not select.select([fast.forwards], [], [], 0.1)[0]:
            deadline -= 1
            continue
        try:
            data = os.read(fast.forwards, confine.NOTIF.size * 51)  # whole notifications
        except BlockingIOError:
            continue
        for at in range(0, len(data) - confine.NOTIF.size + 1, confine.NOTIF.size):
            nid = confine.NOTIF.unpack_from(data, at)[0]
            if nid:
                confine.answer(listener, nid, False, EPERM)
            else:
                stopped = True
