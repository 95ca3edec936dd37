"""The sandbox's rules, inside: what the supervisor does with the policy the host sent.

Every shim confines the code it starts (``confine``): writes only where the rules allow
(Landlock), and every exec stopped in the kernel until the supervisor judges it (seccomp
user notification). The supervisor judges each exec here (``on_exec``) with the argv the
kernel was given, records it on the job whose code ran it, and answers: run, or fail with
EACCES and a line on the program's stderr. An exec that needs approval waits while the
host asks (``approve`` frames); the host's answer comes back as a ``verdict`` request.

Most execs never reach Python: where the host shipped the compiled judge (``judge.so``, from
``judge.c``), a thread of ours in C owns the listener, answers at once the execs the rules
allow whatever their arguments, and writes their records to a pipe drained when a job ends
(``drain``). Everything else it forwards here unchanged, on another pipe (``events``).
Standard library only.
"""

from __future__ import annotations

import os
import struct

import confine
import execrules
from protocol import MAX_EXEC_ARGV, MAX_EXEC_RECORDS

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Set, Tuple

# What stays writable whatever the rules say: the scratch places and the devices.
ALWAYS_WRITABLE = ("/tmp", "/dev", "/proc")
# Where the programs a rule names are looked for, to know their copies by their content.
PROGRAM_DIRS = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")
EPERM, ENOENT = 1, 2
STRICTNESS = {"allow": 0, "approve": 1, "deny": 2}
JUDGE_LIBRARY = "judge.so"  # the compiled fast path, beside this module when the host built it
F_SETPIPE_SZ = 1031
# The records' pipe keeps its default room (64 KiB: over a thousand records between two
# drains; a full pipe sends the exec to Python, which drains first). Not more: pipe pages
# count against the sandbox user's limit, which every sandbox of the host shares.
RECORDS_READ = 1 << 16
RECORD_HEAD = struct.Struct("=IiiI")  # its length, pid, session, argv words kept


class Rules:
    def __init__(self, sup: "Any", cfg: "Dict[str, Any]", listener: int = -1) -> None:
        self.sup = sup
        self._load(cfg)
        self.write = cfg.get("write")  # None: the whole workspace is writable
        self.approver = bool(cfg.get("approver"))
        allow = self.commands["allow"]
        self.executable = self._allowed_files(allow) if allow else None
        needs_landlock = self.write is not None or self.executable is not None
        self.landlock = confine.landlock_abi() if needs_landlock else 0
        self._ruleset = -1  # built once (below), applied by every shim
        self._inodes: "Dict[str, Tuple[int, int]]" = {}
        self._inode_blob = b""  # the same, as judge.c's stockade_confine reads them
        self._confine_c: "Any" = None  # that function, where the host shipped judge.so
        self.notify = self.judging and confine.notify_available()
        self.listener = listener
        self.pending: "Dict[int, Tuple[int, int, int, Any, Dict[str, Any], Tuple[Any, ...]]]" = {}
        self.requests = 0
        self._decided: "Dict[Tuple[Any, ...], str]" = {}  # (pid, file, argv) -> verdict
        # (path, file, its size and time, argv) -> the judge's verdict and rule
        self._verdicts: "Dict[Tuple[Any, ...], Tuple[str, Optional[str]]]" = {}
        if self.notify:
            self._index_programs()
            if self.listener < 0:
                # On ourselves: every process of the sandbox descends from us and inherits it;
                # we exec only at a reset, and answer that exec ourselves (let_own_exec_through).
                self.listener = confine.install_exec_listener(no_memfd=self.executable is not None)
        if self.write is not None:
            for path in self.write:
                if path.endswith("/"):  # a folder the rules let code write: it must exist
                    try:
                        os.makedirs(path, exist_ok=True)
                    except OSError:
                        pass
        if self.landlock:
            self._build_ruleset()
        # What each shim calls, prepared here once: a fork then finds it ready.
        from reaper import PR_SET_DUMPABLE, prctl

        prctl(PR_SET_DUMPABLE, 0)
        if self.landlock or self.notify:
            confine.warm()
        # What the supervisor's loop waits on for execs: the listener, or the fast path's
        # forwards when it runs.
        self.events = self.listener
        self._fast: "Optional[Tuple[int, int, int]]" = None  # its forwards, records, stop
        if (self.notify or self.landlock) and cfg.get("judge") != "python":
            self._load_compiled()

    def _load(self, cfg: "Dict[str, Any]") -> None:
        """The command rules, indexed, and what the judge learns of files as it goes."""
        commands = cfg.get("commands") or {}
        self.commands = {
            kind: [list(map(str, words)) for words in commands.get(kind, [])]
            for kind in ("deny", "approve", "allow")
        }
        self.judging = any(self.commands.values())
        self._index = {kind: self._indexed(patterns) for kind, patterns in self.commands.items()}
        self._names: "Dict[Tuple[int, int, int], str]" = {}  # file -> the name it has
        self._identity: "Dict[Tuple[int, int, int, int], str]" = {}  # (dev, ino, size, mtime) -> digest
        self._known: "Dict[str, Set[str]]" = {}  # content digest -> program names
        self._sizes: "Dict[int, List[str]]" = {}  # size -> paths of the programs rules name

    @classmethod
    def judge_only(cls, cfg: "Dict[str, Any]") -> "Rules":
        """The judge alone, nothing installed on this process (no listener, no Landlock, no
        thread): what the tests hold judge.c's fast path against."""
        rules = cls.__new__(cls)
        rules._load(cfg)
        rules._index_programs()
        return rules

    def _writable(self) -> "Optional[List[str]]":
        if self.write is None:
            return None
        return [p.rstrip("/") or "/" for p in (*self.write, *ALWAYS_WRITABLE)]

    def _build_ruleset(self) -> None:
        if self._ruleset >= 0:
            os.close(self._ruleset)
        writable = self._writable()
        self._ruleset = confine.ruleset(self.landlock, writable, self.executable)
        self._inodes = {}
        for path in writable or ():
            try:
                st = os.stat(path)
            except OSError:
                continue
            self._inodes[path] = (st.st_dev, st.st_ino)
        self._inode_blob = b"".join(
            struct.pack("=QQ", dev, ino) + path.encode("utf-8", "surrogateescape") + b"\0"
            for path, (dev, ino) in self._inodes.items()
        )

    def _current_ruleset(self) -> int:
        """The ruleset, rebuilt if a written folder was replaced (a rule holds its inode)."""
        for path, inode in self._inodes.items():
            try:
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) != inode:
                self._build_ruleset()
                break
        return self._ruleset

    def report(self) -> "Dict[str, Any]":
        """What the host is told at start: which rules the kernel here can enforce."""
        return {"landlock": self.landlock, "notify": self.notify}

    # -- in each shim, before the code ----------------------------------------------------

    def confine(self) -> None:
        compiled = self._confine_c
        if compiled is not None:
            import _ctypes

            ruleset = self._ruleset if self.landlock else -1
            blob = self._inode_blob
            done = _ctypes.call_function(compiled, (1 if self.notify else 0, ruleset, blob, len(blob)))
            if done == 0:
                return
            if done < 0:
                raise OSError(-done, os.strerror(-done))
            # 1: a written folder was replaced: nothing done yet, all of it below
        if self.notify:
            # The supervisor reads each exec's arguments from the caller's memory: the shim
            # (a fork of the non-dumpable supervisor) makes its children readable to it.
            from reaper import PR_SET_DUMPABLE, prctl

            prctl(PR_SET_DUMPABLE, 1)
        if self.landlock:
            confine.restrict(self._current_ruleset())

    # -- in the supervisor ------------------------------------------------------------------

    def let_own_exec_through(self, listener: int) -> None:
        """Answer the judge's question about our own exec (a reset's): the exec waits in the
        kernel, holding our one thread (and the GIL), until someone does. A forked helper
        does, then ends; any other exec waiting is refused (every other process is dead)."""
        self.stop_fast()  # else its thread could take our exec's notification
        me = os.getpid()
        if os.fork() != 0:
            return
        try:
            import select

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

    def on_exec(self, fd: int) -> None:
        """Judge one exec: from the listener, or forwarded by the fast path (whose records
        come first, to keep the job's execs in order)."""
        listener = self.listener
        if self._fast is not None and fd == self._fast[0]:
            try:
                data = os.read(fd, confine.NOTIF.size)
            except BlockingIOError:
                return
            if len(data) != confine.NOTIF.size:
                return
            nid, pid, _, nr, _, _, *args = confine.NOTIF.unpack(data)
            self.drain()
            if nid == 0:  # the fast path stopped on a broken listener: we take it back
                self._fast_gone()
                return
            self._judge_exec(listener, (nid, pid, nr, tuple(args)))
            return
        got = confine.receive(listener)
        if got is not None:
            self._judge_exec(listener, got)

    def _judge_exec(self, listener: int, got: "Tuple[int, int, int, Tuple[int, ...]]") -> None:
        """The caller waits in the kernel meanwhile, so an allowed exec is answered as soon as
        its verdict and job are known, and recorded after: the argv recorded is the one
        judged, read before. The job is looked up first, as the caller may have run, ended
        and been reaped by the time the record is made."""
        nid, pid, nr, args = got
        try:
            mem = confine.open_memory(listener, nid, pid)
        except OSError:
            confine.answer(listener, nid, False)  # gone, or cannot tell what it runs: no
            return
        try:
            path = confine.read_path(mem, pid, nr, args)
            target = self._in_view(pid, path)
            try:
                st = os.stat(target)
            except OSError:
                # What the kernel would say (a PATH search goes on to the next folder). Never
                # "go on" unjudged: the file could appear between this look and the exec.
                # Nothing runs, nothing is recorded: its argv need not be read.
                confine.answer(listener, nid, False, ENOENT)
                return
            argv = confine.read_argv(mem, nr, args)
        except (OSError, ValueError):
            confine.answer(listener, nid, False)  # cannot tell what it runs: no
            return
        finally:
            os.close(mem)
        key = (pid, st.st_dev, st.st_ino, tuple(argv))
        verdict = self._decided.get(key)
        if verdict is not None:  # the same exec tried again by another name (/bin, /usr/bin)
            confine.answer(listener, nid, verdict == "allow", EPERM)
            return
        # The same program, file and argv again (a loop, a build): the same verdict.
        seen = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, key[3])
        if path.startswith("/proc/"):  # /proc/self/... is another file for each caller
            seen = None
        judged = self._verdicts.get(seen) if seen is not None else None
        if judged is None:
            judged = self.judge(pid, path, argv, st)
            if seen is not None and judged[0] != "approve":  # an approval is asked each time
                if len(self._verdicts) > 1024:
                    self._verdicts.clear()
                self._verdicts[seen] = judged
        verdict, rule = judged
        job = self.sup.job_of(pid)
        if verdict == "allow":
            confine.answer(listener, nid, True)
            self._remember(key, verdict)
            self._record(job, {"path": path, "argv": argv[:MAX_EXEC_ARGV], "verdict": verdict, "rule": ""})
            return
        record = {"path": path, "argv": argv[:MAX_EXEC_ARGV], "verdict": verdict, "rule": rule or ""}
        if verdict == "approve":
            if not self.approver or job is None:
                record["verdict"] = "refuse"
                record["rule"] = (rule or "") + " (nobody to ask)"
                self._refuse(listener, nid, pid, record)
            else:
                self.requests += 1
                self.pending[self.requests] = (listener, nid, pid, job, record, key)
                self.sup.send({"id": job.rid, "ev": "approve", "req": self.requests, **record})
        else:
            self._refuse(listener, nid, pid, record)
            self._remember(key, verdict)
        self._record(job, record)

    def on_verdict(self, request: int, allow: bool) -> None:
        """The host's answer to an approval it was asked for."""
        parked = self.pending.pop(request, None)
        if parked is None:
            return
        listener, nid, pid, _, record, key = parked
        self._remember(key, "allow" if allow else "refuse")
        if not confine.still_waiting(listener, nid):
            return
        if allow:
            record["verdict"] = "approve"
            confine.answer(listener, nid, True)
        else:
            record["verdict"] = "refuse"
            self._refuse(listener, nid, pid, record)

    def _remember(self, key: "Tuple[Any, ...]", verdict: str) -> None:
        if len(self._decided) > 256:
            self._decided.clear()
        self._decided[key] = verdict

    def _refuse(self, listener: int, nid: int, pid: int, record: "Dict[str, Any]") -> None:
        why = "needs approval and was refused" if record["verdict"] == "refuse" else "denied by policy"
        line = f"stockade: {os.path.basename(record['path'])}: {why}: {record['rule']}\n"
        try:  # on the program's own stderr, where a person or a model will look
            fd = os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                os.write(fd, line.encode("utf-8", "replace"))
            finally:
                os.close(fd)
        except OSError:
            pass
        # EPERM, not EACCES: a PATH search (execvp) stops at it instead of asking again
        # for /bin/rm after /usr/bin/rm; shells report it and exit 126.
        confine.answer(listener, nid, False, EPERM)

    def _record(self, job: "Any", record: "Dict[str, Any]") -> None:
        if job is None:
            return
        job.exec_count += 1
        if len(job.execs) < MAX_EXEC_RECORDS:
            job.execs.append(record)

    # -- judging ----------------------------------------------------------------------------

    @staticmethod
    def _indexed(patterns: "List[List[str]]") -> "Tuple[Dict[str, List[List[str]]], List[List[str]]]":
        """Patterns by their program's name, and those whose program is a glob."""
        literal: "Dict[str, List[List[str]]]" = {}
        globs: "List[List[str]]" = []
        for words in patterns:
            if execrules.GLOB_CHARS & set(words[0]):
                globs.append(words)
            else:
                literal.setdefault(words[0], []).append(words)
        return literal, globs

    def _patterns(self, kind: str, name: str) -> "List[List[str]]":
        literal, globs = self._index[kind]
        found = literal.get(name, [])
        if globs:
            found = found + [w for w in globs if execrules._glob(name, w[0])]
        return found

    def judge(
        self, pid: int, path: str, argv: "List[str]", st: "Optional[os.stat_result]" = None
    ) -> "Tuple[str, Optional[str]]":
        """The strictest verdict over every name the program goes by: the path it was run as,
        the file that path leads to, the name it was given (argv[0]: a multi-call binary's
        applet), and the names of the programs its content is a copy of. ``python -m X`` is
        also judged as X."""
        target = self._in_view(pid, path)
        if st is None:
            st = os.stat(target)
        files = {os.path.basename(path), self._real_name(target, st)}
        if st.st_size in self._sizes:
            files |= self._copies_of(target)
        args = argv[1:]
        candidates = [(name, args) for name in files | ({os.path.basename(argv[0])} if argv else set())]
        inner = execrules.subject(argv)
        if inner and len(inner) < len(argv):  # python3 -m X
            candidates.append((os.path.basename(inner[0]), inner[1:]))
        for kind, verdict in (("deny", "deny"), ("approve", "approve")):
            for name, rest in candidates:
                for words in self._patterns(kind, name):
                    if execrules.matches(words, [name, *rest]):
                        if verdict == "deny" or not self._allow_refuses(files, args):
                            return verdict, f"commands.{kind}: " + " ".join(words)
                        return "deny", "commands.allow"
        if self._allow_refuses(files, args):
            return "deny", "commands.allow"
        return "allow", None

    def _allow_refuses(self, files: "Set[str]", args: "List[str]") -> bool:
        """Under an allowlist, what the file is (never the name it was given) must be listed."""
        if not self.commands["allow"]:
            return False
        for name in files:
            if any(execrules.matches(words, [name, *args]) for words in self._patterns("allow", name)):
                return False
        return True

    def _real_name(self, target: str, st: "os.stat_result") -> str:
        """The name of the file ``target`` leads to (symlinks followed), cached by the file."""
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        name = self._names.get(key)
        if name is None:
            if len(self._names) > 4096:
                self._names.clear()
            name = self._names[key] = os.path.basename(os.path.realpath(target))
        return name

    def _in_view(self, pid: int, path: str) -> str:
        """``path`` as the caller sees it (/proc/self is the caller's, not ours)."""
        for own in ("/proc/self/", "/proc/thread-self/"):
            if path.startswith(own):
                return f"/proc/{pid}/" + path[len(own) :]
        return path

    @staticmethod
    def _allowed_files(allow: "List[List[str]]") -> "List[str]":
        """What an allowlist lets run, as files: the programs it names, the interpreters their
        scripts name, and the ELF loader. Landlock then lets nothing else be executed, from
        any path, a copy or a file the code wrote itself included."""
        import fnmatch

        globs = [words[0] for words in allow]
        files: "Set[str]" = set()
        for folder in PROGRAM_DIRS:
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                if any(fnmatch.fnmatchcase(name, g) for g in globs):
                    files.add(os.path.realpath(os.path.join(folder, name)))
        for path in list(files):
            try:
                with open(path, "rb") as fh:
                    head = fh.read(256)
            except OSError:
                continue
            if head.startswith(b"#!"):
                words = head[2:].split(b"\n", 1)[0].split()
                if words:
                    files.add(os.path.realpath(words[0].decode("utf-8", "replace")))
        for loader in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1", "/lib/ld-linux.so.2"):
            if os.path.exists(loader):
                files.add(os.path.realpath(loader))
        return sorted(files)

    def _index_programs(self) -> None:
        """The sizes of the programs the rules name: a file of another size is no copy."""
        # A program denied whatever its arguments is masked: no copy of it can exist.
        names = {words[0] for words in self.commands["approve"] if words}
        names |= {words[0] for words in self.commands["deny"] if len(words) > 1}
        for folder in PROGRAM_DIRS:
            for name in names:
                if any(c in name for c in "*?["):
                    continue
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                self._sizes.setdefault(st.st_size, []).append(path)

    def _digest(self, path: str) -> "Optional[str]":
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        digest = self._identity.get(key)
        if digest is None:
            import hashlib  # lazily: it loads OpenSSL, and few execs ever need it

            h = hashlib.sha256()
            try:
                with open(path, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
            except OSError:
                return None
            digest = self._identity[key] = h.hexdigest()
        return digest

    def _copies_of(self, path: str) -> "Set[str]":
        """Names of the programs the rules name whose content ``path`` holds."""
        try:
            size = os.stat(path).st_size
        except OSError:
            return set()
        found: "Set[str]" = set()
        for original in self._sizes.get(size, ()):
            if original == path:
                continue
            digest = self._digest(original)
            if digest is not None and digest == self._digest(path):
                found.add(os.path.basename(original))
        return found

    def expire(self, job: "Any") -> None:
        """A job ended: the fast path's records are taken in (the job's report lists them),
        its approvals still waiting are refused (their callers are gone)."""
        self.drain(job)
        for request, parked in list(self.pending.items()):
            if parked[3] is job:
                self.pending.pop(request)
                confine.answer(parked[0], parked[1], False, EPERM)

    # -- the compiled fast path (judge.c) ---------------------------------------------------

    def _fast_config(self) -> bytes:
        """The rules as judge.c reads them: NUL-ended entries, a letter and its text."""
        entries = [f"M{MAX_EXEC_ARGV}"]
        for kind in ("deny", "approve"):
            entries += [f"P{words[0]}" for words in self.commands[kind] if words]
        if self.commands["allow"]:
            entries.append("L")
            entries += [f"A{words[0]}" for words in self.commands["allow"] if len(words) == 1]
        entries += [f"S{size}" for size in self._sizes]
        return b"".join(e.encode("utf-8", "surrogateescape") + b"\0" for e in entries)

    def _load_compiled(self) -> None:
        """judge.c's functions, if the host shipped it and it loads: the exec judge's fast
        path (started here) and the shims' confinement. Else all of it stays in Python."""
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), JUDGE_LIBRARY)
        if not os.path.exists(path):
            return
        try:
            import _ctypes

            library = _ctypes.dlopen(path, os.RTLD_NOW | os.RTLD_LOCAL)
            entry = _ctypes.dlsym(library, "stockade_judge")
            confine_c = _ctypes.dlsym(library, "stockade_confine")
        except (OSError, AttributeError, ImportError):
            return
        self._confine_c = confine_c
        if self.notify:
            self._start_fast(entry)

    def _start_fast(self, entry: int) -> None:
        """Start judge.c on a thread of ours: from then on it owns the listener."""
        import _ctypes

        config = self._fast_config()
        if b"\0\0" in config or config.count(b"\0") > 1000:
            return  # an empty program name, or more rules than it holds: all to Python
        forward_r, forward_w = os.pipe2(os.O_CLOEXEC)
        records_r, records_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)  # a full pipe: to Python
        stop_r, stop_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(forward_r, False)
        import fcntl

        for small in (forward_w, stop_w):  # one page each is room enough (see stop_fast)
            try:
                fcntl.fcntl(small, F_SETPIPE_SZ, 4096)
            except OSError:
                pass
        # A thread of its own making (a raw clone), that never takes the GIL: the call
        # returns once it runs, and it owns the listener from then on.
        if _ctypes.call_function(entry, (self.listener, forward_w, records_w, stop_r, config, len(config))):
            for fd in (forward_r, forward_w, records_r, records_w, stop_r, stop_w):
                os.close(fd)
            return
        self._fast = (forward_r, records_r, stop_w)
        self.events = forward_r

    def stop_fast(self) -> None:
        """Stop the fast path (before our own exec at a reset): the listener is ours again.
        Until the thread says it stopped (a notification of id 0), what it forwards is
        refused: a reset has killed every process, and a full pipe would hold the thread."""
        fast = self._fast
        if fast is None:
            return
        import select

        os.write(fast[2], b"q")
        deadline = 50  # tenths of a second: a thread that does not answer dies with our exec
        stopped = False
        while not stopped and deadline > 0:
            if not select.select([fast[0]], [], [], 0.1)[0]:
                deadline -= 1
                continue
            try:
                data = os.read(fast[0], confine.NOTIF.size * 51)  # whole notifications
            except BlockingIOError:
                continue
            for at in range(0, len(data) - confine.NOTIF.size + 1, confine.NOTIF.size):
                nid = confine.NOTIF.unpack_from(data, at)[0]
                if nid:
                    confine.answer(self.listener, nid, False, EPERM)
                else:
                    stopped = True
        self.drain()
        self._fast = None
        self.events = self.listener

    def _fast_gone(self) -> None:
        """judge.c gave the listener up (it broke under it): judge everything here."""
        forward_r = self.events
        self._fast = None
        self.events = self.listener
        try:
            self.sup.sel.unregister(forward_r)
            self.sup.sel.register(self.listener, 1, ("exec", None))  # 1: EVENT_READ
        except (KeyError, ValueError, OSError):
            pass

    def drain(self, ending: "Any" = None) -> None:
        """Take in the records of the execs judge.c let run, onto their jobs. ``ending``: the
        job that just ended (its shim is no longer ours to look up)."""
        fast = self._fast
        if fast is None:
            return
        data = b""
        while True:
            try:
                chunk = os.read(fast[1], RECORDS_READ)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        at = 0
        while at + RECORD_HEAD.size <= len(data):
            size, _pid, session, _kept = RECORD_HEAD.unpack_from(data, at)
            if size <= RECORD_HEAD.size:
                break  # never written so by judge.c; stop rather than loop
            words = data[at + RECORD_HEAD.size : at + size].split(b"\0")[:-1]
            at += size
            text = [w.decode("utf-8", "surrogateescape") for w in words]
            job = self._job_led_by(session, ending)
            self._record(job, {"path": text[0], "argv": text[1:], "verdict": "allow", "rule": ""})

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
