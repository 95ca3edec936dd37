"""The process tier's whole network, walled: a network namespace of the sandbox's own, whose
only way out is slirp4netns, a user-mode TCP/IP stack on the host side.

bubblewrap gives the sandbox a network namespace of its own (its loopback, its abstract
AF_UNIX sockets: none of the host's). slirp4netns, started by the host before any code runs,
puts a tap device in it (``--configure``: 10.0.2.100, gateway 10.0.2.2, resolver 10.0.2.3)
and makes each of the sandbox's connections itself, as an ordinary socket of the host. It
runs as the sandbox's own leased uid (``_host.lease_uid``), in the sandbox's cgroups (its
buffers are the sandbox's traffic), under its own seccomp filter (``--enable-seccomp``).
What it may reach is the host firewall's say (``_netfull.ensure_uid_rules``: not the host's
own addresses, nothing that is not public, no IPv6; the host's resolvers on port 53), and
``--disable-host-loopback`` refuses the gateway, its alias for the host's loopback.
(``--enable-sandbox`` is not used: it needs root in slirp4netns's own user namespace, and
the uid runs it in the host's.)

It ends with the sandbox (``close``), and by itself when the host process that started it
dies: it watches the read end of a pipe whose only writer is that process (``--exit-fd``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from stockade import exceptions as exc
from stockade.sandbox import _netfull

__all__ = ["RESOLV_CONF", "Slirp", "unwalled"]

# slirp4netns's resolver (``--configure``): it forwards to the host's own.
RESOLV_CONF = "nameserver 10.0.2.3\n"
READY_S = 10.0
EXIT_S = 5.0
NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace (linux/nsfs.h)


def unwalled(*, is_root: bool, leased: bool) -> str | None:
    """Why this host cannot wall a process-tier sandbox's whole network, or None."""
    if not is_root:
        return "the walls (a firewall for the sandbox's own host uid) need root"
    if not leased:
        return "the walls need a host uid of the sandbox's own (host_uid pins one for all)"
    if shutil.which("slirp4netns") is None:
        return "slirp4netns not found (apt-get install slirp4netns)"
    return _netfull.unwalled(remote=False)


class Slirp:
    """slirp4netns for one sandbox; ``start`` once, ``close`` any number of times."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._exit_w: int | None = None

    def start(self, pid: int, entering: Callable[[list[str]], list[str]], log: Path) -> None:
        """Attached to the network namespace of ``pid`` (the sandbox's pid 1), returned once
        its tap is configured. ``entering`` wraps the command (the sandbox's uid and cgroups);
        its output goes to ``log`` (out of the sandbox's reach, read if it fails).
        The namespaces are opened here (root may; pid 1 is not dumpable, so its uid may not)
        and handed over as descriptors: the user namespace is the one that owns the network
        namespace, where the sandbox's uid holds the capabilities to enter it."""
        binary = shutil.which("slirp4netns")
        if binary is None:
            raise exc.SandboxStartError("slirp4netns not found")
        mine: list[int] = []
        try:
            netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            mine.append(netns)
            userns = fcntl.ioctl(netns, NS_GET_USERNS)
            mine.append(userns)
            ready_r, ready_w = os.pipe()
            mine += [ready_r, ready_w]
            exit_r, self._exit_w = os.pipe()
            mine.append(exit_r)
            argv = [
                binary,
                "--configure",
                "--mtu=65520",
                "--disable-host-loopback",
                "--enable-seccomp",
                f"--ready-fd={ready_w}",
                f"--exit-fd={exit_r}",
                f"--userns-path=/proc/self/fd/{userns}",
                "--netns-type=path",
                f"/proc/self/fd/{netns}",
                "tap0",
            ]
            with open(log, "wb") as out:
                self.proc = subprocess.Popen(
                    entering(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    env={},
                    close_fds=True,
                    pass_fds=(netns, userns, ready_w, exit_r),
                )
            os.close(ready_w)
            mine.remove(ready_w)
            ready, _, _ = select.select([ready_r], [], [], READY_S)
            if not ready or os.read(ready_r, 1) != b"1":
                self.close()
                said = " / ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
                raise exc.SandboxStartError(f"slirp4netns did not configure the sandbox's network: {said}")
        finally:
            for fd in mine:
                os.close(fd)

    def close(self) -> None:
        """Ended and reaped: told to by its exit pipe, killed if it has not ended by then."""
        if self._exit_w is not None:
            os.close(self._exit_w)
            self._exit_w = None
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=EXIT_S)
