"""The zygote: the process every interpreter is forked from, and that holds nothing of any user.

A fresh supervisor forks it right after its configuration, before it reads any request that
could carry a user's data. The zygote loads what an interpreter needs (``interpreter.py``,
``site``) on its first request, and only ever forks interpreters, one per request on a
socketpair, each taking the pipes the supervisor sends with the request. A reset kills every
process but these two, checks that code left the zygote as it started (alive, not stopped,
same rlimits, nice value, CPU affinity and scheduling policy: code runs as its uid and can
change all of them), and asks it for the next interpreter: no exec, no Python start. A
zygote that is not as it started is dropped, and the supervisor execs a fresh copy of
itself, which forks a new one.

Each interpreter is the zygote's child, with no shim between them: the zygote is a child
subreaper and reaps the interpreters and whatever their code leaves behind; the supervisor
learns of an interpreter's death from its reply pipe (closed), and kills, times out and
finds its processes by its pid (it leads its own session) and the zygote's. ``random`` and
``tempfile`` reseed in every fork; the hash seed is the zygote's, shared by the interpreters
it forks (a Python start per interpreter is what it saves).

Standard library only (C modules where it matters for start-up time).
"""

from __future__ import annotations

import _signal as signal
import _socket
import errno
import os
import select
import sys

from libc import PR_SET_CHILD_SUBREAPER, prctl, scrub_freed
from reaper import IGNORED_SIGNALS, code_files, limit_files, spawn_leader

STOP_CHECK_S = 0.05  # how often a wait for the zygote's answer looks whether it was stopped

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

# What a request carries: the interpreter's stdout, stderr, control-in and reply-out ends.
FDS = 4
INT = 4  # bytes of a C int, as SCM_RIGHTS carries each fd
PID = 8  # bytes of a reply: the interpreter's pid, or minus an errno
PING_S = 5.0  # how long a reset waits for the zygote to say it is there
# States of /proc/<pid>/stat in which a zygote cannot serve (stopped, traced, dead).
NOT_SERVING = (b"T", b"t", b"Z", b"X", b"x")


class Zygote:
    """The supervisor's handle on its zygote."""

    def __init__(self, pid: int, sock: "Any", env: "dict[str, str]", socket_inode: int = 0) -> None:
        self.pid = pid
        self.sock = sock
        # Its end of our socketpair: a reset cannot read its fds (it is not dumpable), and
        # counts that socket as held (netstate).
        self.socket_inode = socket_inode
        self.alive = True  # until the supervisor reaps it
        self.env = env  # the environment its interpreters start with

    def serving(self) -> bool:
        """Alive and not stopped (code of our uid can SIGSTOP or SIGKILL it)."""
        if not self.alive:
            return False
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            return False
        return data[data.rindex(b")") + 2 :].split()[0] not in NOT_SERVING

    def problems(self, base: "dict[str, Any]") -> "list[str]":
        """How the zygote differs from how it started; empty: it may fork the next user's
        interpreter. Everything checked here is inherited by what it forks."""
        if not self.serving():
            return ["the zygote is dead or stopped"]
        import baseline

        problems = baseline.differences(_as_started(base), self.pid)
        if not problems:
            try:  # a signal sent just before the reset may not have taken effect yet
                self._ask(b"P", (), PING_S)
            except OSError as exc:
                problems.append(f"the zygote does not answer: {exc.strerror}")
        return problems

    def spawn(self, fds: "tuple[int, ...]", timeout: float) -> int:
        """A new interpreter (the zygote's child), started on ``fds``; OSError if the
        zygote cannot (out of processes) or does not answer (dead, stopped)."""
        if not self.serving():
            raise OSError(errno.ESRCH, "the interpreter's zygote is gone")
        pid = self._ask(b"F", fds, timeout)
        if pid < 0:
            raise OSError(-pid, f"the interpreter could not start: {os.strerror(-pid)}")
        return pid

    def _ask(self, what: bytes, fds: "tuple[int, ...]", timeout: float) -> int:
        """One request and its answer; a zygote that fails to answer is stopped. Asked and
        not answered: ECONNABORTED (what it was given, ``fds``, may be held by a child it
        forked before it was stopped: not to be handed to another)."""
        rights = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, _pack(fds))] if fds else []
        try:
            self.sock.sendmsg([what], rights)
        except OSError:
            self.stop()
            raise
        try:
            reply = b""
            left = timeout
            while len(reply) < PID:
                # The supervisor waits on nothing else meanwhile: a zygote the code stopped
                # (SIGSTOP: same uid) once it was asked held every command's output and
                # deadline for the whole timeout (10 s, found from outside): looked at again
                # every STOP_CHECK_S.
                if not select.select([self.sock], [], [], min(left, STOP_CHECK_S))[0]:
                    left -= STOP_CHECK_S
                    if left <= 0:
                        raise OSError(errno.ETIMEDOUT, "the interpreter's zygote did not answer")
                    if not self.serving():
                        raise OSError(errno.ESRCH, "the interpreter's zygote is gone or stopped")
                    continue
                chunk = self.sock.recv(PID - len(reply))
                if not chunk:
                    raise OSError(errno.ESRCH, "the interpreter's zygote is gone")
                reply += chunk
        except OSError as exc:
            self.stop()
            raise OSError(errno.ECONNABORTED, exc.strerror) from exc
        return int.from_bytes(reply, "big", signed=True)

    def stop(self) -> None:
        """Kill it (the supervisor's reaping then says it is gone)."""
        if self.alive:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.sock.fileno() >= 0:
            self.sock.close()
        self.alive = False


def start(
    keep: "tuple[int, ...]",
    workspace: str,
    env: "dict[str, str]",
    confine: "Optional[Callable[[bool], bool]]",
    devnull: int,
) -> "Optional[Zygote]":
    """Fork the zygote; ``keep`` are the fds it needs besides its socket (``devnull``, the
    policy's Landlock ruleset). None if the fork fails: interpreters are then forked by the
    supervisor itself, as long as it has served nobody else (see Supervisor.clean)."""
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        return None
    if pid == 0:
        try:
            ours.close()
            _close_all_but({0, 1, 2, theirs.fileno(), devnull, *keep})
            limit_files()  # the code's, as every interpreter's (ours holds the relay's too)
            prctl(PR_SET_CHILD_SUBREAPER, 1)  # what an interpreter leaves behind is ours (see _fork_one)
            scrub_freed(False)  # the supervisor's, not the interpreters': user code pays nothing
            _serve(theirs, workspace, env, confine, devnull)
        finally:
            os._exit(0)
    inode = os.fstat(theirs.fileno()).st_ino
    theirs.close()
    return Zygote(pid, ours, dict(env), inode)


# Not the array module: importing it imports collections (~4 ms of a sandbox's start-up).
def _pack(fds: "tuple[int, ...]") -> bytes:
    return b"".join(fd.to_bytes(INT, sys.byteorder, signed=True) for fd in fds)


def _unpack(data: bytes) -> "list[int]":
    return [
        int.from_bytes(data[i : i + INT], sys.byteorder, signed=True)
        for i in range(0, len(data) - INT + 1, INT)
    ]


def _close_all_but(keep: "set[int]") -> None:
    """The host's pipes, the exec judge's listener, the egress relay: none is the zygote's."""
    low = 0
    for fd in sorted(k for k in keep if k >= 0):
        if fd > low:  # never closerange(0, 0): CPython then closes every fd (close_range(0, ~0))
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def _serve(
    sock: "Any",
    workspace: str,
    env: "dict[str, str]",
    confine: "Optional[Callable[[bool], bool]]",
    devnull: int,
) -> None:
    for sig in IGNORED_SIGNALS:  # SIGKILL and SIGSTOP remain: the reset checks for them
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, _reap)  # runs while we wait for a request (recvmsg resumes)
    from runcode import become_interpreter, set_environ

    target = become_interpreter(workspace, env)
    loaded = False
    while True:
        try:
            msg, ancillary, _, _ = sock.recvmsg(1, _socket.CMSG_SPACE(4 * FDS))
        except InterruptedError:
            continue
        if not msg:
            return  # the supervisor closed its end: it is gone or replacing us
        if msg == b"P":
            sock.sendall(bytes(PID))
            continue
        fds: "list[int]" = []
        for level, kind, data in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds.extend(_unpack(data))
        if not loaded:
            _load()
            set_environ(env)  # once for every interpreter, after site's load (see set_environ)
            loaded = True
        reply = _fork_one(fds, target, confine, devnull) if len(fds) == FDS else -errno.EINVAL
        for fd in fds:
            os.close(fd)
        sock.sendall(reply.to_bytes(PID, "big", signed=True))


def _as_started(base: "dict[str, Any]") -> "dict[str, Any]":
    """The settings the zygote starts with: ours (``base``), but for the code's descriptor
    limit where we hold more (reaper.set_code_files)."""
    files = code_files()
    if not files:
        return base
    import resource

    # By each of its names (RLIMIT_OFILE is another, where the module has it).
    nofile = {
        name: [files, files] for name in base["rlimits"] if getattr(resource, name) == resource.RLIMIT_NOFILE
    }
    return dict(base, rlimits=dict(base["rlimits"], **nofile))


def _load() -> None:
    """What every interpreter needs, once, on the first request: not at the sandbox's start,
    where it would take the CPU from the create and the first command (and a sandbox that
    never runs code would pay it for nothing)."""
    import interpreter  # type: ignore[import-not-found]

    interpreter.preload()
    import gc

    if hasattr(gc, "freeze"):  # 3.7+: the forks' collections leave our pages shared
        # No collection first: after site's imports one frees ~24 objects and takes ~0.8 ms,
        # all of it on the first run_code's wait; frozen, those stay (a few KB).
        gc.freeze()


def _fork_one(
    fds: "list[int]", target: "Callable[[], None]", confine: "Optional[Callable[[bool], bool]]", devnull: int
) -> int:
    """Start one interpreter: our child, leading its own session, with no shim between us.

    We are a child subreaper: what the interpreter's code leaves behind (a double fork) is
    ours, and the supervisor kills it with the run (all of our descendants but the
    interpreter) and with the interpreter (all of them). One fork per interpreter instead
    of two (a shim, then the interpreter): each fork of a Python process copies its page
    tables and, as refcounts change, its pages."""
    out_w, err_w, in_r, res_w = fds
    try:
        return spawn_leader(target, (devnull, out_w, err_w), keep=(in_r, res_w), confine=confine)
    except OSError as exc:
        return -(exc.errno or errno.EAGAIN)


def _reap(*_: object) -> None:
    """SIGCHLD: an interpreter ended (or the supervisor killed it), or an orphan of its code."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
