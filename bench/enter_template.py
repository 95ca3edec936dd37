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
Each round also checks what the entered process is against what a sandboxed process must be
(uid, gid, no groups, no capabilities in any set, no_new_privs, its own session, pid 2 of the
sandbox's namespace, the sandbox's root): a mechanism that is fast because it skipped a step is
not measured. Not in the prototype (costs to add, each small): the seccomp filter, the cgroup
join, rlimits, the supervisor's protocol.

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
import subprocess
import sys
import time

from _raw import PRINT1, RAW_BWRAP

UID = 1000  # RAW_BWRAP's --uid/--gid
# Every namespace but the user one first: bwrap's pid-1 runs in a user namespace nested in the
# one that owns the mounts, and once inside it we could no longer enter the mount namespace.
NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "cgroup", "user")
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, PR_SET_NO_NEW_PRIVS = 24, 47, 4, 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522

libc = ctypes.CDLL(None, use_errno=True)


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
    os.setsid()
    os.chdir("/")


def what_i_am() -> dict[str, object]:
    with open("/proc/self/status") as fh:
        status = dict(line.split(":", 1) for line in fh.read().splitlines() if ":" in line)
    fields = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")
    return {
        **{k: status[k].split() for k in fields},
        "pid": os.getpid(),
        "session leader": os.getsid(0) == os.getpid(),
        "root": sorted(os.listdir("/")),
    }


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
                    print(json.dumps(what_i_am()), flush=True)
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
    placeholder = subprocess.Popen(
        [*RAW_BWRAP, "--as-pid-1", "--info-fd", str(info_w), "--",
         "/bin/sh", "-c", f"echo >&{ready_w}; exec cat"],
        stdin=subprocess.PIPE, pass_fds=(info_w, ready_w),
    )  # fmt: skip
    os.close(info_w)
    os.close(ready_w)
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
    me = json.loads(got)
    want = {
        "Uid": [str(UID)] * 4, "Gid": [str(UID)] * 4, "Groups": [], "NoNewPrivs": ["1"], "pid": 2,
        "session leader": True, **{c: ["0" * 16] for c in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")},
    }  # fmt: skip
    wrong = {k: me[k] for k, v in want.items() if me[k] != v}
    if wrong or "usr" not in me["root"] or "root" in me["root"]:
        sys.exit(f"the entered process is not a sandboxed one: {wrong}, root {me['root']}")

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
    print("\nThe entered process checked: uid/gid 1000, no groups, no capabilities, no_new_privs, "
          "pid 2 of the sandbox, its own session, the sandbox's root.")  # fmt: skip
    ours.close()


if __name__ == "__main__":
    main()
