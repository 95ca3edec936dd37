"""What the direct runsc mode of the gVisor tier is: its settings and what it enforces.

The base of ``RunscBackend`` (``gvisor.py``): where runsc and the offline rootfs are, the
runsc command line every call shares, what the host must have (``_check``), the enforcement a
spec gets (``_plan``), the supervisor compiled once per rootfs, and the calls on a running
sandbox (signal, delete, pause/resume/checkpoint). Apart from the launch (``_gvisor_launch``),
which builds on it, and from the choice between Docker and runsc (``gvisor.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from stockade import exceptions as exc
from stockade.sandbox import _guest, _gvisor_memory
from stockade.sandbox._rootfs import find_rootfs
from stockade.sandbox._supervised_calls import UNPRIORITIZED_TIMEOUT_MARGIN_S
from stockade.sandbox.base import Backend, SandboxSpec
from stockade.types import Enforcement, HostShare, Mechanism

START_TIMEOUT_S = 30.0
DEFAULT_PLATFORM = "systrap"
# Not the process tier's "stockade": its garbage collector owns every cgroup under that one.
CGROUP_PARENT = "stockade-gvisor"


class RunscSettings(Backend):
    """The part of ``RunscBackend`` that holds its settings and the runsc calls it makes."""

    tier = "gvisor"

    def __init__(
        self,
        *,
        platform: str = DEFAULT_PLATFORM,
        rootfs: Path | None = None,
        runsc: str | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self.platform = platform
        self.rootfs = Path(rootfs) if rootfs else find_rootfs()
        self.runsc = runsc or shutil.which("runsc") or ""
        self.state_dir = state_dir or _guest.default_state_dir()
        self.root = self.state_dir / "runsc"
        self.creator = _guest.current_creator()
        self._collected = False
        self._compile_failed = False

    def _argv(self, *args: str, egress: bool = False) -> list[str]:
        # --host-uds=open: the sandbox may connect to a host socket bound into it (the egress
        # proxy's, the only one there is).
        uds = ["--host-uds=open"] if egress else []
        return [
            self.runsc,
            "--root",
            str(self.root),
            f"--platform={self.platform}",
            "--network=none",
            *uds,
            *args,
        ]

    def _check(self, *, rootfs: bool = True) -> None:
        """What runsc needs here (``rootfs``: the offline root filesystem too; the restore of a
        container's image has its image's own)."""
        if not self.runsc:
            raise exc.TierUnavailable(
                "runsc is not installed: apt-get install runsc (or bash scripts/setup-docker.sh)"
            )
        if os.geteuid() != 0:
            raise exc.TierUnavailable(
                "runsc without Docker needs root here (rootless runsc cannot set limits)"
            )
        if rootfs and (self.rootfs is None or not (self.rootfs / "usr/bin/python3").exists()):
            raise exc.ImageNotFound(
                "no offline root filesystem with python3 for runsc; build it with "
                "`stockade image build --offline`, or set STOCKADE_ROOTFS"
            )

    def _plan(self, spec: SandboxSpec) -> Enforcement:
        if spec.network.unrestricted:
            raise exc.LimitNotEnforceable(
                "the gvisor tier gives no network but through an allowlist proxy",
                setting="network",
                fix="list the hosts (NetworkPolicy(allow_hosts=...)), or use tier='docker'",
            )
        own = _guest.own_kernel_limits(spec, self.platform)
        return Enforcement(
            memory=Mechanism.CONTAINER,
            cpus=Mechanism.CONTAINER,
            pids=Mechanism.RLIMIT,
            disk=Mechanism.TMPFS,
            network=Mechanism.PROXY if spec.network.egress else Mechanism.NAMESPACE,
            timeout=Mechanism.SUPERVISOR,
            ptys=Mechanism.OWN_KERNEL,  # its kernel's own ptys, none of the host's
            host=HostShare(
                memory_mb=own.host_memory // _guest.MiB,
                tasks=own.host_pids,
                open_files=_guest.gvisor_host_files(_guest.gvisor_fd_limit(spec.limits)),
            ),
            timeout_margin_s=UNPRIORITIZED_TIMEOUT_MARGIN_S,  # its kernel honours no priority
        )

    def unwalled_network(self) -> str | None:
        return None  # it refuses a whole network itself (``_plan``)

    def _compile(self, folder: Path) -> None:
        """Once per rootfs: its python compiles the supervisor, inside gVisor (``runsc do``).

        Best effort: without bytecode the supervisor compiles itself on every start.
        """
        assert self.rootfs is not None
        argv = [self.runsc, f"--platform={self.platform}", "--network=none", "do", "--root", str(self.rootfs)]
        try:
            done = subprocess.run(
                [*argv, "python3", "-S", "-E", "-s", "-c", _guest.COMPILE],
                input=json.dumps(_guest.python_sources(folder)).encode(),
                capture_output=True,
                env={"PATH": "/usr/bin:/bin"},
                timeout=START_TIMEOUT_S,
                check=True,
            )
            _guest.install_bytecode(folder, str(self.rootfs), json.loads(done.stdout))
        except (OSError, ValueError, KeyError, subprocess.SubprocessError):
            self._compile_failed = True

    def signal(self, sid: str, name: str) -> None:
        subprocess.run(
            self._argv("kill", "--all", sid, name),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            check=False,
        )

    def destroy(self, sid: str) -> None:
        subprocess.run(
            self._argv("delete", "--force", sid),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            check=False,
        )

    def runsc_call(self, *args: str, check: bool = True) -> None:
        """``runsc pause``, ``resume`` or ``checkpoint`` on a sandbox (``SnapshotError``)."""
        _gvisor_memory.call_runsc(self._argv(*args), check=check)
