"""A mechanism measured ahead of building it: a warm Python entering a new sandbox's namespaces.

    sudo python bench/enter_template.py --rounds 40

The process tier's cold start pays two Python starts (the supervisor's, then `site` in the
zygote at the first ``run_code``) on top of bubblewrap: 1.65-1.74x raw bwrap running the same
``print(1)`` (issue 13's target: 1.3x, and at or below raw as the ambition). No order of those
starts reaches the target (docs/benchmarks.md, "Where a cold start's time goes"). This script
measures the design that would: a *template*, one host process per backend with Python and
`site` loaded, that holds nothing of any user; per sandbox, bubblewrap builds the namespaces
and mounts as today but runs only a placeholder as pid 1, and a fork of the template enters
those namespaces (``setns``), forks into the pid namespace, takes the sandbox's credentials
and runs the code. Python starts once per host, not once per sandbox.

Compared, interleaved round by round, the same work: raw bwrap with every namespace running
``python3 -c 'print(1)'`` against the placeholder's start plus the entered fork printing 1.
Before the timed rounds, an entered process compares itself with pid 1 of its sandbox (bwrap's
own child, with a seccomp filter and no capabilities, as stockade starts one) in everything a
sandbox's security rests on: ids, groups, umask, every capability set, no_new_privs, seccomp
filters, every namespace, cgroups, rlimits, root, and a session of its own; any difference
stops the script: a mechanism that is fast because it skipped a step is not measured. Not in
the prototype (costs to add, each small): the cgroup join (the template is a host process), the
supervisor's protocol.

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
    """In a fork of the template: become a process of the sandbox whose pid 1 is ``pid``
    (host pid), then fork once more (a pid namespace takes only the children of who
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


def differences_from_pid_1() -> dict[str, object]:
    """Where this process differs from pid 1 of its sandbox (bwrap's child) in what the
    sandbox's security rests on: credentials, capabilities, no_new_privs, seccomp, umask, every
    namespace, cgroups, rlimits, root; and whether it leads a session of its own."""

    def status(pid: str) -> dict[str, str]:
        with open(f"/proc/{pid}/status") as fh:
            found = dict(line.split(":", 1) for line in fh.read().splitlines() if ":" in line)
        return {k: " ".join(found[k].split()) for k in STATUS}

    def read(path: str) -> str:
        with open(path) as fh:
            return fh.read()

    ours, theirs = status("self"), status("1")
    wrong: dict[str, object] = {k: (ours[k], theirs[k]) for k in STATUS if ours[k] != theirs[k]}
    for ns in sorted(os.listdir("/proc/self/ns")):
        if os.readlink(f"/proc/self/ns/{ns}") != os.readlink(f"/proc/1/ns/{ns}"):
            wrong[f"ns/{ns}"] = "another namespace"
    for what in ("cgroup", "limits"):
        if read(f"/proc/self/{what}") != read(f"/proc/1/{what}"):
            wrong[what] = "differs"
    root, theirs_root = os.stat("/"), os.stat("/proc/1/root/")
    if (root.st_dev, root.st_ino) != (theirs_root.st_dev, theirs_root.st_ino):
        wrong["root"] = "another root"
    if os.getsid(0) != os.getpid():
        wrong["session"] = "not its own"
    if theirs["Uid"].split()[0] != str(UID) or int(theirs["CapBnd"], 16) or theirs["Seccomp"] != "2":
        wrong["baseline"] = "pid 1 itself is not as bwrap should have made it"
    return wrong


def serve(sock: socket.socket) -> None:
    """The template: forks one entered process per request (the placeholder's pid, the pipe
    its output goes to), waits for it, answers."""
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
        if not msg:
            return
        pid, check = msg.decode().split()
        child = os.fork()
        if child == 0:
            try:
                enter(int(pid))
                os.dup2(fds[0], 1)
                if check == "1":
                    print(json.dumps(differences_from_pid_1()), flush=True)
                else:
                    print(1, flush=True)
            except BaseException as exc:
                os.write(2, f"enter: {exc}\n".encode())
            finally:
                os._exit(0)
        os.close(fds[0])
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
    seccomp = os.memfd_create("filter")
    os.write(seccomp, FILTER)
    os.lseek(seccomp, 0, os.SEEK_SET)
    placeholder = subprocess.Popen(
        [*RAW_BWRAP, "--as-pid-1", "--cap-drop", "ALL", "--info-fd", str(info_w),
         "--seccomp", str(seccomp), "--", "/bin/sh", "-c", f"echo >&{ready_w}; exec cat"],
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
    socket.send_fds(template, [f"{pid} {int(check)}".encode()], [out_w])
    os.close(out_w)
    got = read_line(out_r)
    elapsed = time.perf_counter() - t0
    template.recv(1)
    assert placeholder.stdin is not None
    placeholder.stdin.close()
    placeholder.wait()
    for fd in (out_r, info_r, ready_r):
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

    _, got = entered(ours, check=True)
    wrong = json.loads(got)
    if wrong:
        sys.exit(f"the entered process is not what pid 1 of its sandbox is: {wrong}")

    raws, ents = [], []
    for _ in range(3):
        raw()
        entered(ours)
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        raws.append(raw())
        ents.append(entered(ours)[0])
    r, e = statistics.median(raws) * 1e3, statistics.median(ents) * 1e3
    print(f"Entering a warm template, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after, {args.rounds} rounds interleaved\n")  # fmt: skip
    print("| measurement | median | ratio |\n|---|---|---|")
    print(f"| raw bwrap + python3 -c print(1) | {r:.1f} ms | 1.00x |")
    print(f"| placeholder's start + entered fork prints 1 | {e:.1f} ms | {e / r:.2f}x |")
    print("\nChecked before the rounds: the entered process equals pid 1 (bwrap's child) in its ids, "
          "groups, umask, capabilities, no_new_privs, seccomp filters, namespaces, cgroups, rlimits "
          "and root, and leads its own session.")  # fmt: skip
    ours.close()


if __name__ == "__main__":
    main()
