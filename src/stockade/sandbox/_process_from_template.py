"""A process-tier sandbox started from the backend's template (``_template.py``): its pid 1
forked by the template in new user and pid namespaces, then bwrap, joining them, builds the
rest of the sandbox around a placeholder that pid 1 enters (``_template_program.py``).

Apart from the backend: the host's side of that handshake, step by step, with its own
waits and its undoing when a step fails.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from stockade import exceptions as exc
from stockade.sandbox import _cgroups, _template
from stockade.sandbox._process_boundary import children, cleanup_init, end_placeholder
from stockade.sandbox._process_bwrap import START_TIMEOUT_S, memfd, read_head
from stockade.sandbox._supervised_config import WORKSPACE

__all__ = ["from_template"]

# bwrap's child while the template's fork enters what bwrap made: says it runs (the mounts are
# made) by echoing the host's byte, and ends when the host closes its stdin. Opened on the host
# and run through its descriptor (/proc/self/fd/N): a policy's rules may mask it in the sandbox.
PLACEHOLDER = "/usr/bin/cat"


def from_template(
    template: _template.Template,
    rundir: Path,
    *,
    bwrap: str,
    bwrap_options: Callable[[tuple[int, int]], list[str]],
    entering: Callable[[list[str], int, _cgroups.Cgroup | None], list[str]],
    share_net: bool,
    seccomp_fd: int,
    uid: int,
    cgroup: _cgroups.Cgroup | None,
) -> tuple[_template.Init, subprocess.Popen[bytes]]:
    """The sandbox's pid 1, a fork of the template, and bwrap, which builds the rest of
    the sandbox around a placeholder that pid 1 enters (``_template_program.py``).

    ``bwrap_options``: bwrap's, given the user and pid namespaces it joins; ``entering``: an
    argv made to run inside the sandbox's cgroups, as its uid."""
    ctl, ctl_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    entry, entry_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    init: _template.Init | None = None
    placeholder: subprocess.Popen[bytes] | None = None
    # Uncapped, out of code's reach (see ProcessBackend._exec); the template's fork keeps it as fd 2.
    log = os.open(rundir / "bwrap.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    request = {
        "uid": uid,
        "join": cgroup.join_files() if cgroup is not None else [],
        "umask": _umask(),
        "share_net": share_net,
        "chdir": WORKSPACE,
    }
    try:
        try:
            theirs = [ctl_theirs.fileno(), entry_theirs.fileno(), in_r, out_w, log, seccomp_fd]
            template.fork(request, theirs)
        finally:
            for end in (ctl_theirs, entry_theirs):
                end.close()
            for fd in (in_r, out_w):
                os.close(fd)
        said, got = _receive(ctl, 3, rundir)
        keeper, pid_1 = (int(word) for word in said.split())
        pidfd, userns, pidns = got
        pipes = (os.fdopen(in_w, "wb", 0), os.fdopen(out_r, "rb", 0))
        init = _template.Init(pid_1, pidfd, keeper=keeper, ctl=ctl, pipes=pipes)
        passed = [userns, pidns]
        try:
            passed.append(os.open(PLACEHOLDER, os.O_RDONLY | os.O_CLOEXEC))
            options = bwrap_options((userns, pidns))
            passed.append(memfd("stockade-bwrap", b"".join(o.encode() + b"\0" for o in options)))
            argv = [bwrap, "--args", str(passed[-1]), f"/proc/self/fd/{passed[2]}"]
            placeholder = subprocess.Popen(
                entering(argv, uid, cgroup),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env={}, close_fds=True, pass_fds=tuple(passed),
            )  # fmt: skip
        finally:
            for fd in passed:
                os.close(fd)
        assert placeholder.stdin is not None and placeholder.stdout is not None
        placeholder.stdin.write(b"\n")
        placeholder.stdin.flush()
        if not _readable(placeholder.stdout.fileno()) or not os.read(placeholder.stdout.fileno(), 1):
            raise exc.SandboxStartError(f"bwrap did not start: {read_head(rundir / 'bwrap.log')}")
        entry.send(str(_placeholder_of(placeholder.pid)).encode())
        if not _readable(entry.fileno()) or entry.recv(16) != b"entered":
            raise exc.SandboxStartError(
                f"the sandbox's pid 1 did not start: {read_head(rundir / 'bwrap.log')}"
            )
        placeholder.stdin.close()  # its namespaces are pid 1's now: bwrap may end
        return init, placeholder
    except BaseException:
        if init is not None:
            cleanup_init(init)
        else:
            ctl.close()
            os.close(in_w)
            os.close(out_r)
        if placeholder is not None:
            end_placeholder(placeholder)
        raise
    finally:
        entry.close()
        os.close(log)


def _placeholder_of(bwrap: int) -> int:
    """bwrap's child in the sandbox (pid 2 there). Joining a pid namespace, bwrap forks a
    child that forks the placeholder and exits; bwrap, a subreaper, adopts the placeholder,
    and may not have reaped the first child yet: the placeholder is the child that is in
    the sandbox's pid namespace (two numbers in ``NSpid``)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        for child in children(bwrap):
            with contextlib.suppress(OSError), open(f"/proc/{child}/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"NSpid:") and len(line.split()) == 3:
                        return child
        if time.monotonic() > deadline:
            raise exc.SandboxStartError("bwrap's placeholder is not where it should be")
        time.sleep(0.001)


def _readable(fd: int, timeout: float = START_TIMEOUT_S) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def _receive(sock: socket.socket, count: int, rundir: Path) -> tuple[str, list[int]]:
    """The keeper's first word, with its ``count`` descriptors; SandboxStartError (with what
    it said on the log) if it ended, or took too long, without them."""
    if _readable(sock.fileno()):
        said, fds, _, _ = socket.recv_fds(sock, 64, count)
        if len(fds) == count:
            return said.decode(), fds
        for fd in fds:
            os.close(fd)
    log = read_head(rundir / "bwrap.log")
    raise exc.SandboxStartError(
        f"the process tier's template could not start the sandbox: {log or 'no word'}"
    )


def _umask() -> int:
    """This process's umask, which bwrap gives its child (read, not set: os.umask would
    change it for every thread meanwhile)."""
    with open("/proc/self/status", "rb") as fh:
        for line in fh:
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    return 0o022
