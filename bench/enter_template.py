"""A mechanism measured ahead of building it: a warm Python becoming a new sandbox's process.

    sudo python bench/enter_template.py --rounds 40

The process tier's cold start pays two Python starts (the supervisor's, then `site` in the
zygote at the first ``run_code``) on top of bubblewrap: 1.65-1.74x raw bwrap running the same
``print(1)`` (issue 13's target: 1.3x, and at or below raw as the ambition). No order of those
starts reaches the target (docs/benchmarks.md, "Where a cold start's time goes"). This script
measures the design that would: a *template*, one host process per backend with Python and
`site` loaded, that holds nothing of any user, forked once per sandbox. Python starts once per
host, not once per sandbox. Two ways, each against raw bwrap running ``python3 -c 'print(1)'``,
interleaved round by round:

- *entered*: bwrap builds every namespace and the mounts around a placeholder (pid 1); a fork
  of the template enters them (``setns``), forks into the pid namespace (pid 2), takes the
  sandbox's ids and prints 1;
- *init*: the template's fork takes the sandbox's host uid and makes the user and pid
  namespaces itself; its child is pid 1 of the new pid namespace (so the supervisor would stay
  init: code of its uid can neither kill nor stop it); bwrap joins both (``--userns``,
  ``--pidns``), builds the other namespaces and the mounts around a placeholder (pid 2); pid 1
  enters those and prints 1.

Before the timed rounds, each way's process compares itself with bwrap's own child in its
sandbox (seccomp filter, no capabilities, as stockade starts one) in everything a sandbox's
security rests on: ids, groups, umask, every capability set, no_new_privs, seccomp filters,
every namespace, cgroups, rlimits, root, and a session of its own; any difference stops the
script: a mechanism that is fast because it skipped a step is not measured. Not in the
prototype (costs to add, each small): the cgroup join (the template is a host process), the
supervisor's protocol, and for *init* bwrap's ``--disable-userns`` (it needs
``--unshare-user``: the template would nest a user namespace as bwrap does).

Built since as the *init* way (``stockade/sandbox/_template.py``, the process tier's default as
root; docs/benchmarks.md, "The template, built"): this script stays the mechanism alone.

Imports nothing of stockade; needs root (``setns`` into the namespaces of another user).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time

from _raw import PRINT1, RAW_BWRAP

UID = 1000  # RAW_BWRAP's --uid/--gid
HOST_UID = 65531  # the sandbox's host uid in the init way (an unused one, as the tier leases)
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
PR_SET_DUMPABLE = 4
# Every namespace but the user one first: bwrap's pid-1 runs in a user namespace nested in the
# one that owns the mounts, and once inside it we could no longer enter the mount namespace.
NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "cgroup", "user")
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, PR_SET_NO_NEW_PRIVS = 24, 47, 4, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# A seccomp filter of one instruction (allow): bwrap loads it into pid 1 (--seccomp), the entered
# process loads it too, so that the check below can tell a filter missing (stockade's own filter
# goes the same way: the host has its bytes).
FILTER = struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000)  # BPF_RET|BPF_K, SECCOMP_RET_ALLOW
# What a sandbox's security rests on, in /proc/PID/status: the entered process must equal pid 1
# (bwrap's own child) in each.
STATUS = (
    "Uid", "Gid", "Groups", "Umask", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
    "NoNewPrivs", "Seccomp", "Seccomp_filters",
)  # fmt: skip

libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter(pid: int) -> None:
    """*entered*: in a fork of the template, become a process of the sandbox whose pid 1 is
    ``pid`` (host pid), then fork once more (a pid namespace takes only the children of who
    entered it); returns in that child, the parent exits."""
    fds = [os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in NAMESPACES]
    os.setgroups([])  # here: the sandbox's user namespace denies setgroups (bwrap writes deny)
    for name, fd in zip(NAMESPACES, fds, strict=True):
        _check(libc.setns(fd, 0), f"setns {name}")
        os.close(fd)
    if os.fork():
        os._exit(0)
    os.setresgid(UID, UID, UID)
    os.setresuid(UID, UID, UID)
    # setresuid does not clear the capabilities here: host root is unmapped in the sandbox's
    # namespace, so our uid there was not 0 when it changed. Drop every set by hand.
    drop_privileges()


def make_namespaces() -> None:
    """*init*, in a fork of the template: the sandbox's host uid, a user namespace of its own
    (uid and gid 1000 mapped to it, setgroups denied, as bwrap maps), and a pid namespace
    whose pid 1 is our next child."""
    os.setgroups([])
    os.setresgid(HOST_UID, HOST_UID, HOST_UID)
    os.setresuid(HOST_UID, HOST_UID, HOST_UID)
    _check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")  # the uid change made /proc/self root's
    _check(libc.unshare(CLONE_NEWUSER), "unshare user")
    for name, line in (
        ("setgroups", "deny"),
        ("uid_map", f"{UID} {HOST_UID} 1\n"),
        ("gid_map", f"{UID} {HOST_UID} 1\n"),
    ):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        os.write(fd, line.encode())
        os.close(fd)
    _check(libc.unshare(CLONE_NEWPID), "unshare pid")


def join_placeholder(pid: int) -> None:
    """*init*, in pid 1: the namespaces bwrap made around its placeholder (host ``pid``), the
    mount namespace last (all opened first: once in it, /proc is the sandbox's)."""
    fds = [
        (name, os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC))
        for name in ("net", "ipc", "uts", "cgroup", "mnt")
    ]
    for name, fd in fds:
        _check(libc.setns(fd, 0), f"setns {name}")
        os.close(fd)
    drop_privileges()


def drop_privileges() -> None:
    """Every capability set emptied, no_new_privs, the seccomp filter, a session of our own."""
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the kernel's last capability
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "ambient")
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    _check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    program = ctypes.create_string_buffer(FILTER)

    class SockFprog(ctypes.Structure):
        _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

    fprog = SockFprog(len(FILTER) // 8, ctypes.addressof(program))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp")
    os.setsid()
    os.chdir("/")


def differences_from(other: str) -> dict[str, object]:
    """Where this process differs from ``other`` (bwrap's child in our sandbox: pid 1 or 2)
    in what the sandbox's security rests on: credentials, capabilities, no_new_privs, seccomp,
    umask, every namespace, cgroups, rlimits, root; and whether it leads a session of its own."""

    def status(pid: str) -> dict[str, str]:
        with open(f"/proc/{pid}/status") as fh:
            found = dict(line.split(":", 1) for line in fh.read().splitlines() if ":" in line)
        return {k: " ".join(found[k].split()) for k in STATUS}

    def read(path: str) -> str:
        with open(path) as fh:
            return fh.read()

    ours, theirs = status("self"), status(other)
    wrong: dict[str, object] = {k: (ours[k], theirs[k]) for k in STATUS if ours[k] != theirs[k]}
    for ns in sorted(os.listdir("/proc/self/ns")):
        if os.readlink(f"/proc/self/ns/{ns}") != os.readlink(f"/proc/{other}/ns/{ns}"):
            wrong[f"ns/{ns}"] = "another namespace"
    for what in ("cgroup", "limits"):
        if read(f"/proc/self/{what}") != read(f"/proc/{other}/{what}"):
            wrong[what] = "differs"
    root, theirs_root = os.stat("/"), os.stat(f"/proc/{other}/root/")
    if (root.st_dev, root.st_ino) != (theirs_root.st_dev, theirs_root.st_ino):
        wrong["root"] = "another root"
    if os.getsid(0) != os.getpid():
        wrong["session"] = "not its own"
    if theirs["Uid"].split()[0] != str(UID) or int(theirs["CapBnd"], 16) or theirs["Seccomp"] != "2":
        wrong["baseline"] = "bwrap's child itself is not as bwrap should have made it"
    return wrong


def serve(sock: socket.socket) -> None:
    """The template: one fork per request, which becomes the sandbox's process and prints 1
    (or its differences from bwrap's child) on the pipe sent with the request; then answers.
    ``enter PID CHECK``: the *entered* way into the sandbox around host pid PID. ``init CHECK``:
    the *init* way; with it come a pipe to tell the host where the namespaces are (the fork's
    pid, pid 1's), and one to hear the host pid of bwrap's placeholder."""
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 64, 3)
        if not msg:
            return
        how, *words = msg.decode().split()
        child = os.fork()
        if child == 0:
            try:
                if how == "enter":
                    enter(int(words[0]))
                    other = "1"
                else:
                    make_namespaces()
                    pid_1 = os.fork()
                    if pid_1:  # where the namespaces are, for bwrap to join; then we wait
                        os.write(fds[1], f"{os.getpid()} {pid_1}\n".encode())
                        os.waitpid(pid_1, 0)
                        os._exit(0)
                    join_placeholder(int(read_line(fds[2])))
                    other = "2"
                os.dup2(fds[0], 1)
                print(json.dumps(differences_from(other)) if words[-1] == "1" else 1, flush=True)
            except BaseException as exc:
                os.write(2, f"template: {exc}\n".encode())
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        os.waitpid(child, 0)
        sock.send(b"k")


def read_line(fd: int) -> bytes:
    got = b""
    while not got.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        got += chunk
    return got


def raw() -> float:
    t0 = time.perf_counter()
    out = subprocess.run([*RAW_BWRAP, *PRINT1], capture_output=True, check=True).stdout
    assert out == b"1\n", out
    return time.perf_counter() - t0


def entered(template: socket.socket, check: bool = False) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    info_r, info_w = os.pipe()
    ready_r, ready_w = os.pipe()
    seccomp = filter_fd()
    placeholder = subprocess.Popen(
        [*RAW_BWRAP, "--as-pid-1", "--cap-drop", "ALL", "--info-fd", str(info_w),
         "--seccomp", str(seccomp), "--", *placeholder_command(ready_w)],
        stdin=subprocess.PIPE, pass_fds=(info_w, ready_w, seccomp),
    )  # fmt: skip
    os.close(info_w)
    os.close(ready_w)
    os.close(seccomp)
    info = b""
    while not info.rstrip().endswith(b"}"):
        info += os.read(info_r, 4096)
    pid = json.loads(info)["child-pid"]
    os.read(ready_r, 1)  # the placeholder runs: the mounts are all made
    out_r, out_w = os.pipe()
    socket.send_fds(template, [f"enter {pid} {int(check)}".encode()], [out_w])
    os.close(out_w)
    return finish(t0, template, placeholder, out_r, (info_r, ready_r))


def placeholder_command(ready: int) -> list[str]:
    """pid 1 or 2 of the sandbox while the template's fork comes in: says it runs (the mounts
    are made), then waits for the host to close its stdin. bash: dash takes one-digit fds only."""
    return ["/bin/bash", "-c", f"echo >&{ready}; exec cat"]


def filter_fd() -> int:
    fd = os.memfd_create("filter")
    os.write(fd, FILTER)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def as_init(template: socket.socket, check: bool = False) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    out_r, out_w = os.pipe()
    tell_r, tell_w = os.pipe()
    hear_r, hear_w = os.pipe()
    socket.send_fds(template, [f"init {int(check)}".encode()], [out_w, tell_w, hear_r])
    for fd in (out_w, tell_w, hear_r):
        os.close(fd)
    fork, pid_1 = map(int, read_line(tell_r).split())
    userns = os.open(f"/proc/{fork}/ns/user", os.O_RDONLY)
    pidns = os.open(f"/proc/{pid_1}/ns/pid", os.O_RDONLY)
    seccomp = filter_fd()
    ready_r, ready_w = os.pipe()
    joined = [
        "--userns",
        str(userns),
        "--pidns",
        str(pidns),
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup",
        *(w for w in RAW_BWRAP[1:] if w not in ("--unshare-all", "--unshare-user")),
    ]
    bwrap = [
        "nsenter",
        "-S",
        str(HOST_UID),
        "-G",
        str(HOST_UID),
        "--",
        RAW_BWRAP[0],
        *joined,
        "--cap-drop",
        "ALL",
        "--seccomp",
        str(seccomp),
        "--",
        *placeholder_command(ready_w),
    ]
    placeholder = subprocess.Popen(
        bwrap, stdin=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(userns, pidns, seccomp, ready_w)
    )  # fmt: skip
    for fd in (userns, pidns, seccomp, ready_w):
        os.close(fd)
    if os.read(ready_r, 1) == b"":
        assert placeholder.stderr is not None
        sys.exit(f"bwrap could not join the namespaces: {placeholder.stderr.read().decode()}")
    # Joining a pid namespace, bwrap keeps its child (its --info-fd names an intermediate).
    with open(f"/proc/{placeholder.pid}/task/{placeholder.pid}/children") as fh:
        child = int(fh.read().split()[0])
    os.write(hear_w, f"{child}\n".encode())
    return finish(t0, template, placeholder, out_r, (tell_r, hear_w, ready_r))


def finish(
    t0: float, template: socket.socket, placeholder: subprocess.Popen[bytes], out: int, fds: tuple[int, ...]
) -> tuple[float, bytes]:
    """The sandbox's line on ``out`` and the time since ``t0`` it took; then the template's
    answer, the placeholder's end and the pipes closed."""
    got = read_line(out)
    elapsed = time.perf_counter() - t0
    template.recv(1)
    assert placeholder.stdin is not None
    placeholder.stdin.close()
    placeholder.wait()
    for fd in (out, *fds):
        os.close(fd)
    return elapsed, got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    ours, theirs = socket.socketpair()
    if os.fork() == 0:
        ours.close()
        import site  # noqa: F401 - the template holds what an interpreter needs, loaded once

        serve(theirs)
        os._exit(0)
    theirs.close()

    for way, run in (("entered", entered), ("init", as_init)):
        wrong = json.loads(run(ours, check=True)[1])
        if wrong:
            sys.exit(f"the {way} process is not what bwrap's child in its sandbox is: {wrong}")

    times: dict[str, list[float]] = {"raw": [], "entered": [], "init": []}
    for _ in range(3):
        raw(), entered(ours), as_init(ours)
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        times["raw"].append(raw())
        times["entered"].append(entered(ours)[0])
        times["init"].append(as_init(ours)[0])
    r, e, i = (statistics.median(times[k]) * 1e3 for k in ("raw", "entered", "init"))
    print(f"A warm template, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after, {args.rounds} rounds interleaved\n")  # fmt: skip
    print("| measurement | median | ratio |\n|---|---|---|")
    rows = (
        ("raw bwrap + python3 -c print(1)", r),
        ("entered: the placeholder's start, a fork enters it (pid 2), prints 1", e),
        ("init: a fork makes the user and pid namespaces, bwrap joins them, pid 1 enters, prints 1", i),
    )
    for name, value in rows:
        print(f"| {name} | {value:.1f} ms | {value / r:.2f}x |")
    print("\nChecked before the rounds: each way's process equals bwrap's own child in the sandbox in "
          "its ids, groups, umask, capabilities, no_new_privs, seccomp filters, namespaces, cgroups, "
          "rlimits and root, and leads its own session.")  # fmt: skip
    ours.close()


if __name__ == "__main__":
    main()
