"""A reset on the supervisor's side: the sandbox made as it was at start-up, for the next
user, either in place or by exec'ing a fresh supervisor that takes the state over
(``exec_fresh`` hands it over, ``resume`` takes it).

Apart from the supervisor because only a reset (a pool's, between users) needs it: the
supervisor imports it then, so that a sandbox's start loads none of it.

Standard library only; runs on any Python >= 3.8 found inside the sandbox.
"""

from __future__ import annotations

import _signal as signal
import fcntl
import os
import stat
import sys
import time

import baseline
import jobs
import netstate
from fileops import _listxattr, _write_all, empty_dir, read_exactly, remove_sysv_ipc
from proctree import kill_tree
from protocol import PREFIX, encode, loads
from runcode import Interpreter
from supervisor import RESUME_FLAG

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any

    from protocol import FrameReader
    from supervisor import Supervisor
    from zygote import Zygote

# A reset execs a fresh supervisor and hands it its state on this fd.
HANDOVER_FD = 3
LISTENER_FD = 4  # the exec judge's listener, across the same exec
SHIM_FD = 5  # the compiled shim's memfd (an allowlist forbids making another)
KEY_FD = 6  # a pipe holding the exec key of the listener's filter (judge.c)
SEAL_FD = 7  # a pipe holding the channel's key (protocol.Seal)
# How long a reset waits for the warm interpreter it promised (then answers all the same).
WARM_START_S = 10.0


def run(sup: "Supervisor", rid: int, h: dict[str, Any], rest: bytes) -> None:
    """Make the sandbox as it was at start-up, for the next user.

    Kill everything but the zygote, empty every writable place, drop IPC objects, put
    back the settings code can change (``baseline``), and find the network namespace with no
    socket left that no process holds (``netstate``): the pool's 'never hand out dirty'.
    What one user leaves (a file in /dev/shm, a SysV segment, a mode on the workspace, a
    sysctl) would otherwise reach the next one. Our heap has held the last user's output
    and environment: no interpreter is forked from us any more but from the zygote,
    which holds nothing of any user, and we are non-dumpable (code cannot read us). A
    zygote that code changed (killed, stopped, its limits or scheduling) is dropped and
    we exec a fresh copy of ourselves (same pid: we stay the sandbox's init), which
    forks a new one; so does one under a policy whose rules cannot be renewed in place
    (``Rules.renew``: the folders its ruleset holds are kept, emptied, as the ruleset was
    built on them). An egress relay is renewed in place: every connection of the last
    user's code closed, its trust files written again.
    """
    for job in list(sup.commands.values()):
        job.timed_out = True
        kill_tree(job.shim, include_root=True)
    jobs.forget_commands(sup)
    sup.drop_interpreter(None)
    zygote = sup.zygote if sup.zygote is not None and sup.zygote.alive else None
    # Everything stopped first, at once (the kernel signals them all under one lock: nothing
    # forks meanwhile): a process that hops to a new pid faster than a scan of /proc can
    # read them (clone, then its parent exits) was never where the sweep looked, and lived
    # on into the next user's session (on gVisor, 1 in 3).
    stopped = _stop_all()
    # Code first (a fork bomb's included): the zygote then has processes to fork with.
    kill_tree(os.getpid(), include_root=False, spare=zygote.pid if zygote is not None else 0, settle=True)
    if stopped and zygote is not None:
        _go_on(zygote)
    for root, mode in sup.root_modes.items():
        _as_first_seen(root, mode)
        empty_dir(root, keep=sup.kept_modes)  # the rules' folders stay: the ruleset holds them
    for folder, mode in sorted(sup.kept_modes.items()):
        if os.path.isdir(folder) and not os.path.islink(folder):
            _as_first_seen(folder, mode)
    remove_sysv_ipc()
    sup.wipe_input()
    problems = baseline.restore(sup.baseline)
    if problems:
        sup.send({"id": rid, "ev": "error", "kind": "reset", "message": "; ".join(problems)})
        sup.reader.feed(rest)
        return
    sup.reap()
    in_place = sup.rules is None or sup.rules.renew()
    if in_place and sup.egress is not None:
        import egress  # type: ignore[import-not-found]

        egress.write_files(sup.config["egress"])  # its folder was emptied with /tmp
        sup.egress.renew()
    # After the relay's renewal (its closed connections are the last to settle): what the
    # kernel keeps of the last user's sockets with no process left (netstate's docstring).
    sockets = sup.baseline.get("sockets")
    zygote_socket = [sup.zygote.socket_inode] if sup.zygote is not None and sup.zygote.alive else []
    host_names = (
        [str(sup.config["egress"]["host_name"])] if "host_name" in sup.config.get("egress", {}) else []
    )
    left = netstate.leftovers(sockets, zygote_socket, host_names) if sockets is not None else []
    if left:
        sup.send({"id": rid, "ev": "error", "kind": "reset", "message": "; ".join(left)})
        sup.reader.feed(rest)
        return
    if in_place and sup.zygote is not None and not sup.zygote.problems(sup.baseline):
        sup.clean = False
        if h.get("warm"):
            sup.interpreter = Interpreter(sup)
            sup.interpreter.wait_started(WARM_START_S)
        sup.send({"id": rid, "ev": "done"})
        sup.reader.feed(rest)
        return
    if sup.zygote is not None:
        sup.zygote.stop()
        sup.zygote = None
    while True:  # reap: no zombie of the last user crosses into the new image
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    exec_fresh(sup, rid, bool(h.get("warm")), rest)


def exec_fresh(sup: "Supervisor", rid: int, warm: bool, rest: bytes) -> None:
    if sup.rules is not None:
        sup.rules.stop_fast()  # the compiled judge's thread, before the fds below move
    state = {
        "config": sup.config,
        "carried": {"root_modes": sup.root_modes, "kept_modes": sup.kept_modes, "baseline": sup.baseline},
        "reply_to": rid,
        "warm": warm,
    }
    listener = sup.rules.listener if sup.rules is not None else -1
    key = -1
    if sup.rules is not None:
        state["carried"]["asked"] = sup.rules.asked()
    if listener >= 0:
        # The exec judge goes on: the fresh supervisor keeps listening on the same fd.
        state["carried"]["listener"] = LISTENER_FD
        key = sup.rules.key_pipe()
        if key >= 0:
            state["carried"]["key"] = KEY_FD
    if sup.shim >= 0:
        state["carried"]["shim"] = SHIM_FD
    sealed = -1
    if sup.seal is not None:
        # The key through a pipe (written from its mapping: no copy of it in our heap), and
        # where each direction's count is.
        sealed, write_end = os.pipe()
        _write_all(write_end, sup.seal.key)
        os.close(write_end)
        state["carried"]["seal"] = [sup.seal.count, sup.reader.seal.count if sup.reader.seal else 0]
    handover = _unnamed_file()
    _write_all(handover, encode(state, rest))
    os.lseek(handover, 0, os.SEEK_SET)
    # Every fd to its place without one overwriting another: all out of the way first, in
    # copies that close at the exec (dup2's targets do not): the fresh supervisor keeps only
    # its places, or each reset would leave two behind.
    carried = (handover, listener, sup.shim, key, sealed)
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 16) if fd >= 0 else -1 for fd in carried]
    os.dup2(sup.rfd, 0)
    os.dup2(sup.wfd, 1)
    for fd, place in zip(moved, (HANDOVER_FD, LISTENER_FD, SHIM_FD, KEY_FD, SEAL_FD)):
        if fd >= 0:
            os.dup2(fd, place)
    here = os.path.dirname(os.path.abspath(__file__))
    boot = f"import sys; sys.path.insert(0, {here!r}); import supervisor; supervisor.main()"
    python = sys.executable or os.readlink("/proc/self/exe")
    if sup.rules is not None and sup.rules.listener >= 0:
        sup.rules.let_own_exec_through(LISTENER_FD)  # our exec waits for the judge: us
    os.execv(python, [python, "-S", "-E", "-s", "-B", "-c", boot, RESUME_FLAG])


# Rounds of SIGSTOP a reset sends at most, until one finds every process stopped.
STOP_ROUNDS = 50


def _stop_all() -> bool:
    """SIGSTOP to every process we may signal, where we are the sandbox's init (pid 1: a
    kill(-1) skips us); whether it was sent.

    Again until every process is seen stopped: Linux restarts a clone that a signal
    overtook, so no child escapes one kill(-1); gVisor does not, and a child made while its
    parent's stop was on its way runs on unsignalled (a hopper outlived a reset in CI)."""
    if os.getpid() != 1:
        return False
    for _ in range(STOP_ROUNDS):
        try:
            os.kill(-1, signal.SIGSTOP)
        except ProcessLookupError:  # nothing else runs
            return True
        if _all_stopped():
            return True
    return True


def _all_stopped() -> bool:
    """Whether every other process is stopped (or dead). One gone between the listing and
    its reading is a process that hopped to a new pid meanwhile: not stopped."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            return False
        state = data[data.rfind(b")") + 2 : data.rfind(b")") + 3]
        if state not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


def _go_on(zygote: "Zygote") -> None:
    """The zygote, stopped with everything else, runs again (and is seen running: else the
    reset would take it for one that code stopped, and replace it)."""
    os.kill(zygote.pid, signal.SIGCONT)
    deadline = time.monotonic() + 1.0
    while not zygote.serving() and zygote.alive and time.monotonic() < deadline:
        time.sleep(0.001)


def _as_first_seen(folder: str, mode: int) -> None:
    """A writable place's mode as first seen, no extended attribute left on it, and its times
    the reset's (the last user set them to 64 bits of their choosing, and the next read them:
    emptying a folder that is empty already changes none)."""
    if stat.S_IMODE(os.stat(folder).st_mode) != mode:  # not ours to chmod on some tiers
        os.chmod(folder, mode)
    for name in _listxattr(folder):
        os.removexattr(folder, name)
    try:
        os.utime(folder)
    except OSError:  # not ours (a bind of another owner): its times are not code's either
        pass


def _unnamed_file() -> int:
    """A file with no name, to hand state over an exec: a memfd only where ``O_TMPFILE``
    fails (an allowlist forbids memfds to everything, us included)."""
    # Closed at the exec (its copy at HANDOVER_FD is not, and is closed once read): left open
    # in the fresh supervisor, code could open it through gVisor's /proc and read it.
    for folder in ("/dev/shm", "/tmp"):
        try:
            return os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError:
            continue
    try:
        return os.memfd_create("stockade-reset", os.MFD_CLOEXEC)
    except PermissionError:  # gVisor (no O_TMPFILE on its binds) under an allowlist
        return _named_then_unlinked("/dev/shm")


def _named_then_unlinked(folder: str) -> int:
    """A new file of a random name in ``folder``, its name gone at once. Made where no code
    runs any more (the reset killed it all), so nothing can open it by that name meanwhile."""
    path = os.path.join(folder, ".stockade-reset-" + os.urandom(16).hex())
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC, 0o600)
    os.unlink(path)
    return fd


def resume(sup: "Supervisor", reader: "FrameReader") -> None:
    """Take over from the supervisor whose reset exec'd us: its configuration, the settings
    as first seen, and the requests it had read but not served."""
    # The state first, the requests behind the reset (its body) after the zygote is forked.
    prefix = read_exactly(HANDOVER_FD, PREFIX.size)
    hlen, blen = PREFIX.unpack(prefix)
    state = loads(read_exactly(HANDOVER_FD, hlen).decode())
    sup.configure(state["config"], state["carried"])
    sealed = state["carried"].get("seal")
    if sealed is not None:  # into a mapping forks leave out, and its pipe closed, before a fork
        sup.take_seal(SEAL_FD, reader, sent=int(sealed[0]), received=int(sealed[1]))
        os.close(SEAL_FD)
    sup.start_judge()
    sup.start_zygote()
    rest = read_exactly(HANDOVER_FD, blen)
    os.close(HANDOVER_FD)
    if state.get("warm"):
        sup.interpreter = Interpreter(sup)
        sup.interpreter.wait_started(WARM_START_S)
    sup.send({"id": state["reply_to"], "ev": "done"})
    reader.feed(rest)
    sup.reader = reader
    sup.handle(reader.frames())
    sup.serve()
