"""The in-sandbox supervisor: one process per sandbox, started by every tier, its init.

It serves the host over stdin/stdout with the framed protocol: commands (fork server),
``run_code`` (a persistent interpreter process), and workspace file operations. It lives
inside the isolation boundary, so the host treats everything it says as untrusted; its job
is convenience and speed (no new container/bwrap per command), never the security boundary.

Every command and the interpreter run under a *shim*: a forked child that is a child
subreaper, so whatever the command double-forks is reparented to the shim and dies with it.
On exit or timeout the whole tree is killed (scan /proc, SIGKILL, repeat until empty).

This module is the start (the import path, the first frames, the filters), the
configuration, the state, and the ends of the interpreter and of the supervisor; the event
loop and the dispatch are ``eventloop.py`` (``EventLoop``, its base), the jobs and the
commands' life ``jobs.py``, the file operations ``files.py``, the interpreter process and
its queue ``runcode.py``, a reset ``reset.py``.

Standard library only; runs on any Python >= 3.8 found inside the sandbox.
"""

from __future__ import annotations

# Start-up time is cold-start time: only C modules and tiny pure-Python ones here
# (no typing, selectors, ctypes, json, enum-based signal), heavy ones imported lazily.
# The event loop's (eventloop.py) too: loaded before the path fix below, which may leave out
# the folder a C module comes from.
import _signal as signal  # noqa: F401 - eventloop.py's
import os
import resource
import select  # noqa: F401 - eventloop.py's
import stat
import sys
import time  # noqa: F401 - eventloop.py's

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Optional

    from jobs import CommandJob, Job
    from runcode import Interpreter


def _trusted_path(entries: "list[str]", here: str) -> "list[str]":
    """Where the supervisor may import from: its own folder and read-only system folders.

    Never the current directory (``-c`` puts '' first, and we start in the workspace) nor
    anything the sandbox can write: a module planted there would run inside the supervisor,
    which outlives every command and a pool's reset.
    """
    out = [here]
    for entry in entries:
        if not entry.startswith("/") or entry == here:
            continue
        probe = entry
        while not os.path.exists(probe) and probe != "/":
            probe = os.path.dirname(probe)
        if not os.access(probe, os.W_OK):
            out.append(entry)
    return out


sys.path[:] = _trusted_path(sys.path, os.path.dirname(os.path.abspath(__file__)))

# ruff: noqa: E402 - the sibling modules are imported after the path fix above
import baseline
import runcode
from eventloop import EVENT_READ, EventLoop, Poller
from fileops import Workspace, read_exactly, unlisted_ipc
from libc import PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE, limit_arenas, prctl, private_page, scrub_freed
from proctree import kill_tree
from protocol import PREFIX, FrameReader, Seal, best_mac, dumps, encode
from reaper import load_shim, runnable_only, set_code_files
from zygote import Zygote
from zygote import start as start_zygote

# Beside the workspace: every place the code can write (POSIX message queues included).
RESET_ROOTS = ("/tmp", "/dev/shm", "/dev/mqueue")
# A reset execs a fresh supervisor (reset.py) and tells it so with this flag.
RESUME_FLAG = "--stockade-resume"


def own_files(cfg: "dict[str, Any]") -> bool:
    """Take our descriptor limit, ``files`` (the code's and the egress relay's connections),
    and leave the code's (``rlimits``) to what we start (``reaper.set_code_files``); whether
    we did. Where we cannot have more (a hard limit under it, no privilege) we keep the
    code's, as before, and the relay carries fewer connections."""
    files = int(cfg.get("files", 0))
    code = int(cfg.get("rlimits", {}).get("RLIMIT_NOFILE", 0))
    if code <= 0 or files <= code:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    except (OSError, ValueError):
        return False
    set_code_files(code)
    return True


class Supervisor(EventLoop):
    """One per sandbox: its state, its configuration and start, whose job a process is, and
    the ends of the interpreter and of the supervisor; the loop is ``EventLoop``'s."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd = rfd
        self.wfd = wfd
        self.sel = Poller()
        self.reader = FrameReader(max_body=1 << 40)  # the host is trusted
        # What the host sends is read into this one buffer: a fresh 1 MiB object per read
        # (os.read) costs two 1 MiB memsets under scrub_freed, for a read of 4 KiB on the
        # microVM's port. A reset zeroes what reads wrote in it (``wipe_input``).
        self.inbuf = bytearray(1 << 20)
        self.inbuf_written = 0
        self.commands: dict[int, CommandJob] = {}
        self.shims: dict[int, CommandJob] = {}
        self.interpreter: Optional[Interpreter] = None
        self.env: dict[str, str] = {}
        self.workspace = Workspace("/workspace")
        self.output_cap = 1 << 20
        self.default_timeout = 30.0
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        self.running = True
        self.root_modes: dict[str, int] = {}  # the writable places reset empties, as first seen
        # The folders the rules made in them, and those on the way, which a reset empties and
        # keeps (the ruleset holds them), as first seen.
        self.kept_modes: dict[str, int] = {}
        self.config: dict[str, Any] = {}
        self.baseline: dict[str, Any] = {}
        # Where the sandbox has a kernel of its own (the microVM), only it counts the
        # processes its OOM killer took; the host sees no cgroup event.
        self.report_oom = False
        self.rules: Optional[Any] = None  # the policy, enforced on the code (supervisor/rules.py)
        self.confine: "Optional[Any]" = None
        self.shim = -1  # the compiled shim's memfd (reaper.load_shim): how commands start
        self.egress: "Optional[Any]" = None  # the relay to the egress proxy (supervisor/egress.py)
        # Where code can reach our pipes (gVisor), what we send is sealed (protocol.Seal), and
        # so is what we read (``reader.seal``); its key is a view of a mapping forks leave out.
        self.seal: "Optional[Seal]" = None
        # Restored from a memory snapshot: the interpreter's next run first draws new seeds
        # (every sandbox restored from one snapshot would otherwise share its generators).
        self.reseed = False
        self.zygote: Optional[Zygote] = None  # forks every interpreter (supervisor/zygote.py)
        # Has this process image served only the current user? A reset that keeps it (and
        # the zygote) makes it False: from then on no interpreter may be forked from us.
        self.clean = True

    # -- plumbing ------------------------------------------------------------------------

    def send(self, header: dict[str, Any], body: bytes = b"") -> None:
        data = encode(header, body, self.seal)
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.wfd, view) :]
            except InterruptedError:
                continue

    def configure(self, cfg: dict[str, Any], carried: Optional[dict[str, Any]] = None) -> None:
        """Apply the host's ``init`` configuration; ``carried`` is what a reset hands over
        to the fresh supervisor (the settings and modes as first seen, not as left by code)."""
        self.config = cfg
        self.report_oom = bool(cfg.get("report_oom"))
        self.env = {str(k): str(v) for k, v in cfg.get("env", {}).items()}
        self.workspace = Workspace(cfg.get("workspace", "/workspace"), links=bool(cfg.get("links", True)))
        self.output_cap = int(cfg.get("output_cap", self.output_cap))
        self.default_timeout = float(cfg.get("timeout", self.default_timeout))
        ours = own_files(cfg)  # before the code's limit, which we could not raise again
        for name, value in cfg.get("rlimits", {}).items():
            if ours and name == "RLIMIT_NOFILE":
                continue
            res = getattr(resource, name)
            resource.setrlimit(res, (int(value), int(value)))
        if "MALLOC_ARENA_MAX" in self.env:
            limit_arenas(self.env["MALLOC_ARENA_MAX"])
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # Before the rules: under an allowlist no memfd is made after them, us included.
        shim = carried.get("shim", -1) if carried is not None else -1
        if shim >= 0:
            os.set_inheritable(shim, False)  # carried over the reset's exec; no further
        else:
            shim = load_shim(os.path.dirname(os.path.abspath(__file__)))
        self.shim = shim
        if cfg.get("rules"):
            # What is loaded so far lives as long as we do: out of the collector's sight, the
            # rules' imports and set-up below no longer set off a collection of all of it
            # (~1 ms of the start, measured).
            import gc

            gc.freeze()
            import rules  # type: ignore[import-not-found]

            listener = carried.get("listener", -1) if carried is not None else -1
            key = carried.get("key", -1) if carried is not None else -1
            asked = carried.get("asked", 0) if carried is not None else 0
            self.rules = rules.Rules(self, cfg["rules"], listener=listener, key=key, asked=asked)
            self.confine = self.rules.confine
            if self.rules.notify and self.shim >= 0 and not runnable_only(self.shim):
                os.close(self.shim)  # its keyed exec would show the key: the Python shim
                self.shim = -1
        if cfg.get("egress"):
            import egress  # type: ignore[import-not-found]

            self.egress = egress.make(self.sel, cfg["egress"])
        if carried is not None:
            self.root_modes = {str(k): int(v) for k, v in carried["root_modes"].items()}
            self.kept_modes = {str(k): int(v) for k, v in carried.get("kept_modes", {}).items()}
            self.baseline = carried["baseline"]
            return
        for root in (self.workspace.root, *RESET_ROOTS):
            try:
                self.root_modes[root] = stat.S_IMODE(os.stat(root).st_mode)
            except OSError:  # a tier without /dev/shm
                continue
        for folder in self.rules.made if self.rules is not None else ():
            while any(folder.startswith(root.rstrip("/") + "/") for root in self.root_modes):
                self.kept_modes[folder] = stat.S_IMODE(os.stat(folder).st_mode)
                folder = os.path.dirname(folder)
        self.baseline = baseline.snapshot()
        if cfg.get("own_network", True):  # the host's namespace holds the host's sockets
            self.baseline["sockets"] = baseline.socket_inodes()  # netstate.py

    def start_judge(self) -> None:
        """Start the rules' compiled exec judge, and wait on what it leaves to us: after the
        configuration was answered, before any request is read (an exec meanwhile waits in
        the kernel)."""
        if self.rules is None:
            return
        self.rules.start()
        if self.rules.events >= 0:  # the listener, or the compiled judge's forwards
            self.sel.register(self.rules.events, EVENT_READ, ("exec", None))

    def take_seal(self, fd: int, reader: FrameReader, sent: int = 0, received: int = 0) -> None:
        """The channel's key: 32 bytes read from ``fd`` straight into a mapping forks leave
        out, never into a Python object (protocol.Seal); from here on every frame is sealed."""
        key = private_page(Seal.SIZE)
        got = 0
        while got < Seal.SIZE:
            n = os.readv(fd, [key[got:]])
            if n == 0:
                raise SystemExit(0)  # the host is gone
            got += n
        mac = best_mac()  # what ``ready`` named
        self.seal = Seal(key, b"S", sent, head=True, mac=mac)
        reader.seal = Seal(key, b"H", received, mac=mac)

    def start_zygote(self) -> None:
        """Fork the zygote: right after the configuration, before any request is read."""
        ruleset = getattr(self.rules, "_ruleset", -1)  # what confine() applies in each shim
        self.zygote = start_zygote(
            (self.devnull, ruleset), self.workspace.root, self.env, self.confine, self.devnull
        )

    # -- the jobs' processes -------------------------------------------------------------

    def job_of(self, pid: int) -> "Optional[Job]":
        """The job whose code ``pid`` is: its shim leads its session (one look), else the shim
        it descends from (or was reparented to), up the parents."""
        if pid not in self.shims:
            try:  # one system call, no file: the common case (code the shim started)
                session = os.getsid(pid)
            except OSError:
                session = pid
            if session != pid:
                by_session = self._job_led_by(session)
                if by_session is not None:
                    return by_session
        for hop in range(64):
            job = self.shims.get(pid)
            if job is not None:
                return job
            if self.interpreter is not None and pid in (self.interpreter.shim, self.interpreter.adopter):
                return self.interpreter.job
            try:
                with open(f"/proc/{pid}/stat", "rb") as fh:
                    data = fh.read()
                fields = data[data.rindex(b")") + 2 :].split()
                parent, session = int(fields[1]), int(fields[3])
            except (OSError, ValueError, IndexError):
                return None
            if hop == 0 and session != pid:
                by_session = self._job_led_by(session)
                if by_session is not None:
                    return by_session
            pid = parent
            if pid <= 1:
                return None
        return None

    def _job_led_by(self, shim: int) -> "Optional[Job]":
        job = self.shims.get(shim)
        if job is None and self.interpreter is not None and shim == self.interpreter.shim:
            return self.interpreter.job
        return job

    # -- the interpreter -----------------------------------------------------------------

    def finish_code(self, job: Job, payload: bytes, verdict: Optional[str] = None) -> None:
        """Report a run; ``payload`` is the interpreter's JSON (results, error), passed on as
        is, or ours with the ``verdict`` it names (``answer_code``)."""
        if self.rules is not None:
            self.rules.expire(job)
        header = {**job.report(), "ev": "result"}
        if verdict is not None:
            header["verdict"] = verdict
        self.send(header, payload)

    def answer_code(self, job: Job, name: str, value: str) -> None:
        """Report a run with an error of ours (the interpreter died, was killed at the run's
        timeout, or never ran it), marked ``verdict`` in the frame's header: the payload's
        error name is whatever the code's exception was called (``class KernelDied``), the
        header is ours alone, and the host believes only it."""
        payload = dumps({"results": [], "error": {"name": name, "value": value, "traceback": ""}})
        self.finish_code(job, payload.encode(), name)

    def drop_interpreter(self, reason: Optional[str]) -> None:
        interp = self.interpreter
        if interp is None:
            return
        self.interpreter = None
        job = interp.job
        if job is not None:
            interp.drain(job)
        interp.close(self)
        self.shims.pop(interp.shim, None)
        restarted = reason is not None  # a run ended it; None: a reset or the end, for everyone
        if reason is not None:
            name = "TimeoutError" if job is not None and job.timed_out else "KernelDied"
        else:
            name, reason = "KernelDied", "reset"
        if job is not None:
            self.answer_code(job, name, reason)
        if restarted and job is not None:
            # The run that timed out, was cancelled or whose interpreter died takes the blame;
            # those queued behind it never ran and go on in a new interpreter (they failed
            # with its TimeoutError before, never started). Each drop finishes one run: a
            # new interpreter that dies at once ends the queue's runs one by one, not forever.
            runcode.requeue(self, interp.queue)
            return
        for waiting, _ in interp.queue:
            self.answer_code(waiting, name, reason)

    def oom_kills(self) -> int:
        """Processes the sandbox's own kernel has killed for memory, if we report them."""
        if not self.report_oom:
            return 0
        try:
            with open("/proc/vmstat", "rb") as fh:
                for line in fh:
                    if line.startswith(b"oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def shutdown(self) -> None:
        self.running = False
        for job in list(self.commands.values()):
            kill_tree(job.shim, include_root=True)
        self.drop_interpreter(None)
        kill_tree(os.getpid(), include_root=False)


def main() -> None:
    # Move the protocol pipes off 0/1 so that nothing (a stray print, a child) can write
    # into them by accident; 0/1/2 become /dev/null.
    rfd = os.dup(0)
    wfd = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)
    try:  # non-dumpable: code of the same uid cannot open /proc/<us>/fd nor ptrace us
        prctl(PR_SET_DUMPABLE, 0)
    except OSError:
        pass
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    scrub_freed(True)  # before any user's byte reaches our heap (also after a reset's exec)
    sup = Supervisor(rfd, wfd)
    reader = FrameReader(max_body=1 << 40)  # the host is trusted
    if RESUME_FLAG in sys.argv:
        import reset

        reset.resume(sup, reader)
        return
    # The first frame configures us; nothing is forked before it: what we fork (the zygote,
    # a shim) inherits the limits and confinement it sets. A host that keeps a snapshot of
    # sandboxes before they are configured (the microVM's boot image) first says hello: we
    # load what every interpreter needs and answer, and the snapshot is taken while we wait
    # for the rest.
    # One frame at a time, to the byte: the zygote is forked after the configuration, and
    # must not hold a request read ahead of it (its memory reaches every interpreter).
    while True:
        prefix = read_exactly(rfd, PREFIX.size)
        if len(prefix) < PREFIX.size:
            return
        hlen, blen = PREFIX.unpack(prefix)
        reader.feed(prefix + read_exactly(rfd, hlen + blen))
        frames = reader.frames()
        if not frames:
            return
        header = frames[0][0]
        if header.get("op") != "hello":
            break
        import interpreter  # type: ignore[import-not-found]

        interpreter.preload()
        sup.send({"id": header.get("id", 0), "ev": "hello", "pid": os.getpid()})
    sup.configure(header.get("config", {}))
    unlisted = unlisted_ipc()  # gVisor's: its kernel lists neither
    kernel = sup.config.get("kernel")  # a tier with no filter of its own: what to refuse
    # No exec listener refuses memfds here (gVisor), yet under an allowlist none may be made:
    # after ours (configure made the shim's), the filter below refuses them to all.
    no_memfd = bool(sup.config.get("no_memfd"))
    if unlisted or kernel or no_memfd:
        import callfilters  # type: ignore[import-not-found]  # (only here: a start needs none of it)

        # before anything is forked; kept across a reset's exec (filters outlive an image).
        # gVisor's kernel (``unlisted``) lets code signal its init as any process: we refuse
        # it (a Linux kernel's init ignores what it has no handler for, SIGSTOP and SIGKILL
        # included; a microVM's supervisor is its kernel's init).
        calls = unlisted + ((callfilters.NR_IO_SETUP, callfilters.NR_MEMFD_SECRET) if kernel else ())
        datagrams = bool(kernel and kernel.get("datagrams"))
        callfilters.deny_calls(
            calls,
            netlink=bool(kernel),
            datagrams=datagrams,
            locks=bool(kernel),
            guard_init=os.getpid() == 1,
            no_memfd=no_memfd,
        )
    ready = {"id": header.get("id", 0), "ev": "ready", "pid": os.getpid(), "python": sys.version.split()[0]}
    if sup.rules is not None:
        ready["rules"] = sup.rules.report()
    if sup.config.get("seal"):
        ready["mac"] = best_mac()  # the seal's, for the host (protocol.Seal)
    sup.send(ready)
    if sup.config.get("no_filters"):  # the code's kernel is the host's (``callfilters.refuse_filters``)
        import callfilters  # type: ignore[import-not-found]

        # Last, after the exec listener (configure) and the filter above, off the create's
        # path (~0.8 ms), and before the judge's thread (a filter holds for the thread that
        # installs it and what it forks later: the judge spawns commands) and any fork; no
        # request is read before serve(). A reset's exec keeps it (none is installed again).
        callfilters.refuse_filters()
    sup.start_judge()
    sup.start_zygote()  # after answering (off the create's path), before reading any request
    sup.reader = reader
    if sup.config.get("seal"):  # the host sends the key right after our ready
        sup.take_seal(rfd, reader)
    sup.serve()


if __name__ == "__main__":
    main()
