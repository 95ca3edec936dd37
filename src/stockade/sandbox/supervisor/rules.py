"""The sandbox's rules, inside: what the supervisor sets up from the policy the host sent.

Every shim confines the code it starts (``confine``): writes only where the rules allow
(Landlock), and every exec stopped in the kernel until it is judged (seccomp user
notification, installed here on the supervisor itself: every process of the sandbox
descends from it and inherits the filter).

Where the host shipped the compiled judge (``judge.so``, from ``judge.c``), it does the
set-up in one call (``stockade_setup``), and a thread of ours in C answers at once the execs
the rules allow whatever their arguments (``fastjudge``, a layer of ``Rules``); the rest, and every exec
where it does not run, go to the Python judge (``execjudge``), loaded at the first exec that
reaches it, so that a start pays for neither its imports nor its indexes. Without the
library the set-up goes through ``confine``'s calls (``rulespy``, with every other path a
start under judge.c does not take: a start imports this module whole). The records of the
execs judged, and their bounds, are ``execrecords``'. Standard library only.
"""

from __future__ import annotations

import _signal as signal
import os

from execrecords import Between
from fastjudge import RulesFastJudge, c_entries
from reaper import IGNORED_SIGNALS, code_files_word

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

    from execjudge import ExecJudge
    from fastjudge import FastJudge

# What stays writable whatever the rules say: the scratch places and the devices.
ALWAYS_WRITABLE = ("/tmp", "/dev", "/proc")
EPERM, ENOENT, E2BIG, ENOSYS, ESTALE = 1, 2, 7, 38, 116
LIBRARY = "judge.so"  # judge.c, beside these modules, when the host built it
# The signals a command's shim gets back at their default: those the supervisor ignores,
# and SIGCHLD (bit N-1: signal N, all below 32; the handlers it catches go back to default
# at the exec).
_DEFAULTS = sum(1 << (int(sig) - 1) for sig in (signal.SIGCHLD, *IGNORED_SIGNALS))


class Rules(RulesFastJudge):
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
            from libc import PR_SET_DUMPABLE, prctl

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

    def stop_fast(self) -> None:
        """Stop the compiled judge (before our own exec at a reset): the listener is ours
        again, and its records are taken in."""
        if self.fast is None:
            return
        _more().stop(self.fast, self.listener)
        self.drain()
        self.fast = None
        self.events = self.listener


def _more() -> "Any":
    """The rules' paths a start under judge.c does not take (``rulespy``), at their first use."""
    import rulespy

    return rulespy
