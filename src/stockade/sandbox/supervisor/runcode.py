"""``run_code`` on the supervisor's side: the interpreter process it keeps (a forked shim,
two pipes for its output, two socket pairs for its requests and replies) and the queue of
runs waiting for it, one run at a time.

Apart from the supervisor, which serves the host, runs commands and owns the event loop,
because this is the only state that lives across runs (and the only part a reset or a
timeout throws away). What runs inside the interpreter process is ``interpreter.py``.

Standard library only; runs on any Python >= 3.8 found inside the sandbox.
"""

from __future__ import annotations

import _socket
import errno
import os
import select
import sys
import time
from select import EPOLLIN as EVENT_READ
from select import EPOLLOUT as EVENT_WRITE

from jobs import Job, Outputs, starts_code
from proctree import kill_group, kill_tree
from protocol import (
    CODE_REPORT_MARKS,
    MAX_CODE_REPLY,
    MAX_CODE_REPORT,
    FrameError,
    FrameReader,
    encode,
)
from reaper import forked, spawn_shim

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

    from supervisor import Supervisor

CHUNK = 1 << 16
START_S = 10.0  # how long the zygote may take to fork an interpreter (it may still be loading site)
# How long an interpreter that said hello may take no byte of a request it was sent before we
# look whether it runs at all: stopped (SIGSTOP by code), traced or ended, it is dropped; else
# it is busy (an earlier run's thread holding the GIL in one long C call) and waited for.
STALL_S = 3.0
STOPPED_READING = "the interpreter stopped reading its requests"


_environ_of: "Optional[dict[str, str]]" = None


def set_environ(env: "dict[str, str]") -> None:
    """The interpreter's environment, set in this process: by the zygote once (its forks
    find it set; setting it in each fork copies ~90 pages of the zygote's), else by the
    interpreter itself."""
    global _environ_of
    os.environ.clear()
    os.environ.update(env)
    _environ_of = env


def become_interpreter(workspace: str, env: "dict[str, str]") -> "Callable[[], None]":
    """What the interpreter process runs, forked by the zygote (or the supervisor)."""

    def target() -> None:
        # Imported and site loaded in the zygote before it forks (a no-op then), or here
        # when the supervisor forks: a fork write-protects every page its parent has
        # written, milliseconds in a VM for what site's imports write. Before the
        # workspace joins sys.path: site imports nothing of the sandbox's.
        import interpreter  # type: ignore[import-not-found]

        interpreter.preload()
        os.chdir(workspace)
        if _environ_of is not env:  # set by the zygote already, before it forked us
            set_environ(env)
        sys.path.insert(1, workspace)  # user code imports its own modules, as in a notebook
        interpreter.main(3, 4)
        os._exit(0)

    return target


def _start(sup: "Supervisor", fds: "tuple[int, int, int, int]") -> "tuple[int, int, dict[str, str]]":
    """The new interpreter, forked by the zygote; by the supervisor (under a shim) only while
    it has served no one else (its heap holds what earlier users' commands and files passed
    through it, and a fork would hand that to this user's code). Returns the pid leading
    the interpreter's session, the subreaper that adopts what its code leaves behind (the
    interpreter and the zygote, or the shim twice), and the environment the interpreter
    starts with."""
    zygote = sup.zygote
    if zygote is not None:
        try:
            return zygote.spawn(fds, START_S), zygote.pid, zygote.env
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.ENOMEM):  # out of processes: the zygote is fine
                raise
            sup.zygote = None
            if exc.errno == errno.ECONNABORTED:
                # Asked, then stopped or silent: an interpreter it forked may hold these
                # pipes, which another interpreter of ours would share (a run then waited
                # for its whole timeout). This run fails; the next starts afresh.
                why = f"the interpreter's zygote did not answer: {exc.strerror}"
                raise OSError(errno.ESRCH, why) from exc
    if not sup.clean:
        raise OSError(
            errno.ESRCH,
            "the interpreter cannot start: its zygote is gone (code killed it); reset the sandbox",
        )
    out_w, err_w, in_r, res_w = fds
    target = become_interpreter(sup.workspace.root, sup.env)
    shim = spawn_shim(forked(target), (sup.devnull, out_w, err_w), keep=(in_r, res_w), confine=sup.confine)
    return shim, shim, sup.env


def op_code(sup: "Supervisor", rid: int, h: "dict[str, Any]", body: bytes) -> None:
    """A run of ``run_code``: queued for the interpreter, started first if there is none."""
    job = Job(sup, rid, h)
    timeout = h.get("timeout")
    job.timeout = float(timeout if timeout else sup.default_timeout)  # type: ignore[attr-defined]
    queue_code(sup, job, body)


def queue_code(sup: "Supervisor", job: Job, body: bytes) -> None:
    if sup.interpreter is None:
        try:
            sup.interpreter = Interpreter(sup)
        except OSError as exc:
            if exc.errno != errno.ESRCH:  # out of processes or fds: as any failed start
                raise
            # No zygote, and we may not fork one (we have served someone else): the
            # run's answer, as when code kills its interpreter, until a reset.
            _died(sup, job, exc.strerror or str(exc))
            return
    job.deadline = None
    sup.interpreter.queue.append((job, body))
    sup.interpreter.next_run()


def cancel_code(sup: "Supervisor", rid: int) -> None:
    """The host gave up on run ``rid``: taken from the queue, or, running, killed with the
    interpreter (as at its timeout, its state lost) while the runs queued behind it go on
    in a new one (``Supervisor.drop_interpreter``). Done before the host hears back, so its
    next run finds no run of it."""
    interp = sup.interpreter
    if interp is None:
        return
    for i, (job, _) in enumerate(interp.queue):
        if job.rid == rid:
            del interp.queue[i]
            _died(sup, job, "cancelled by the host")
            return
    if interp.job is None or interp.job.rid != rid:
        return
    kill_group(interp.shim)  # before its output is drained and its pipes closed
    sup.drop_interpreter("cancelled by the host; the interpreter was restarted and its state is lost")


def requeue(sup: "Supervisor", behind: "list[tuple[Job, bytes]]") -> None:
    """The runs that were queued for an interpreter now dropped, queued for a new one in
    their order. One that cannot start it (out of processes or memory) is answered so,
    as a failed start is, and the next tries again."""
    for job, body in behind:
        try:
            queue_code(sup, job, body)
        except OSError as exc:
            _died(sup, job, f"the interpreter cannot start: {exc.strerror or exc}")


def _died(sup: "Supervisor", job: Job, why: str) -> None:
    """Answer a run that no interpreter runs: ``KernelDied``, saying ``why``."""
    sup.answer_code(job, "KernelDied", why)


class Interpreter:
    """The interpreter process and its channels; one run at a time."""

    def __init__(self, sup: "Supervisor") -> None:
        self.sup = sup
        # Its output: pipes, as a command's (code opens /dev/stdout, which a socket refuses).
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        # Its requests and replies: socket pairs, not pipes. On gVisor code can open every
        # descriptor of ours through /proc/1/fd/N, a pipe's either end: a command read a
        # concurrent run's request (its code, the sandbox's env) and answered it in the
        # interpreter's place. A socket there cannot be opened (ENXIO), on any kernel.
        ctl, in_r = _pair()
        res_r, res_w = _pair()
        try:
            # "shim" as a command's: the pid we kill and find the run's processes by (the
            # interpreter itself, when the zygote forked it); "adopter": see _start.
            self.shim, self.adopter, self.env = _start(sup, (out_w, err_w, in_r, res_w))
        except OSError:
            for fd in (out_r, out_w, err_r, err_w, ctl, in_r, res_r, res_w):
                os.close(fd)
            raise
        for fd in (out_w, err_w, in_r, res_w):
            os.close(fd)
        self.ctl_w = ctl
        self.ctl_r = res_r
        # What of the request sent last the interpreter has not taken yet, and by when it must
        # take more: written as the socket takes it, the rest on EPOLLOUT, never blocking (a
        # blocked write held the supervisor, every call with it, until the host killed it).
        self.unsent = memoryview(b"")
        self.stall_at = 0.0
        self.waiting_room = False  # ctl_w registered for EPOLLOUT
        # Unbuffered (print()s are a write each): read in gathers, as a command's (jobs.py).
        self.out = Outputs(sup, ("interpreter", self))
        # Code can write to the reply channel too: a larger report is no interpreter's (dropped).
        self.reader = FrameReader(max_body=MAX_CODE_REPLY)
        self.pid = 0  # the interpreter's, from its first frame (sent before any code ran)
        self.job: Optional[Job] = None
        self.queue: list[tuple[Job, bytes]] = []
        # Whether any run's code has run here (warm-ups aside): from then on what runs
        # during a run can be an earlier run's (a thread, a signal handler, a gc callback, a
        # name it rebound), which no look from outside rules out.
        self.used = False
        self.out.add(out_r, 1)
        self.out.add(err_r, 2)
        os.set_blocking(res_r, False)
        os.set_blocking(ctl, False)
        sup.sel.register(res_r, EVENT_READ, ("interpreter", self))

    def wait_started(self, timeout: float) -> None:
        """Block until the interpreter process has said hello (its site loaded, ready for
        code), it died, or ``timeout``: a reset that promises a warm interpreter answers
        only then, so that a pool hands out a sandbox whose first run does not wait."""
        deadline = time.monotonic() + timeout
        while not self.pid and self is self.sup.interpreter:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if select.select([self.ctl_r], [], [], left)[0]:
                self.on_readable(self.ctl_r)

    def next_run(self) -> None:
        """Send the first queued run to the interpreter process, unless one is running."""
        if self.job is not None or not self.queue:
            return
        job, body = self.queue.pop(0)
        self.job = job
        starts_code(self.sup, job, not self.used)
        self.used = self.used or bool(body)  # an empty run (a spare's warm-up) runs no code
        job.started = time.monotonic()
        job.deadline = job.started + job.timeout  # type: ignore[attr-defined]
        # The most its results and error may take (the interpreter cuts them to it): the
        # sandbox's output_bytes, read per run (a snapshot's restore may have changed it).
        cap = min(self.sup.output_cap, MAX_CODE_REPORT)
        header: dict[str, object] = {"id": job.rid, "cap": cap}
        job.report_cap = cap + CODE_REPORT_MARKS
        if self.sup.reseed:
            header["reseed"] = True
            self.sup.reseed = False
        if self.env != self.sup.env:  # given after a resume, or after its zygote's fork
            header["env"] = self.sup.env
            self.env = self.sup.env
        self.unsent = memoryview(encode(header, body))
        self.stall_at = job.started + (STALL_S if self.pid else START_S)
        self.send()

    def send(self) -> None:
        """Write what the interpreter has not taken of the request, as much as its socket
        takes now; the rest when it has room (EPOLLOUT). One that takes nothing by
        ``stall_at`` (or the run's deadline) is dropped: ``stalled``."""
        while self.unsent:
            try:
                sent = os.write(self.ctl_w, self.unsent)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.sup.drop_interpreter("the interpreter process died")
                return
            self.unsent = self.unsent[sent:]
            self.stall_at = time.monotonic() + (STALL_S if self.pid else START_S)
        if bool(self.unsent) != self.waiting_room:
            self.waiting_room = bool(self.unsent)
            if self.waiting_room:
                self.sup.sel.register(self.ctl_w, EVENT_WRITE, ("interpreter", self))
            else:
                self.sup.sel.unregister(self.ctl_w)

    def stalled(self, now: float) -> bool:
        """Whether a request the interpreter was sent is still not all taken, by its time or
        the run's deadline, because the interpreter does not run: its code never ran (the
        interpreter reads a request whole before it runs it), so the run's answer is not a
        timeout but ``STOPPED_READING``. One that runs is looked at again ``STALL_S`` on:
        a thread of an earlier run holding the GIL in one C call (``7 ** 10 ** 7``, a big
        sort) keeps the reader from the request as long, and dropping it lost its state;
        the run's deadline ends it, as the timeout it is."""
        if not self.unsent or self.job is None:
            return False
        due = self.job.due()
        if now < self.stall_at and (due is None or now < due):
            return False
        if self.pid and _running(self.pid):
            self.stall_at = now + STALL_S
            return False
        return True

    def on_readable(self, fd: int) -> None:
        """Output of the code on its stdout or stderr, a frame on the reply channel, or room
        on the request channel for what is left of a request."""
        sup = self.sup
        if self is not sup.interpreter:
            return
        if fd == self.ctl_w:
            self.send()
            return
        if fd in self.out.fds:
            # The code closing its stdout or stderr is not a death: the reply channel says that.
            self.out.gather(self.job)
            return
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        if not data:
            sup.drop_interpreter("the interpreter process died")
            return
        self.reader.feed(data)
        try:
            frames = self.reader.frames()
        except FrameError:
            sup.drop_interpreter("the interpreter sent a malformed reply")
            return
        for reply, payload in frames:
            if reply.get("ev") == "hello":
                if not self.pid and isinstance(reply.get("pid"), int):
                    self.pid = reply["pid"]
                continue
            job = self.job
            if job is None or reply.get("id") != job.rid:
                continue
            self.drain(job)
            self.job = None
            # A run's processes end with it, like a command's: none outlives its timeout.
            kill_tree(self.adopter, include_root=False, spare=self.pid)
            if len(payload) > job.report_cap:
                # Not the interpreter's (it keeps to the cap): code wrote it to the channel.
                note = f"the report was {len(payload)} bytes, over the sandbox's output_bytes"
                sup.answer_code(job, "ReportTooLarge", note)
            else:
                sup.finish_code(job, payload)
        self.next_run()

    def drain(self, job: "Job") -> None:
        """Pass on to ``job`` what its code wrote and we have not read yet."""
        self.out.drain(job)

    def close(self, sup: "Supervisor") -> None:
        self.out.close()
        if self.waiting_room:
            sup.sel.unregister(self.ctl_w)
            self.waiting_room = False
        sup.sel.unregister(self.ctl_r)
        os.close(self.ctl_r)
        os.close(self.ctl_w)
        kill_tree(self.shim, include_root=True)
        if self.adopter != self.shim:  # what its code left behind, now the zygote's
            kill_tree(self.adopter, include_root=False)


def _running(pid: int) -> bool:
    """Whether process ``pid`` can still read: its main thread (the one that reads requests)
    neither stopped (T: SIGSTOP; t: held by a tracer) nor ended (Z, X), nor the process gone.
    Linux and gVisor both say so in its ``stat``."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        data = os.read(fd, 4096)
    except OSError:
        return False
    finally:
        os.close(fd)
    state = data[data.rfind(b")") + 2 :][:1]
    return bool(state) and state not in b"TtZX"


def _pair() -> "tuple[int, int]":
    """A connected pair of unix stream sockets, as two descriptors (close-on-exec, blocking)."""
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    return ours.detach(), theirs.detach()
