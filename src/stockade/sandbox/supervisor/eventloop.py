"""The supervisor's event loop and its dispatch: how it serves the host once started.

One epoll (``Poller``) waits on the host's pipe, the commands' and the interpreter's pipes,
the exec listener and the egress relay. Each turn checks the deadlines first, then gathers
the output that is due, then routes each ready descriptor: the host's frames are read into
one buffer and handled in order (a ``reset`` among them takes the rest), each request is
dispatched to its op (``OPS``: the files', commands' and ``run_code``'s modules; the rest are
the ``op_`` methods here), and the children that ended are reaped.

``EventLoop`` is the base of ``Supervisor`` (``supervisor.py``), which sets up the state read
here (in its ``__init__``), starts and configures the sandbox and ends the interpreter and
itself: apart so that the loop and what it routes read without the start. Imported at every
start, by the supervisor after its ``sys.path`` fix.

Standard library only; runs on any Python >= 3.8 found inside the sandbox.
"""

from __future__ import annotations

# Start-up time is cold-start time: only C modules and tiny pure-Python ones here
# (no typing, selectors, ctypes, json, enum-based signal), heavy ones imported lazily.
import _signal as signal
import os
import select
import sys
import time

import files
import jobs
import runcode
from fileops import PathRefused, _os_error
from proctree import kill_group, kill_tree
from protocol import Seal, encode
from reaper import IGNORED_SIGNALS

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Optional

EVENT_READ = select.EPOLLIN

# The ops served by other modules, each called as ``handler(sup, rid, header, body)``; the
# rest are the ``op_`` methods below.
OPS = {**files.OPS, "exec": jobs.op_exec, "code": runcode.op_code}


class _Key:
    __slots__ = ("data", "fd")

    def __init__(self, fd: int, data: object) -> None:
        self.fd = fd
        self.data = data


class Poller:
    """The part of selectors we use, on epoll (selectors costs milliseconds to import)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._keys: dict[int, _Key] = {}

    def register(self, fd: int, events: int, data: object) -> None:
        self._epoll.register(fd, events)
        self._keys[fd] = _Key(fd, data)

    def unregister(self, fd: int) -> None:
        if self._keys.pop(fd, None) is None:
            raise KeyError(fd)
        self._epoll.unregister(fd)

    def modify(self, fd: int, events: int) -> None:
        self._epoll.modify(fd, events)

    def holds(self, key: _Key) -> bool:
        """Whether ``key`` is still registered: an earlier event of the same turn (or a
        deadline) may have closed its descriptor, whose number a new one may now have."""
        return self._keys.get(key.fd) is key

    def select(self, timeout: "float | None") -> "list[tuple[_Key, int]]":
        try:
            ready = self._epoll.poll(-1 if timeout is None else timeout)
        except InterruptedError:
            return []
        return [(self._keys[fd], ev) for fd, ev in ready if fd in self._keys]


class EventLoop:
    """The supervisor's event loop and its dispatch, over the state ``Supervisor`` sets up."""

    # -- the loop ------------------------------------------------------------------------

    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in IGNORED_SIGNALS:  # we are the sandbox's init: nothing in it may stop us
            signal.signal(sig, signal.SIG_IGN)
        self.sel.register(self.rfd, EVENT_READ, ("host", None))
        self.sel.register(wake_r, EVENT_READ, ("wake", None))
        while self.running:
            timeout = self._next_timeout()
            ready = self.sel.select(timeout)
            # Deadlines first: a flood of output from the tree to kill must not come before it.
            self._check_deadlines()
            self._gather_due()
            relayed_only = bool(ready)  # a turn that only relayed egress bytes has nothing to reap
            for key, events in ready:
                if not self.sel.holds(key):
                    continue
                kind, obj = key.data
                relayed_only = relayed_only and kind == "egress"
                fd = key.fd
                if kind == "host":
                    self._on_host()
                elif kind == "wake":
                    try:
                        while os.read(fd, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    self.reap()
                elif kind == "out":
                    jobs.on_output(self, obj)
                elif kind == "stdin":
                    jobs.on_stdin(self, obj)
                elif kind == "interpreter":
                    obj.on_readable(fd)
                elif kind == "exec":
                    assert self.rules is not None
                    self.rules.on_exec(fd)
                elif kind == "egress":
                    obj.on_event(fd, events)
            # A child's end always comes with a turn of its own (SIGCHLD writes to the wake
            # pipe), so a turn of relayed bytes skips the waitpid: on gVisor a system call
            # costs 12-30 µs, and a request through the relay takes four or five turns.
            if not relayed_only:
                self.reap()

    def _next_timeout(self) -> Optional[float]:
        deadlines = [d for d in (j.due() for j in self.commands.values()) if d]
        now = time.monotonic()
        waits = [j.out.wait(now) for j in self.commands.values()]
        if self.interpreter is not None:
            waits.append(self.interpreter.out.wait(now))
        due = self.interpreter.job.due() if self.interpreter and self.interpreter.job else None
        if due:
            deadlines.append(due)
        if self.interpreter is not None and self.interpreter.unsent:
            deadlines.append(self.interpreter.stall_at)
        left = [max(0.0, d - now) for d in deadlines] + [w for w in waits if w is not None]
        return min(left) if left else None

    def _gather_due(self) -> None:
        """Read the output pipes whose gather is due (jobs.Outputs)."""
        now = time.monotonic()
        interp = self.interpreter
        if interp is not None and interp.out.wait(now) == 0:
            interp.out.gather(interp.job)
        for job in list(self.commands.values()):
            if job.out.wait(now) == 0:
                jobs.on_output(self, job)

    def reap(self) -> None:
        """Every child that ended: a command's shim, the interpreter, the zygote."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            job = self.shims.pop(pid, None)
            if job is not None:
                jobs.exited(self, job, status)
            elif self.interpreter is not None and pid == self.interpreter.shim:
                self.drop_interpreter("the interpreter process died")
            elif self.zygote is not None and pid == self.zygote.pid:
                self.zygote.alive = False  # its pid is free again: never spare nor signal it

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        jobs.check_deadlines(self, now)
        interp = self.interpreter
        if interp and interp.stalled(now):
            kill_group(interp.shim)
            self.drop_interpreter(runcode.STOPPED_READING)
            return
        due = interp.job.due() if interp and interp.job else None
        if interp and interp.job and due and now >= due:
            interp.job.timed_out = True
            kill_group(interp.shim)  # before its output is drained and its pipes closed
            self.drop_interpreter("timed out; the interpreter was restarted and its state is lost")

    # -- the host's frames ----------------------------------------------------------------

    def _on_host(self) -> None:
        try:
            n = os.readv(self.rfd, [self.inbuf])
        except (BlockingIOError, InterruptedError):
            return
        if not n:
            self.shutdown()
            return
        self.inbuf_written = max(self.inbuf_written, n)
        with memoryview(self.inbuf) as view:
            self.reader.feed(view[:n])
        self.handle(self.reader.frames())

    def wipe_input(self) -> None:
        """Zeros over the last user's requests and uploads in the read buffer."""
        if self.inbuf_written:
            self.inbuf[: self.inbuf_written] = bytes(self.inbuf_written)
            self.inbuf_written = 0

    def _import_reset(self) -> None:
        """Load reset.py, killing the code first if its file cannot be opened: on gVisor
        the code can hold every host descriptor its kernel may (files it mapped), and then
        the kernel opens nothing, for us neither. Killed, it frees them; the reset kills it
        anyway."""
        try:
            import reset  # noqa: F401 - loaded for handle(), which imports it again
        except (OSError, ImportError):
            spare = self.zygote.pid if self.zygote is not None and self.zygote.alive else 0
            kill_tree(os.getpid(), include_root=False, spare=spare)
            sys.modules.pop("reset", None)

    def handle(self, frames: list[tuple[dict[str, Any], bytes]]) -> None:
        for i, (header, body) in enumerate(frames):
            rid = header.get("id", 0)
            if header.get("op") == "reset":
                self._import_reset()
                import reset  # here, not at the top: a sandbox's start needs none of it

                # Requests behind the reset are for the fresh supervisor it execs (or read
                # again by us): sealed again as they came, their count taken back to match.
                seal = self.reader.seal
                again = None
                if seal is not None:
                    seal.count -= len(frames) - i - 1
                    again = Seal(seal.key, seal.direction, seal.count, mac=seal.mac)
                behind = b"".join(encode(h, b, again) for h, b in frames[i + 1 :])
                rest = behind + self.reader.take_pending()
                reset.run(self, rid, header, rest)
                self.handle(self.reader.frames())  # not reached when the reset exec'd
                return
            try:
                self.dispatch(rid, header, body)
            except PathRefused as exc:
                self.send({"id": rid, "ev": "error", "kind": exc.kind, "message": str(exc)})
            except OSError as exc:
                self.send(_os_error(rid, exc))
            except Exception as exc:  # never die on one bad request
                self.send(
                    {"id": rid, "ev": "error", "kind": "internal", "message": f"{type(exc).__name__}: {exc}"}
                )

    # -- dispatch ------------------------------------------------------------------------

    def dispatch(self, rid: int, h: dict[str, Any], body: bytes) -> None:
        op = h.get("op")
        on_request = OPS.get(op)
        if on_request is not None:
            on_request(self, rid, h, body)
            return
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            raise PathRefused("internal", f"unknown op {op!r}")
        handler(rid, h, body)

    def op_verdict(self, rid: int, h: dict[str, Any], body: bytes) -> None:
        """The host's answer to an exec that waits for approval."""
        if self.rules is not None:
            why = h.get("why")
            why = why if isinstance(why, str) else ""
            self.rules.on_verdict(int(h.get("req", 0)), h.get("allow") is True, why)
        self.send({"id": rid, "ev": "done"})

    def op_cut(self, rid: int, h: dict[str, Any], body: bytes) -> None:
        """Stop the commands and the code running now, each as ``cancel`` ends one: whoever
        asked for them gave them up (an MCP client's cancel names no request of ours). The
        sandbox stays."""
        for req in list(self.commands):
            jobs.cancel_command(self, req)
        interp = self.interpreter
        if interp is not None and interp.job is not None:
            runcode.cancel_code(self, interp.job.rid)
        self.send({"id": rid, "ev": "done"})

    def op_execs(self, rid: int, h: dict[str, Any], body: bytes) -> None:
        """The execs judged while no call ran, not yet handed over with a call's report
        (``execrecords.Between``): the host takes them before a reset and at close."""
        taken = self.rules.take_between() if self.rules is not None else {}
        self.send({"id": rid, "ev": "done", **taken})

    def op_ping(self, rid: int, h: dict[str, Any], body: bytes) -> None:
        self.send({"id": rid, "ev": "done", "pid": os.getpid()})

    def op_reseed(self, rid: int, h: dict[str, Any], body: bytes) -> None:
        """Sent by the host first thing after a restore from a memory snapshot. From a
        microVM's ready image (made without them), with the sandbox's ``env``, its whole
        environment, and its ``egress`` relay: applied as ``configure`` applies them, and kept
        in the configuration a reset hands over. Commands get the environment from here on,
        the interpreter with its next run (``Interpreter.next_run``). With ``timeout`` and
        ``output_cap``, the sandbox's own (read per request, so no image holds them)."""
        self.reseed = self.interpreter is not None  # a later interpreter is forked, and reseeds then
        late = {k: h[k] for k in ("timeout", "output_cap") if k in h}
        if late:
            self.output_cap = int(late.get("output_cap", self.output_cap))
            self.default_timeout = float(late.get("timeout", self.default_timeout))
            self.config = {**self.config, **late}
        env = h.get("env")
        if isinstance(env, dict):
            self.env = {str(k): str(v) for k, v in env.items()}
            self.config = {**self.config, "env": self.env}
        relay = h.get("egress")
        if relay and self.egress is None:
            import egress  # type: ignore[import-not-found]

            self.egress = egress.make(self.sel, relay)
            self.config = {**self.config, "egress": relay}
        self.send({"id": rid, "ev": "done"})

    def op_cancel(self, rid: int, h: dict[str, Any], body: bytes) -> None:
        """The host gave up on command or run ``req`` (its caller was interrupted): ended now,
        not at its timeout, before this answer."""
        req = h.get("req")
        if isinstance(req, int):
            jobs.cancel_command(self, req)
            runcode.cancel_code(self, req)
        self.send({"id": rid, "ev": "done"})

    def op_kill_kernel(self, rid: int, h: dict[str, Any], body: bytes) -> None:
        # "kernel" in the op's name (and in the error "KernelDied") is the protocol's old word
        # for the interpreter process, kept on the wire so hosts and guests of any age agree.
        self.drop_interpreter(None)
        self.send({"id": rid, "ev": "done"})
