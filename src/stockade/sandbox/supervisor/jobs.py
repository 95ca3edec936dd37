"""What the supervisor runs for the host, one object per request: a ``Job`` (a run of
``run_code``) counts and caps its output and says what its final frame reports; a
``CommandJob`` adds the shim, the pipes and the exit status of a command. And a command's
life (``op_exec`` to its ``exit`` frame): started in a shim (a forked child subreaper) with
its own pipes, its output read and capped, its stdin written as the pipe takes it, its end
reaped and reported, and everything of it killed at its deadline.

Apart from the supervisor so that its event loop reads as routing (it calls in here when a
command's pipe, exit or deadline comes up); the interpreter's queue (``runcode.py``) holds
plain jobs. How a shim is forked is ``reaper.py``, how a tree is killed ``proctree.py``.
One module with the jobs, not one more beside them: each module the supervisor imports is a
file found, read and loaded at every sandbox's start.

Standard library only; runs on any Python >= 3.8 found inside the sandbox.
"""

from __future__ import annotations

import errno
import os
import time
from select import EPOLLIN as EVENT_READ
from select import EPOLLOUT as EVENT_WRITE

from proctree import kill_descendants, kill_group, kill_tree, own_children, wait_gone
from reaper import spawn_program, spawn_shim, spawned

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Optional

    from supervisor import Supervisor


# How long the approvals of one call may stop its clock in all when the host says nothing
# (an older host): ``Limits.approval_wait_s``'s default.
HOLD_CAP_S = 900.0


class Job:
    def __init__(self, sup: "Supervisor", rid: int, h: "dict[str, Any]") -> None:
        """Run ``rid``, asked by the host's request ``h``."""
        self.sup = sup
        self.rid = rid
        self.started = time.monotonic()
        self.deadline: Optional[float] = None
        self.counts = {1: 0, 2: 0}
        self.sent = {1: 0, 2: 0}
        self.timed_out = False
        self.oom_start = sup.oom_kills()
        self.execs: "list[dict[str, Any]]" = []  # what the rules judged (supervisor/rules.py)
        self.exec_count = 0
        self.exec_json = self.exec_chars = 0  # of the records kept (execrecords.fits)
        self.exec_width = 1
        # Whether nothing but this job's own code can start a process credited to it, so that
        # a human's approval of the call may answer for its execs (``starts_code``).
        self.own = False
        # A run_code's: the most bytes its report may take (``Interpreter.next_run``).
        self.report_cap = 0
        # Its execs waiting for the host's approver, and since when: a human's time is not
        # the job's, so its deadline stands still meanwhile (``hold``, ``release``), but for
        # at most ``hold_cap`` seconds of the call in all (the host's ``approval_wait``,
        # ``Limits.approval_wait_s``), counted as the wall time during which any waited: code
        # that keeps one exec waiting at all times (a loop of new ``rm -r`` argvs beside a
        # ``sleep``) stopped the clock for ever.
        self.held = 0
        self.held_since = 0.0
        self.hold_cap = float(h.get("approval_wait", HOLD_CAP_S))
        self.credited = 0.0  # of hold_cap, taken by the waits ended so far

    def hold(self) -> None:
        """One of its execs waits for the host's approver: the deadline stands still until
        it is answered, while what is left of ``hold_cap`` lasts."""
        if self.held == 0:
            self.held_since = time.monotonic()
        self.held += 1

    def release(self) -> None:
        """An exec's approval was answered (or dropped): once none waits, the deadline is
        moved on by the time they waited together (overlapping waits count once), as far as
        ``hold_cap`` lets it."""
        if self.held <= 0:
            return
        self.held -= 1
        if self.held == 0 and self.deadline is not None and not self.timed_out:
            gained = min(time.monotonic() - self.held_since, max(0.0, self.hold_cap - self.credited))
            self.credited += gained
            self.deadline += gained

    def due(self) -> "Optional[float]":
        """The deadline that runs now: while an exec of its waits for an approval, moved on by
        what is left of ``hold_cap`` (a job timed out is killed again all the same: its
        approvals answer no one)."""
        if not self.held or self.timed_out or self.deadline is None or self.held_since >= self.deadline:
            return self.deadline
        return self.deadline + max(0.0, self.hold_cap - self.credited)

    def report(self) -> "dict[str, Any]":
        """What every final frame says of the job besides its own outcome."""
        out = {
            "id": self.rid,
            "timed_out": self.timed_out,
            "duration": time.monotonic() - self.started,
            "stdout_bytes": self.counts[1],
            "stderr_bytes": self.counts[2],
        }
        if self.sup.report_oom:
            out["oom_kills"] = self.sup.oom_kills() - self.oom_start
        if self.exec_count:
            out["execs"] = self.execs
            out["exec_count"] = self.exec_count
        return out

    def output(self, fd: int, data: bytes) -> None:
        self.counts[fd] += len(data)
        room = self.sup.output_cap - self.sent[fd]
        if room > 0:
            part = data[:room]
            self.sent[fd] += len(part)
            self.sup.send({"id": self.rid, "ev": "out", "fd": fd}, part)


def starts_code(sup: "Supervisor", job: Job, fresh: bool) -> None:
    """``job``'s code starts. A human's approval of its call answers for the execs credited to
    it (``own``) only if no code of another call can run while it does: the interpreter is
    ``fresh`` (none, or no code ran in it before: what a run leaves there runs on between
    runs and during the next, a thread, a signal handler, a rebound ``os.read``, and no look
    from outside rules that out), and no other job is running. Code of one call can write
    into the memory of another's processes (``/proc/PID/mem``: the same uid), so each job
    already running loses it too. What a call left in files is what a later one chooses to
    run (a script, a module it imports), not counted here."""
    interp = sup.interpreter
    others: "list[Job]" = [j for j in sup.commands.values() if j is not job]
    if interp is not None and interp.job is not None and interp.job is not job:
        others.append(interp.job)
    job.own = fresh and not others
    for other in others:
        other.own = False


CHUNK = 1 << 16
# After a read of a run's output, how long its pipes gather before the next: an unbuffered
# program (run_code's print()s, ``python3 -u``, a shell's echo loop) writes once a line, and
# waking for each write (a read, a frame to the host, the host's turn) cost ~16 us a write,
# 50 times a buffered program's. Unwatched meanwhile, a write is a copy into the pipe. What a
# quiet program writes first is read at once; what follows it, this late.
GATHER_S = 0.002
# A writer that fills this much of a pipe (64 KiB) in GATHER_S is not slowed by our wake-ups
# but would be by a wait, blocked on the full pipe (100 MB of `head -c`: 0.3 s read as it
# comes, 5.2 s gathered): its pipes are read as they fill, as before gathering, for FAST_S
# after the last read that fast (a rate seen read by read is noisy where both it and we
# wait for a core; each wrong guess costs it a gather's wait).
BULK = CHUNK // 2
FAST_S = 0.01


class Outputs:
    """The stdout and stderr pipes of a run (a command's, or the interpreter's), read in
    gathers: after a read they are left unwatched for GATHER_S while more gathers in them,
    then read again (``gather`` when ``wait`` says 0); once quiet, watched again. Every end
    of a run drains them first (``drain``): nothing written is left behind."""

    def __init__(self, sup: "Supervisor", key: "tuple[str, object]") -> None:
        self.sup = sup
        self.key = key  # what the loop's poller hands back for a readable pipe
        self.fds: dict[int, int] = {}  # pipe: its stream (1, 2), stdout first
        # When the pipes, unwatched, are read again; None: watched.
        self.due: Optional[float] = None
        self.read_at = 0.0  # when they were last read with something in them
        self.fast_until = 0.0  # read as they fill until then (``next_read``)

    def add(self, fd: int, stream: int) -> None:
        os.set_blocking(fd, False)
        self.fds[fd] = stream
        if self.due is None:
            self.sup.sel.register(fd, EVENT_READ, self.key)

    def wait(self, now: float) -> "Optional[float]":
        """Seconds until the pipes are read again (``gather`` at 0), or None: watched."""
        if self.due is None:
            return None
        if self.due - now > GATHER_S:  # a clock that went back (a snapshot restored elsewhere)
            self.due = now
        return max(0.0, self.due - now)

    def gather(self, job: "Optional[Job]") -> bool:
        """Read once what was written on each pipe and pass it on to ``job``; then leave the
        pipes unwatched for GATHER_S, or, if there was nothing, watch them again. A full
        read is read on at the next turn, not after a wait: a large write is never slowed.
        Whether a pipe ended (its writers all gone: it is closed)."""
        got = full = ended = False
        n = 0
        for fd, stream in list(self.fds.items()):
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                continue
            if not data:
                self._close(fd)
                ended = True
                continue
            got = True
            n += len(data)
            full = full or len(data) == CHUNK
            if job is not None:
                job.output(stream, data)
        due = None
        if got:
            now = time.monotonic()
            due = self.next_read(n, full, now)
            self.read_at = now
        if due is not None and self.due is None:
            for fd in self.fds:
                self.sup.sel.unregister(fd)
        elif due is None and self.due is not None:
            for fd in self.fds:
                self.sup.sel.register(fd, EVENT_READ, self.key)
        self.due = due
        return ended

    def next_read(self, n: int, full: bool, now: float) -> "Optional[float]":
        """When to read again after a read of ``n`` bytes at ``now`` (None: when readable).
        A writer as fast as BULK a GATHER_S is read as it writes (for FAST_S from then); a
        full read after a quiet spell is read on at the next turn; anything else gathers."""
        if n * GATHER_S >= BULK * max(0.0, now - self.read_at):
            self.fast_until = now + FAST_S
        if now < self.fast_until:
            return None
        return now if full else now + GATHER_S

    def drain(self, job: "Optional[Job]") -> bool:
        """Pass on to ``job`` all that was written and not read yet. Whether a pipe ended."""
        ended = False
        for fd, stream in list(self.fds.items()):
            while True:
                try:
                    data = os.read(fd, CHUNK)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    self._close(fd)
                    ended = True
                    break
                if job is not None:
                    job.output(stream, data)
        return ended

    def close(self) -> None:
        for fd in list(self.fds):
            self._close(fd)

    def _close(self, fd: int) -> None:
        if self.due is None:
            self.sup.sel.unregister(fd)
        os.close(fd)
        del self.fds[fd]


class CommandJob(Job):
    def __init__(self, sup: "Supervisor", rid: int, h: "dict[str, Any]") -> None:
        super().__init__(sup, rid, h)
        self.shim = 0
        self.status: Optional[int] = None
        self.out = Outputs(sup, ("out", self))
        self.stdin_fd = -1
        self.stdin_buf = b""

    def finished(self) -> bool:
        return self.status is not None and not self.out.fds


# What an exec of the compiled shim itself fails with where the kernel will not run it.
SHIM_REFUSED = (errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.ENOENT)
# Why a command may not start that a reset cures: out of processes, memory or descriptors.
LIMITS_REACHED = (errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE)
# A timed-out command not yet ended is killed again this often (see check_deadlines).
AGAIN_S = 0.1


def op_exec(sup: "Supervisor", rid: int, h: dict[str, Any], body: bytes) -> None:
    argv = [str(a) for a in h["argv"]]
    env = dict(sup.env)
    env.update({str(k): str(v) for k, v in h.get("env", {}).items()})
    cwd = h.get("cwd") or sup.workspace.root
    if not cwd.startswith("/"):
        cwd = sup.workspace.root + "/" + cwd
    job = CommandJob(sup, rid, h)
    timeout = h.get("timeout")
    job.deadline = time.monotonic() + float(timeout if timeout else sup.default_timeout)
    interp = sup.interpreter
    starts_code(sup, job, interp is None or not interp.used)
    made: list[int] = []
    try:
        out_r, out_w = os.pipe()
        made += (out_r, out_w)
        err_r, err_w = os.pipe()
        made += (err_r, err_w)
        has_stdin = bool(h.get("stdin"))
        if has_stdin:
            in_r, in_w = os.pipe()
            made += (in_r, in_w)
        else:
            in_r, in_w = sup.devnull, -1
        fds = (in_r, out_w, err_w)
        if sup.shim >= 0:
            job.shim = compiled_shim(sup, argv, env, cwd, fds)
        if not job.shim:  # no compiled shim here, or not for this command: a fork of ours
            job.shim = spawn_shim(spawned(argv, env, cwd), fds, confine=sup.confine)
    except (OSError, ValueError) as exc:
        # Out of processes or descriptors (a thread or fork bomb the code left behind), or
        # a command line the kernel refuses: the command could not start, which is a
        # result like any failed exec.
        for fd in made:
            os.close(fd)
        why = getattr(exc, "strerror", None) or str(exc)
        note = f"stockade: cannot start {argv[0]}: {why}\n"
        if getattr(exc, "errno", None) in LIMITS_REACHED:
            note = note[:-1] + " (the sandbox's process or file limit is reached; reset() or close it)\n"
        job.output(2, note.encode())
        sup.send(
            {
                "id": rid,
                "ev": "exit",
                "exit_code": 126,
                "signal": None,
                "timed_out": False,
                "duration": time.monotonic() - job.started,
                "stdout_bytes": 0,
                "stderr_bytes": len(note),
            }
        )
        return

    for fd in (out_w, err_w) + ((in_r,) if has_stdin else ()):
        os.close(fd)
    job.out.add(out_r, 1)
    job.out.add(err_r, 2)
    if has_stdin:
        job.stdin_fd = in_w
        job.stdin_buf = body
        os.set_blocking(in_w, False)
        sup.sel.register(in_w, EVENT_WRITE, ("stdin", job))
    sup.commands[rid] = job
    sup.shims[job.shim] = job


def compiled_shim(
    sup: "Supervisor", argv: "list[str]", env: "dict[str, str]", cwd: str, fds: "tuple[int, int, int]"
) -> int:
    """The command under the compiled shim: its pid, or 0 for the Python shim. A kernel that
    will not run it (a memfd it treats as ``noexec``) is told once: the sandbox keeps the
    Python shim from then on."""
    try:
        if sup.rules is None:
            return spawn_program(sup.shim, argv, env, cwd, fds)
        return int(sup.rules.spawn(sup.shim, argv, env, cwd, fds))
    except OSError as exc:
        if exc.errno not in SHIM_REFUSED:
            raise
    os.close(sup.shim)
    sup.shim = -1
    return 0


def forget_commands(sup: "Supervisor") -> None:
    """Close the pipes of every command (their processes are killed): no exec does now."""
    for job in sup.commands.values():
        job.out.close()
        close_stdin(sup, job)
    sup.commands.clear()
    sup.shims.clear()


def on_output(sup: "Supervisor", job: CommandJob) -> None:
    """A pipe of the command's is readable, or their gather is due (``Outputs``)."""
    if job.out.gather(job):
        maybe_finish(sup, job)


def on_stdin(sup: "Supervisor", job: CommandJob) -> None:
    try:
        n = os.write(job.stdin_fd, job.stdin_buf[:CHUNK])
        job.stdin_buf = job.stdin_buf[n:]
    except (BrokenPipeError, OSError):
        job.stdin_buf = b""
    if not job.stdin_buf:
        close_stdin(sup, job)


def close_stdin(sup: "Supervisor", job: CommandJob) -> None:
    if job.stdin_fd >= 0:
        sup.sel.unregister(job.stdin_fd)
        os.close(job.stdin_fd)
        job.stdin_fd = -1


def exited(sup: "Supervisor", job: CommandJob, status: int) -> None:
    """Its shim ended (with everything it adopted): reported once its pipes are drained too."""
    job.status = status
    close_stdin(sup, job)
    sweep_strays(sup)
    # What it wrote last may wait in a gather (``Outputs``): read now, the report not held
    # back by it. A pipe a writer still holds (a stray not yet gone) ends in its turn.
    job.out.drain(job)
    maybe_finish(sup, job)


def check_deadlines(sup: "Supervisor", now: float) -> None:
    for job in list(sup.commands.values()):
        due = job.due()
        if not due or now < due:
            continue
        # Until the job ends, again every AGAIN_S: what a kill missed (a pipe's last holder)
        # keeps the call from its report, and on gVisor a kill can miss a process.
        job.deadline = now + AGAIN_S
        if not job.timed_out:
            job.timed_out = True
            if not kill_group(job.shim):
                kill_tree(job.shim, include_root=True)
            # else the shim is dead and whatever of its tree outlived the group's kill is
            # adopted by us: swept when the shim is reaped (``exited``), before the report
            continue
        if job.status is None:  # not reaped: the shim's pid is still its own
            kill_group(job.shim)
        sweep_strays(sup)


def cancel_command(sup: "Supervisor", rid: int) -> None:
    """The host gave up on command ``rid``: killed now as at its deadline (reported, to no
    one, once reaped)."""
    job = sup.commands.get(rid)
    if job is not None and not job.timed_out:
        job.held = 0  # nobody waits for its approvals either
        job.deadline = time.monotonic()
        check_deadlines(sup, job.deadline)


def sweep_strays(sup: "Supervisor") -> None:
    """Kill the processes of ours that are no shim's (orphans of a shim someone killed, and
    all they forked), until none is left: what one forks as it dies is adopted by us and
    found the round after. One scan of /proc a round for all of them, not one per orphan: a
    bomb whose every process leads its own session leaves dozens, and beside them on gVisor
    a scan takes up to seconds."""
    known = {shim for shim, job in sup.shims.items() if not job.timed_out}
    if sup.interpreter is not None:
        known.add(sup.interpreter.shim)
    if sup.zygote is not None and sup.zygote.alive:
        known.add(sup.zygote.pid)
    fast = sup.rules.fast if sup.rules is not None else None
    children = own_children(frozenset((fast.tid,)) if fast is not None else frozenset())
    if children is not None and children <= known:
        # No stray: every process of ours descends from a child of ours, and each of those
        # is a shim, the interpreter's or the zygote (an orphan comes to us as a child, when
        # a shim or a stray dies: that death is reaped, and swept, in its turn).
        return
    for _ in range(1000):
        found = kill_descendants(os.getpid(), protect=frozenset(known))
        if not found:
            return
        wait_gone(found, 0.001)


def maybe_finish(sup: "Supervisor", job: CommandJob) -> None:
    if not job.finished() or job.rid not in sup.commands:
        return
    del sup.commands[job.rid]
    status = job.status or 0
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + (sig or 0)
    if sup.rules is not None:
        sup.rules.expire(job)
    sup.send({**job.report(), "ev": "exit", "exit_code": code, "signal": sig})
