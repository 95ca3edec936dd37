"""The shim server: the process that makes every command's shim, and that holds nothing of any user.

A command's shim (``reaper.run_shim``: confined, a child subreaper, it starts the command,
waits, kills what is left and mirrors the exit) was a fork of the supervisor. The
supervisor is a Python process whose heap grows with every request: each fork copies its
page tables, and each page the supervisor writes while a shim lives is copied again
(~200 page faults a command on the supervisor's path). The server is forked once, right
after the configuration and beside the zygote, before any request is read; from then on
it only waits for requests, so its heap stays still and holds nothing of any user, and a
shim made from it copies less and makes the supervisor copy nothing.

Each shim stays the supervisor's child: the server makes it with ``clone(CLONE_PARENT)``,
whose parent is the caller's parent. The supervisor reaps it and reads its exit status as
before, and the compiled exec judge's check that a caller's session is led by a child of
the supervisor (``judge.c``, ``ours``) holds without a change. The shim itself tells the
supervisor its pid (on the server's socket) before it does anything else: a shim whose
word does not arrive (its supervisor gave up on the server, see ``ShimServer.spawn``)
runs nothing.

The supervisor falls back to its own fork (``reaper.spawn_shim``) when the server is dead,
stopped or slow to answer (code runs as its uid and may signal it), and drops the server
then: the next reset replaces it, as it replaces a zygote code changed (see reset.py).
Standard library only (C modules where it matters for start-up time).
"""

from __future__ import annotations

import _signal as signal
import _socket
import errno
import os
import select

from reaper import IGNORED_SIGNALS, libc, run_shim, spawned
from zygote import PID, Zygote, _close_all_but, _pack, _unpack

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

# A request: one message of at most this size (argv, environment, working folder) and the
# command's stdin, stdout and stderr ends. A larger one takes the fallback (a fork of ours).
MAX_REQUEST = 1 << 16
FDS = 3
ANSWER_S = 5.0  # how long a server that is alive and not stopped may take to answer
POLL_S = 0.05  # how often the supervisor looks whether a server that is slow is stopped
CLONE_PARENT = 0x00008000
PR_SET_NAME, PR_GET_NAME = 15, 16
SIGCHLD = 17
SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine, -1)
NAME = b"stockade-shim"  # the server's, and so its shims' (ps shows them by it)
HELLO = (1).to_bytes(PID, "big", signed=True)  # the server's first word: CLONE_PARENT works here


class ShimServer(Zygote):
    """The supervisor's handle on its shim server (its pid and socket, like the zygote's)."""

    # Whether the kernel gives a clone our parent (the server says so once, first thing):
    # None until it said, then True or False (gVisor ignores CLONE_PARENT).
    clones: "Optional[bool]" = None

    def problems(self, base: "dict[str, Any]") -> "list[str]":
        """How the server differs from how it started; empty: it may make the next user's
        shims (or it makes none: this kernel has no CLONE_PARENT). Its settings (rlimits,
        nice value, affinity, scheduling) are every shim's."""
        try:
            heard = self._heard(ANSWER_S)
        except OSError as exc:
            return [f"the shim server did not start: {exc.strerror}"]
        if heard is None:
            return ["the shim server did not say whether it can serve"]
        if not heard:
            return []
        if not self.serving():
            return ["the shim server is dead or stopped"]
        import baseline

        problems = baseline.differences(base, self.pid)
        if not problems:
            try:
                self._ask(b"P", (), ANSWER_S)
            except OSError as exc:
                problems.append(f"the shim server does not answer: {exc.strerror}")
        return problems

    def _heard(self, wait: float) -> "Optional[bool]":
        """Whether the kernel gives a clone our parent, as the server's first word says;
        None if that has not come within ``wait`` seconds. A server that said no ends."""
        if self.clones is None:
            if not select.select([self.sock], [], [], wait)[0]:
                return None
            try:
                said = self.sock.recv(PID)
            except OSError:
                said = b""
            if len(said) != PID:
                self.stop()
                raise OSError(errno.ESRCH, "the shim server is gone")
            self.clones = said == HELLO
        return self.clones

    def spawn_shim(
        self, argv: "list[str]", env: "dict[str, str]", cwd: str, fds: "tuple[int, int, int]"
    ) -> int:
        """A shim (our child) that runs ``argv`` on ``fds``; 0 if this request is not the
        server's to serve: it has not said yet whether it can, or it cannot (``clones``);
        the request is too large or has a NUL in it (a fork of ours then reports what it
        always did). OSError: EAGAIN or ENOMEM when no process can be made now; anything
        else when the server failed, which is then stopped."""
        # Its first word is not waited for (a fork of ours serves meanwhile), and is read
        # even after it ended: a server that said no ends at once (and may be reaped).
        if not self._heard(0):
            return 0
        if not self.alive:
            raise OSError(errno.ESRCH, "the shim server is gone")
        try:
            words = [cwd, str(len(argv)), *argv]
            for key, value in env.items():
                words += (key, value)
            request = "\0".join(words).encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return 0
        if len(request) > MAX_REQUEST or request.count(b"\0") != len(words) - 1:
            return 0
        sock = self.sock
        try:
            sock.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, _pack(fds))])
            reply = self._answer()
        except OSError:
            self.stop()
            raise
        pid = int.from_bytes(reply, "big", signed=True)
        if pid < 0 and -pid in (errno.EAGAIN, errno.ENOMEM):
            raise OSError(-pid, os.strerror(-pid))
        if pid <= 0:  # the kernel refuses the clone, or its shim has another parent than us
            self.stop()
            raise OSError(-pid or errno.EINVAL, "the shim server cannot make shims here")
        return pid

    def _answer(self) -> bytes:
        """The answer to the request just sent: a shim's pid (from the shim), or minus an
        errno (from the server). A server that is stopped is given up on at once; one that
        runs, after ANSWER_S. Given up on, nothing more may arrive: a shim whose pid was
        not read must never run its command (see _shim)."""
        sock = self.sock
        waited = 0.0
        while not select.select([sock], [], [], POLL_S)[0]:
            waited += POLL_S
            if waited >= ANSWER_S or not self.serving():
                # No shim may now write its pid (its send fails); one that did is ours.
                sock.shutdown(_socket.SHUT_RD)
                try:
                    reply = sock.recv(PID, _socket.MSG_DONTWAIT)
                except OSError:
                    reply = b""
                if len(reply) == PID:
                    return reply
                raise OSError(errno.ETIMEDOUT, "the shim server did not answer")
        reply = sock.recv(PID)
        if len(reply) != PID:
            raise OSError(errno.ESRCH, "the shim server is gone")
        return reply


def start(keep: "tuple[int, ...]", confine: "Optional[Callable[[bool], bool]]") -> "Optional[ShimServer]":
    """Fork the shim server; ``keep`` are the fds a shim's confinement needs (the policy's
    Landlock ruleset). None where it cannot be (no clone number for this machine, a failed
    fork): shims are then forks of ours."""
    if SYS_CLONE < 0:
        return None
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    # Named from birth (ps, and tests, tell it from the zygote by it; its shims keep the
    # name, as they exec nothing): we take its name for the fork, then ours back.
    own = _name(PR_GET_NAME, bytes(16))
    _name(PR_SET_NAME, NAME)
    pid = -1
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        return None
    finally:
        if pid != 0:
            _name(PR_SET_NAME, own)
    if pid == 0:
        try:
            ours.close()
            _close_all_but({0, 1, 2, theirs.fileno(), *keep})
            _serve(theirs, confine)
        finally:
            os._exit(0)
    theirs.close()
    ours.setblocking(False)  # a send that would wait means a server that does not read
    return ShimServer(pid, ours, {})


def _name(option: int, name: bytes) -> bytes:
    """prctl's PR_SET_NAME or PR_GET_NAME on a copy of ``name`` (16 bytes at most, NUL-ended
    here); returns the copy as the kernel left it, up to its NUL."""
    import _ctypes

    class c_char(_ctypes._SimpleCData):
        _type_ = "c"

    buf = bytearray(name[:15].ljust(16, b"\0"))
    view = c_char.from_buffer(buf)  # holds buf while the kernel reads or writes it
    try:
        libc("prctl", option, _ctypes.addressof(view), 0, 0, 0)
    except OSError:
        pass
    return bytes(buf).split(b"\0", 1)[0]


def clone_parent() -> int:
    """fork(), but the child's parent is ours (CLONE_PARENT): 0 in the child. The raw
    system call, not glibc's fork: no fork handlers run in the child, which is fine for a
    process of one thread that only makes shims (Python's own after-fork work concerns
    threads and locks this process does not have)."""
    return libc("syscall", SYS_CLONE, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0)


def _serve(sock: "Any", confine: "Optional[Callable[[bool], bool]]") -> None:
    for sig in IGNORED_SIGNALS:  # SIGKILL and SIGSTOP remain: the supervisor checks for them
        signal.signal(sig, signal.SIG_IGN)
    supervisor = os.getppid()
    # Does the kernel honour CLONE_PARENT? A clone that ends at once: if it is ours to reap,
    # no (gVisor makes it our child); on Linux it is the supervisor's (which ignores it).
    try:
        probe = clone_parent()
        if probe == 0:
            os._exit(0)
        os.waitpid(probe, 0)
        honoured = False
    except ChildProcessError:
        honoured = True
    except OSError:
        honoured = False
    import gc

    # A collection in a shim would write the header of every object it walks, each a page
    # copied from ours; the server and its shims make no garbage that needs one.
    gc.disable()
    gc.freeze()
    sock.sendall(HELLO if honoured else bytes(PID))
    if not honoured:
        return
    # What the clone of a shim that finds another parent than the supervisor leaves: reaped
    # by the kernel (a shim puts SIGCHLD back to its default, see reaper._child_setup).
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    space = _socket.CMSG_SPACE(4 * FDS)
    while True:
        try:
            msg, ancillary, flags, _ = sock.recvmsg(MAX_REQUEST, space)
        except InterruptedError:
            continue
        if not msg:
            return  # the supervisor closed its end: it is gone or replacing us
        fds: "list[int]" = []
        for level, kind, data in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds.extend(_unpack(data))
        if msg == b"P":
            reply = 0
        elif len(fds) != FDS or flags & (_socket.MSG_TRUNC | _socket.MSG_CTRUNC):
            reply = -errno.EINVAL
        else:
            try:
                pid = clone_parent()
            except OSError as exc:
                pid = -(exc.errno or errno.EAGAIN)
            if pid == 0:
                try:
                    _shim(sock, msg, fds, confine, supervisor)
                finally:
                    os._exit(126)  # never back into the server's loop
            reply = pid if pid < 0 else 0  # a shim answers for itself
        for fd in fds:
            os.close(fd)
        if reply or msg == b"P":
            sock.sendall(reply.to_bytes(PID, "big", signed=True))


def _shim(
    sock: "Any", msg: bytes, fds: "list[int]", confine: "Optional[Callable[[bool], bool]]", supervisor: int
) -> None:
    """In the clone: say our pid, then be the command's shim. Never returns."""
    try:
        if os.getppid() != supervisor:  # not a clone the supervisor will reap: run nothing
            sock.sendall((-errno.EOPNOTSUPP).to_bytes(PID, "big", signed=True))
            os._exit(126)
        sock.sendall(os.getpid().to_bytes(PID, "big", signed=True))
    except BaseException:
        os._exit(126)  # the supervisor stopped waiting for us: nobody would know our command ran
    words = msg.decode("utf-8", "surrogateescape").split("\0")
    argc = int(words[1])
    pairs = words[2 + argc :]
    launch = spawned(words[2 : 2 + argc], dict(zip(pairs[::2], pairs[1::2])), words[0])
    run_shim(launch, (fds[0], fds[1], fds[2]), confine=confine)
