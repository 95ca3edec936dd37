"""The sandbox's rules, inside: what the supervisor sets up from the policy the host sent.

Every shim confines the code it starts (``confine``): writes only where the rules allow
(Landlock), and every exec stopped in the kernel until it is judged (seccomp user
notification, installed here on the supervisor itself: every process of the sandbox
descends from it and inherits the filter).

Where the host shipped the compiled judge (``judge.so``, from ``judge.c``), it does the
set-up in one call (``stockade_setup``), and a thread of ours in C answers at once the execs
the rules allow whatever their arguments (``FastJudge``, below); the rest, and every exec
where it does not run, go to the Python judge (``execjudge``), loaded at the first exec that
reaches it, so that a start pays for neither its imports nor its indexes. Without the
library the set-up goes through ``confine``'s calls (``rulespy``, with every other path a
start under judge.c does not take: a start imports this module whole). Standard library only.
"""

from __future__ import annotations

import _signal as signal
import os
import struct

from protocol import (
    MAX_EXEC_ARGV,
    MAX_EXEC_RECORD_ARGV,
    MAX_EXEC_RECORDS,
    MAX_EXEC_REPORT,
    MAX_EXEC_WORD,
    dumps,
    text_size,
)
from reaper import IGNORED_SIGNALS, code_files_word

# Of a report's records (and of their bytes), the room the execs the rules let run may take:
# the rest is kept for those they stopped or asked about, so that a loop of 1,000 `true`
# cannot push an `rm -r` out of the report (the count of every exec goes with it: ``exec_count``).
ALLOWED_RECORDS = MAX_EXEC_RECORDS - 100
ALLOWED_REPORT = MAX_EXEC_REPORT - (128 << 10)

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

    from execjudge import ExecJudge

# What stays writable whatever the rules say: the scratch places and the devices.
ALWAYS_WRITABLE = ("/tmp", "/dev", "/proc")
# Where the programs a rule names are looked for, to know their copies by their content.
PROGRAM_DIRS = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")
# The files of the programs that run another one their arguments name (execruns.carried:
# the dynamic loader, multi-call binaries), so that a copy of one is known by its content as
# a rule's program is.
CARRIER_FILES = (
    "busybox", "toybox", "/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1",
    "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", "/lib/ld-musl-x86_64.so.1", "/lib/ld-musl-aarch64.so.1",
)  # fmt: skip
EPERM, ENOENT, E2BIG, ENOSYS, ESTALE = 1, 2, 7, 38, 116
LIBRARY = "judge.so"  # judge.c, beside these modules, when the host built it
# The signals a command's shim gets back at their default: those the supervisor ignores,
# and SIGCHLD (bit N-1: signal N, all below 32; the handlers it catches go back to default
# at the exec).
_DEFAULTS = sum(1 << (int(sig) - 1) for sig in (signal.SIGCHLD, *IGNORED_SIGNALS))


class Between:
    """The execs judged while no call of theirs ran: started by what an earlier call left
    running (a thread of the interpreter, a child), which no job leads. Kept as a job's are
    (``record``: the same bounds, the rest counted) until the host takes them: with the next
    call's report (``Rules.expire``) or by asking (``op_execs``, before a reset and at close).
    Dropped uncounted, they were judged and recorded nowhere (found from outside: a thread's
    ``cp -r`` after its call returned)."""

    def __init__(self) -> None:
        self.execs: "List[Dict[str, Any]]" = []
        self.exec_count = 0
        self.exec_json = self.exec_chars = 0  # of the records kept (fits)
        self.exec_width = 1

    def report(self) -> "Dict[str, Any]":
        return {"execs": self.execs, "exec_count": self.exec_count} if self.exec_count else {}


class Rules:
    def __init__(
        self, sup: "Any", cfg: "Dict[str, Any]", listener: int = -1, key: int = -1, asked: int = 0
    ) -> None:
        """``listener``, ``key`` and ``asked``: what a reset carried over (the listener, a
        pipe holding the exec key of its filter, which is closed here, and how many
        approvals the supervisors before us asked for)."""
        self.sup = sup
        commands = cfg.get("commands") or {}
        self.commands = {
            kind: [list(map(str, words)) for words in commands.get(kind, [])]
            for kind in ("deny", "approve", "allow")
        }
        self.write = cfg.get("write")  # None: the whole workspace is writable
        # What the host read of the programs the tier masks (``_rules_programs.masked_identities``): no
        # one here can read them, and a copy of one brought in is judged as it (execjudge).
        self.masked = [
            entry for entry in cfg.get("masked") or () if isinstance(entry, list) and len(entry) == 4
        ]
        # Beneath it a written path gets no rule where it is, or is reached through, a
        # symbolic link (confine.open_written): code and the seed can make links there.
        self.root: str = sup.workspace.root
        self.approver = bool(cfg.get("approver"))
        allow = self.commands["allow"]
        # Under an allowlist, the files of the programs it names -> the names they are listed
        # by (what the exec judge allows by), and what Landlock lets execute (those, and what
        # they need); None: no allowlist.
        self.listed: "Dict[str, List[str]]" = {}
        self.executable: "Optional[List[str]]" = None
        if allow:
            self.listed, needed = _more().allowlist(allow)
            self.executable = sorted({*self.listed, *needed})
        needs_landlock = self.write is not None or self.executable is not None
        self._ruleset = -1  # built once (below), applied by every shim
        self._inodes: "Dict[str, Tuple[int, int]]" = {}
        self._inode_blob: "Optional[bytes]" = b""  # the same, as stockade_confine reads them
        self._confine_args: "Tuple[Tuple[Any, ...], Tuple[Any, ...]]" = ((), ())  # _set_confine_args
        self._confine_c: "Any" = None  # judge.c's confinement, where the host shipped judge.so
        self._spawn_c = 0  # judge.c's start of a command's compiled shim (stockade_spawn)
        self._key_pipe = 0  # judge.c's stockade_key_pipe
        self._forget_c = 0  # judge.c's stockade_forget_setup
        self._entry = 0  # judge.c's thread, started by start()
        self.listener = listener
        self._judge: "Optional[ExecJudge]" = None  # the Python judge, once an exec reaches it
        self._requests = asked  # approvals asked by the Python judges before this one (renew)
        self.fast: "Optional[FastJudge]" = None
        self.between = Between()  # the execs judged while no call of theirs ran
        self.rebuilt = False  # the ruleset built again here since the start (build_ruleset)
        wanted = needs_landlock or any(self.commands.values())
        setup = self._load_compiled() if wanted and cfg.get("judge") != "python" else 0
        try:
            if not (setup and self._setup_compiled(setup, needs_landlock, key)):
                _more().setup_python(self, needs_landlock)
        finally:
            if key >= 0:
                os.close(key)  # before any fork: no process of the code ever holds it
        # The folders the rules made (a written glob's), as they are now: the ruleset holds
        # their inodes, so a reset empties them and keeps them (dev, inode).
        self.made: "Dict[str, Tuple[int, int]]" = {}
        for path in self.folders():
            try:
                st = os.stat(path)
            except OSError:
                continue
            self.made[path.rstrip("/") or "/"] = (st.st_dev, st.st_ino)
        # What the supervisor's loop waits on for execs: the listener, or the compiled
        # judge's forwards when it runs.
        self.events = self.listener
        self._set_confine_args()

    def _setup_compiled(self, setup: int, needs_landlock: bool, key: int) -> bool:
        """The same set-up in one call into judge.c (stockade_setup), which keeps the written
        paths' inodes for stockade_confine itself; False if it declined (nothing done)."""
        import _ctypes

        entries = []
        if any(self.commands.values()):
            entries.append("C")
            if self.listener < 0:
                entries.append("I")  # else carried over a reset, ours already
            elif key >= 0:
                entries.append(f"K{key}")  # its filter's exec key (stockade_key_pipe)
            if self.executable is not None:
                entries.append("X")
        entries += ["M" + path for path in self.folders()]
        if needs_landlock:
            entries.append("L")
            if self.write is not None:
                entries += ["w", "B" + self.root]
            entries += ["W" + path for path in self._writable() or ()]
            entries += ["E" + path for path in self.executable or ()]
        cfg = c_entries(entries)
        got = _ctypes.call_function(setup, (cfg, len(cfg)))
        if got == -ENOSYS:
            return False
        if got < 0:
            raise OSError(-got, os.strerror(-got))
        listener, ruleset = (got & 0xFFF) - 1, ((got >> 12) & 0xFFF) - 1
        if listener >= 0:
            self.listener = listener
        self._ruleset = ruleset
        self.landlock = (got >> 24) & 0x1F
        self.notify = bool(got >> 29 & 1)
        self._inode_blob = None  # judge.c's own
        return True

    def folders(self) -> "List[str]":
        """The folders the rules let code write (a written glob's, ``/workspace/src/`` for
        ``src/**``): made at set-up, so that they exist."""
        return [path for path in self.write or () if path.endswith("/")]

    def _writable(self) -> "Optional[List[str]]":
        if self.write is None:
            return None
        return [p.rstrip("/") or "/" for p in (*self.write, *ALWAYS_WRITABLE)]

    def _set_confine_args(self) -> None:
        """stockade_confine's arguments, without and with the shim's subreaper."""
        ruleset = self._ruleset if self.landlock else -1
        blob = self._inode_blob  # None: those judge.c found when it built the ruleset
        head = (1 if self.notify else 0, ruleset, blob, len(blob or b""))
        self._confine_args = ((*head, 0), (*head, 1))

    def report(self) -> "Dict[str, Any]":
        """What the host is told at start: which rules the kernel here can enforce."""
        return {"landlock": self.landlock, "notify": self.notify}

    # -- in each shim, before the code ----------------------------------------------------

    def confine(self, subreaper: bool = False) -> bool:
        """Confine this process (a fork of ours that will start code). ``subreaper``: a shim
        asks to become a child subreaper too; True if that was done here (in the compiled
        call: one call into C in the fork rather than two, each of which copies the pages it
        touches), else the caller does it."""
        compiled = self._confine_c
        if compiled is not None:
            import _ctypes

            # The arguments made once (_set_confine_args): every object looked up here is a
            # page the fork copies.
            done = _ctypes.call_function(compiled, self._confine_args[subreaper])
            if done == 0:
                return subreaper
            if done < 0:
                raise OSError(-done, os.strerror(-done))
            # 1: a written folder was replaced: nothing done yet, all of it below
        if self.notify:
            # The supervisor reads each exec's arguments from the caller's memory: the shim
            # (a fork of the non-dumpable supervisor) makes its children readable to it.
            from reaper import PR_SET_DUMPABLE, prctl

            prctl(PR_SET_DUMPABLE, 1)
        if self.landlock:
            import confine

            confine.restrict(_more().current_ruleset(self))
        return False

    # -- in the supervisor ------------------------------------------------------------------

    def spawn(
        self, shim: int, argv: "List[str]", env: "Dict[str, str]", cwd: str, fds: "Tuple[int, int, int]"
    ) -> int:
        """Start a command under the compiled shim (``shim.c``, from its memfd), confined:
        the shim enters the Landlock domain before it starts the command, whose exec the
        judge stops as any other (a written folder replaced under judge.c's ruleset: the
        ruleset built again here first). Its pid; 0 where it cannot be done here (execs
        judged in Python, which would have to answer while we wait for the shim's exec): the
        caller forks the Python shim. OSError if it could not start."""
        if self.listener >= 0 and self.fast is None:
            return 0
        ruleset = -1
        if self.landlock:
            # A ruleset built here is checked here (and rebuilt); judge.c checks its own.
            ruleset = self._ruleset if self._inode_blob is None else _more().current_ruleset(self)
        if not self._spawn_c:  # no judge.c here, and no listener (that case returned above)
            from reaper import spawn_program

            return spawn_program(shim, argv, env, cwd, fds, ruleset=ruleset)
        import _ctypes

        def spawn(ruleset: int) -> int:
            files = code_files_word()
            words = [
                f"/proc/self/fd/{shim}",
                "shim",
                str(ruleset) if ruleset >= 0 else "-",
                files,
                cwd,
                *argv,
            ]
            entries = words + [f"{key}={value}" for key, value in env.items()]
            if any("\0" in entry for entry in entries):
                raise ValueError("embedded null byte")
            blob = c_entries(entries)
            counts = (len(blob), len(words) - 1, len(env))
            return int(_ctypes.call_function(self._spawn_c, (blob, *counts, *fds, ruleset, _DEFAULTS)))

        got = spawn(ruleset)
        if got == -ESTALE and self._inode_blob is None:
            # A written folder was replaced under judge.c's ruleset: built again here, and
            # checked here from now on (judge.c forgets its own), not in a fork of ours made
            # dumpable for the judge: our memory holds what earlier users passed through it,
            # which that fork's command could read (found from outside).
            ruleset = _more().current_ruleset(self)
            _ctypes.call_function(self._forget_c, ())
            got = spawn(ruleset)
        if got == -ESTALE:
            return 0
        if got < 0:
            raise OSError(-got, os.strerror(-got))
        return int(got)

    def key_pipe(self) -> int:
        """A pipe holding the exec key of our filter, for the supervisor a reset execs (it
        lets the compiled shim's exec through the filter, unjudged); -1 where there is none."""
        if not self._key_pipe:
            return -1
        import _ctypes

        return int(_ctypes.call_function(self._key_pipe, ()))

    def python_judge(self) -> "ExecJudge":
        """The Python judge, made at the first exec that reaches it."""
        if self._judge is None:
            from execjudge import ExecJudge

            sizes = _more().program_sizes(self.commands)
            self._judge = ExecJudge(
                self.sup, self.commands, sizes, self.approver, self.masked, listed=self.listed
            )
            self._judge.requests = self._requests  # never an id a verdict still on its way has
        return self._judge

    def renew(self) -> bool:
        """Ready the rules for the next user in this same process (a reset that execs
        nothing, every process of the last user dead): the records of its execs and the
        Python judge (its approvals, its caches) dropped. False where this process cannot
        serve the next user so: its ruleset was built again since the start (the zygote
        holds the first), or a folder the rules made is no longer the one the ruleset holds
        (the reset then execs a fresh supervisor, which builds them again); or its commands
        start in forks of this process (no compiled shim or judge here), which the judge needs
        dumpable: their memory is ours, with what the last user passed through it."""
        if self.rebuilt or (self.notify and (self.sup.shim < 0 or self.fast is None)):
            return False
        for path, (dev, ino) in self.made.items():
            try:
                st = os.stat(path)
            except OSError:
                return False
            if (st.st_dev, st.st_ino) != (dev, ino):
                return False
        if self.fast is not None:
            self.fast.read_records()
        if self._judge is not None:
            self._requests = self._judge.requests
            self._judge = None
        self.between = Between()  # the last user's: the host took them before the reset
        return True

    def asked(self) -> int:
        """How many approvals were asked for in this sandbox: the next request's id is above
        it, in this supervisor and in the one a reset execs (a verdict still on its way from
        the host for a request of the last user must find no request of the next)."""
        return self._judge.requests if self._judge is not None else self._requests

    def let_own_exec_through(self, listener: int) -> None:
        """Answer our own exec's notification at a reset (``rulespy.let_own_exec_through``)."""
        _more().let_own_exec_through(self, listener)

    def on_exec(self, fd: int) -> None:
        """Judge one exec: from the listener, or forwarded by the compiled judge (whose
        records come first, to keep the job's execs in order)."""
        fast = self.fast
        if fast is not None and fd == fast.forwards:
            got = _more().forwarded(fast)
            if got is None:
                return
            self.drain()
            if got[0] == 0:  # the compiled judge stopped on a broken listener: we take it back
                self._fast_gone()
                return
        else:
            import confine

            got = confine.receive(self.listener)
            if got is None:
                return
        self.python_judge().on_exec(self.listener, got)

    def on_verdict(self, request: int, allow: bool, why: str = "") -> None:
        """The host's answer to an approval it was asked for (``why``: the host's reason for a
        no that was no plain no)."""
        if self._judge is not None:
            self._judge.on_verdict(request, allow, why)

    def expire(self, job: "Any") -> None:
        """A job ended: the compiled judge's records are taken in (the job's report lists
        them), its approvals still waiting are refused (their callers are gone)."""
        self.drain(job)
        if self._judge is not None:
            self._judge.expire(job)
        between = self.take_between()
        if between:  # a frame of their own, before the job's final one: each fits a header
            self.sup.send({"id": job.rid, "ev": "between", **between})

    def take_between(self) -> "Dict[str, Any]":
        """The execs judged while no call ran, since the host last took them (empty: none)."""
        self.drain()
        taken, self.between = self.between, Between()
        return taken.report()

    # -- the compiled judge (judge.c) -----------------------------------------------------

    def _load_compiled(self) -> int:
        """judge.c's functions, if the host shipped it and it loads: the exec judge's fast
        path (its thread started by start()) and the shims' confinement; returned, the rules'
        set-up (0: all of it stays in Python)."""
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY)
        if not os.path.exists(path):
            return 0
        try:
            import _ctypes

            library = _ctypes.dlopen(path, os.RTLD_NOW | os.RTLD_LOCAL)
            found = [_ctypes.dlsym(library, name) for name in ("stockade_judge", "stockade_confine")]
            setup = _ctypes.dlsym(library, "stockade_setup")
            self._spawn_c = _ctypes.dlsym(library, "stockade_spawn")
            self._key_pipe = _ctypes.dlsym(library, "stockade_key_pipe")
            self._forget_c = _ctypes.dlsym(library, "stockade_forget_setup")
        except (OSError, AttributeError, ImportError):
            return 0
        self._entry, self._confine_c = found
        return int(setup)

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

    def stop_fast(self) -> None:
        """Stop the compiled judge (before our own exec at a reset): the listener is ours
        again, and its records are taken in."""
        if self.fast is None:
            return
        _more().stop(self.fast, self.listener)
        self.drain()
        self.fast = None
        self.events = self.listener

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


def _more() -> "Any":
    """The rules' paths a start under judge.c does not take (``rulespy``), at their first use."""
    import rulespy

    return rulespy


def record(job: "Any", done: "Dict[str, Any]") -> None:
    """One judged exec, onto the job whose code ran it: the first ones the rules let run, and
    every one they stopped or asked about (up to the report's bounds); the rest counted.
    ``done``'s argv is as ``kept_argv`` keeps it. ``job`` is ``Rules.between`` for an exec
    no call's code ran."""
    job.exec_count += 1
    allowed = done.get("verdict") == "allow"
    room = ALLOWED_RECORDS if allowed else MAX_EXEC_RECORDS
    if len(job.execs) < room and fits(job, done, ALLOWED_REPORT if allowed else MAX_EXEC_REPORT):
        job.execs.append(done)


def fits(job: "Any", done: "Dict[str, Any]", room: int) -> bool:
    """Whether the record ``done`` fits the job's report, its records' JSON and text (their
    characters at the widest width among them: ``protocol.text_size``) under ``room``
    bytes with it; if so, it is counted in."""
    raw = dumps(done).encode()
    chars, width = text_size(raw)
    size, chars, width = job.exec_json + len(raw) + 1, job.exec_chars + chars + 1, max(width, job.exec_width)
    if size > room or chars * width > room:
        return False
    job.exec_json, job.exec_chars, job.exec_width = size, chars, width
    return True


def kept_argv(argv: "List[str]") -> "List[str]":
    """What a record and an approval keep of ``argv`` (MAX_EXEC_ARGV words at most): each word
    up to MAX_EXEC_WORD characters, and MAX_EXEC_RECORD_ARGV over them all, shared out so
    that the longest words are cut first and alike (cut to the same length: a word of up to
    MAX_EXEC_RECORD_ARGV / MAX_EXEC_ARGV characters is always whole, where the words before
    it once took all the room and a `-r` after them was cut to nothing); a word cut is its
    head and a mark saying how much more and its SHA-256 (two words alike in their heads
    stay two requests for an approver)."""
    lengths = [len(word) for word in argv]
    if sum(lengths) <= MAX_EXEC_RECORD_ARGV and max(lengths, default=0) <= MAX_EXEC_WORD:
        return argv
    cap, room = MAX_EXEC_WORD, MAX_EXEC_RECORD_ARGV
    if sum(min(n, cap) for n in lengths) > room:
        ordered = sorted(min(n, cap) for n in lengths)
        for at, n in enumerate(ordered):  # the shortest whole, the rest cut to an equal share
            share = room // (len(ordered) - at)
            if n > share:
                cap = share
                break
            room -= n
    out = []
    for word in argv:
        if len(word) > cap:
            import hashlib

            digest = hashlib.sha256(word.encode("utf-8", "surrogateescape")).hexdigest()
            word = f"{word[:cap]}[... {len(word) - cap} more characters; the word is sha256 {digest}]"
        out.append(word)
    return out


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


# -- the compiled judge's thread, seen from the supervisor ------------------------------------
# (here rather than in a module of its own: every sandbox under command rules starts it, and a
# module's import is ~0.2 ms of that start before its first line)

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
