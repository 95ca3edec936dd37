"""The process tier's template: the program of the one warm Python each backend keeps (``_template.py``).

Run by the sandboxes' own ``python3`` (``-S -E -s -B``), which reads this source from its
stdin, a ``SOCK_SEQPACKET`` socket to the host: nothing of the host's paths in its command
line, which every sandbox's pid 1 shows in ``/proc/1/cmdline``. It imports the supervisor's
modules from the shared folder and loads ``site``, then serves: each request (a message with
its descriptors) is one new sandbox, and one fork, the *keeper*, which

1. joins the sandbox's cgroups (as root, before anything else: what it forks is born inside),
   drops the supplementary groups and takes the sandbox's host uid and gid;
2. makes a user namespace (uid and gid 1000 mapped to that uid, ``setgroups`` denied, as
   bubblewrap maps) and a pid namespace, and forks its first process: **pid 1**, the
   supervisor to be;
3. hands the host a pidfd of pid 1 and both namespaces (bubblewrap joins them and builds the
   rest around a placeholder), drops its own capabilities, and waits: for pid 1's end, whose
   status it reports, or for the host's end of its socket to close (the host closed the
   sandbox, or died), when it kills pid 1 first.

Pid 1 enters what bubblewrap made around the placeholder (network, IPC, UTS, cgroup, mount:
every file opened first, since /proc is the sandbox's once in its mount namespace), caps the
user namespaces at the one it makes next, nested (``--disable-userns``, as bubblewrap does),
drops every capability set, sets ``no_new_privs``, loads the seccomp filter, leads a session
of its own, and runs the supervisor's ``main``: no exec, no Python start, ``site`` loaded.

The template holds nothing of any user: a request carries a uid, cgroup files, a umask and
descriptors; the keeper forks before any of the sandbox's data exists, and the template
closes its copies of the descriptors at once; a keeper closes every descriptor but its own
request's (none of the template's, none of the keepers forked before it). Standard library
only (``ctypes`` for the system calls Python 3.11 lacks); typed, but never imported by the
host.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import socket
import struct
import sys

SHARED = ""  # the host's copy of the supervisor's folder: set by the host, before this source
SANDBOX_DIR = "/opt/stockade"  # where each sandbox binds that folder
SANDBOX_UID = 1000
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 22, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 4, 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# The namespaces bubblewrap makes around the placeholder, the mount namespace last: once in
# it, /proc is the sandbox's, where the placeholder is another pid.
JOINED = ("net", "ipc", "uts", "cgroup", "mnt")
# A request's descriptors, in order.
FDS = ("ctl", "entry", "stdin", "stdout", "stderr", "seccomp")

libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def load() -> None:
    """What every sandbox's supervisor and interpreter need, once per host process: the
    supervisor's modules, ``site``. The supervisor fixes ``sys.path`` as it is imported, as
    the user it runs as would see it (here as root: every folder writable): put back after."""
    base = [entry for entry in sys.path if entry and entry != SHARED]
    sys.path[:] = [SHARED, *base]
    import supervisor  # type: ignore[import-not-found]  # noqa: F401

    sys.path[:] = [SHARED, *base]
    import interpreter  # type: ignore[import-not-found]

    interpreter.preload()
    import gc

    # What a sandbox under a policy imports at its configuration: in a fork, each import
    # writes pages the fork shares with us and copies them (~1.5 ms of such a start, measured
    # against a start without a policy); here once, and shared. (judge.c's library loaded
    # here too saved nothing that showed.)
    import confine  # type: ignore[import-not-found]  # noqa: F401
    import execrecords  # type: ignore[import-not-found]  # noqa: F401
    import execrules  # type: ignore[import-not-found]  # noqa: F401
    import fastjudge  # type: ignore[import-not-found]  # noqa: F401
    import rules  # type: ignore[import-not-found]  # noqa: F401
    import rulespy  # type: ignore[import-not-found]  # noqa: F401

    gc.freeze()  # the forks' collections leave our pages shared


def serve(sock: socket.socket) -> None:
    """One keeper per request until the host closes its end; then, once every keeper has
    ended, return. A keeper's socket to the host (``ctl``) is held until the keeper is reaped:
    the host's end then reads EOF, and no zombie is left when it does."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    keepers: dict[int, int] = {}
    listening = True
    while listening or keepers:
        watched = [wake_r, sock.fileno()] if listening else [wake_r]
        ready = select.select(watched, [], [])[0]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            _reap(keepers)
        if listening and sock.fileno() in ready:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, len(FDS))
            if not msg:
                listening = False
                sock.close()
                continue
            if len(fds) != len(FDS):
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _keep(json.loads(msg), dict(zip(FDS, fds, strict=True)))
            keepers[pid] = fds[0]
            for fd in fds[1:]:
                os.close(fd)
            _reap(keepers)


def _reap(keepers: dict[int, int]) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        ctl = keepers.pop(pid, -1)
        if ctl >= 0:
            os.close(ctl)


def _keep(req: dict[str, object], fds: dict[str, int]) -> None:
    """The keeper (see the module's docstring). Never returns."""
    try:
        _close_all_but({1, 2, *fds.values()})
        for path in req["join"]:  # type: ignore[attr-defined]
            _write(str(path), "0")
        uid = int(req["uid"])  # type: ignore[call-overload]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        _check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")  # the uid change made /proc/self root's
        _check(libc.unshare(CLONE_NEWUSER), "unshare user")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{SANDBOX_UID} {uid} 1\n")
        _write("/proc/self/gid_map", f"{SANDBOX_UID} {uid} 1\n")
        _check(libc.unshare(CLONE_NEWPID), "unshare pid")
        pid_1 = os.fork()
        if pid_1 == 0:
            os.close(fds["ctl"])
            _become_init(req, fds)
        for name in FDS[1:]:
            os.close(fds[name])
        ctl = socket.socket(fileno=fds["ctl"])
        pidfd = os.pidfd_open(pid_1)
        userns = os.open("/proc/self/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        pidns = os.open("/proc/self/ns/pid_for_children", os.O_RDONLY | os.O_CLOEXEC)
        socket.send_fds(ctl, [f"{os.getpid()} {pid_1}".encode()], [pidfd, userns, pidns])
        os.close(userns)
        os.close(pidns)
        # Nothing more to do as the namespace's owner: no capability, nothing to read us by.
        _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "not dumpable")
        _drop_capabilities()
        ready = select.select([ctl.fileno(), pidfd], [], [])[0]
        if ctl.fileno() in ready:  # the host closed the sandbox, or is gone: pid 1 first, then us
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        _, status = os.waitpid(pid_1, 0)
        with contextlib.suppress(OSError):
            ctl.send(f"exit {status}".encode())
    except BaseException as exc:  # said on the sandbox's stderr (the host's log of its start)
        _say(fds.get("stderr", 2), f"the template's keeper: {exc}")
    finally:
        os._exit(0)


def _close_all_but(kept: set[int]) -> None:
    """Every descriptor a fork of the template inherits but ``kept`` (its own request's, and
    /dev/null on 1 and 2) closed: the template's socket to the host and its wake-up pipe, and
    the sockets of the keepers forked before it. A keeper holding an older keeper's socket
    would keep the host's end of it from reading EOF while it lives (the host's close of
    that older sandbox waited out its timeouts), and hold another sandbox's channel."""
    low = 0
    for fd in sorted(kept):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def _become_init(req: dict[str, object], fds: dict[str, int]) -> None:
    """Pid 1 (see the module's docstring). Never returns."""
    try:
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent death signal")
        entry = socket.socket(fileno=fds["entry"])
        placeholder = int(entry.recv(64))
        names = [name for name in JOINED if not (name == "net" and req.get("share_net"))]
        joined = [
            (name, os.open(f"/proc/{placeholder}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)) for name in names
        ]
        entry.send(b"entered")  # the namespaces are held: the placeholder may end
        entry.close()
        # --disable-userns, as bubblewrap does it: this user namespace allows one more, the
        # one made below, nested; code in it can neither make another nor undo the limit.
        _write("/proc/sys/user/max_user_namespaces", "1")
        for name, fd in joined:
            _check(libc.setns(fd, 0), f"setns {name}")
            os.close(fd)
            if name == "net":  # while we hold its owner's capabilities (see _no_time_wait)
                _no_time_wait()
        _check(libc.unshare(CLONE_NEWUSER), "unshare the nested user namespace")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{SANDBOX_UID} {SANDBOX_UID} 1\n")
        _write("/proc/self/gid_map", f"{SANDBOX_UID} {SANDBOX_UID} 1\n")
        if libc.unshare(CLONE_NEWUSER) == 0:
            raise OSError(errno.EPERM, "user namespaces were not disabled as asked")
        os.chdir(str(req["chdir"]))
        _drop_capabilities()
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        program = ctypes.create_string_buffer(os.pread(fds["seccomp"], 1 << 20, 0))
        fprog = _SockFprog(len(program.raw) // 8, ctypes.addressof(program))
        _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp")
        os.umask(int(req["umask"]))  # type: ignore[call-overload]
        os.setsid()
        for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
            os.dup2(fds[name], fd)
        os.closerange(3, 1 << 20)
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent death signal")
        _as_in_the_sandbox(str(req["chdir"]))
        import supervisor

        supervisor.main()
    except BaseException as exc:
        _say(fds.get("stderr", 2), f"the template's pid 1: {exc}")
    finally:
        os._exit(0)


def _no_time_wait() -> None:
    """No TIME_WAIT kept in the sandbox's network namespace: a connection its code closed
    first would otherwise outlive a reset for 60 s, its addresses and ports (code's choice)
    readable in /proc/net/tcp and taken for the next user's bind (the reset's check would
    then replace the sandbox). Written through the host's /proc (the sandbox's own mounts
    /proc/sys read-only), which shows the sysctls of the namespace we just entered. Where
    it cannot be written, that check is what holds."""
    with contextlib.suppress(OSError):
        _write("/proc/sys/net/ipv4/tcp_max_tw_buckets", "0")
    # And no transmit timestamp carrying what was sent (``_host.NO_TIMESTAMPED_DATA``).
    with contextlib.suppress(OSError):
        _write("/proc/sys/net/core/tstamp_allow_data", "0")


def _drop_capabilities() -> None:
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the kernel's last capability
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "ambient capabilities")
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    _check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")


def _as_in_the_sandbox(cwd: str) -> None:
    """The supervisor's modules as if imported from the sandbox's folder (``reset`` execs a
    fresh supervisor from there, the interpreter drops them by it), its import path as a
    supervisor started there has it, and the environment bubblewrap leaves (only ``PWD``)."""
    prefix = SHARED + os.sep
    for module in list(sys.modules.values()):
        for attr in ("__file__", "__cached__"):
            path = getattr(module, attr, None)
            if isinstance(path, str) and path.startswith(prefix):
                setattr(module, attr, SANDBOX_DIR + os.sep + path[len(prefix) :])
    import supervisor

    entries = [SANDBOX_DIR, *(entry for entry in sys.path if entry != SHARED)]
    sys.path[:] = supervisor._trusted_path(entries, SANDBOX_DIR)
    os.environ.clear()
    os.environ["PWD"] = cwd


def _say(fd: int, line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, (line + "\n").encode())


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host's terminal's ^C is the host's
    sock = socket.socket(fileno=0)
    load()
    sock.send(struct.pack("i", os.getpid()))  # loaded: ready for requests
    serve(sock)


if __name__ == "__main__":
    main()
