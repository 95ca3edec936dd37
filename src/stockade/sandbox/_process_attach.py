"""What the host attaches to a process-tier sandbox bwrap has started, before any code runs
in it: through its pid 1, the devpts bounded, the network namespace quieted and slirp4netns
(the walled whole network's way out); and the egress proxy, for a network with an allowlist.

Apart from the backend: each reaches into a made sandbox from outside, and closes it if it
cannot.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from stockade import exceptions as exc
from stockade.sandbox import _slirp, _template
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._host import bound_ptys, quiet_network
from stockade.sandbox._process_boundary import children
from stockade.sandbox._supervised import SupervisedInstance
from stockade.sandbox.base import SandboxSpec

__all__ = ["attach_egress", "attach_slirp", "bound_sandbox_ptys", "quiet_sandbox_network"]


def bound_sandbox_ptys(
    instance: SupervisedInstance, proc: subprocess.Popen[bytes] | _template.Init, most: int
) -> None:
    """bwrap's devpts (``--dev``: a new instance, no ``max``) bounded from the host, through
    the supervisor: pid 1, or bwrap's child. The sandbox closed if it cannot be."""
    try:
        pids = [proc.pid] if isinstance(proc, _template.Init) else children(proc.pid)
        if not pids:
            raise exc.SandboxStartError("the sandbox's pid 1 was not found to bound its ptys")
        bound_ptys(pids[0], most)
    except BaseException:
        instance.close()
        raise


def quiet_sandbox_network(
    instance: SupervisedInstance, proc: subprocess.Popen[bytes] | _template.Init
) -> None:
    """The sandbox's own network namespace keeps no TIME_WAIT and no transmit timestamp
    carrying data (``_host.quiet_network``): bwrap made it, so the host writes them, through
    pid 1, before any code has run (measured before: a sandbox started so kept the host's
    settings, ~1 GB of uncharged timestamps and 131,072 TIME_WAIT sockets within reach).
    The sandbox closed if they cannot be written."""
    try:
        pids = [proc.pid] if isinstance(proc, _template.Init) else children(proc.pid)
        if not pids:
            raise exc.SandboxStartError("the sandbox's pid 1 was not found to set its network up")
        quiet_network(pids[0])
    except BaseException:
        instance.close()
        raise


def attach_slirp(
    instance: SupervisedInstance,
    proc: subprocess.Popen[bytes] | _template.Init,
    slirp: _slirp.Slirp,
    entering: Callable[[list[str]], list[str]],
    rundir: Path,
) -> None:
    """slirp4netns in the sandbox's network namespace, through pid 1. The sandbox closed
    (slirp4netns with it) if it cannot be started."""
    try:
        pids = [proc.pid] if isinstance(proc, _template.Init) else children(proc.pid)
        if not pids:
            raise exc.SandboxStartError("the sandbox's pid 1 was not found to give it its network")
        slirp.start(pids[0], entering, rundir / "slirp4netns.log")
    except BaseException:
        instance.close()
        raise


def attach_egress(spec: SandboxSpec, rundir: Path, uid: int | None) -> EgressHandle | None:
    """The sandbox's egress proxy (``stockade.egress``), when its network has an allowlist."""
    if not spec.network.egress:
        return None
    from stockade.egress import attach

    return attach(spec, rundir / "egress", uid=uid)
