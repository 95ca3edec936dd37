"""What the Docker tier enforces for a spec, and how: its ``Enforcement``, or a refusal.

A part of ``DockerBackend``, apart from the start: the plan is made before anything is
created (``probe`` reports it), and it alone decides what is refused (a full network under
gVisor, an unwalled network, inodes or ptys the host cannot bound, an allowlist the engine
or runtime cannot carry) and what is only weakened under ``allow_weaker``.
"""

from __future__ import annotations

import os

from stockade import exceptions as exc
from stockade.sandbox import _filetable, _guest, _netfull
from stockade.sandbox._docker_settings import DockerSettings
from stockade.sandbox._supervised_calls import TIMEOUT_MARGIN_S, UNPRIORITIZED_TIMEOUT_MARGIN_S
from stockade.sandbox._supervised_config import RELAY_FILES
from stockade.sandbox.base import SandboxSpec
from stockade.types import Enforcement, HostShare, Mechanism


class DockerPlan(DockerSettings):
    """The capability part of ``DockerBackend``."""

    def _plan(self, spec: SandboxSpec) -> Enforcement:
        net = spec.network
        if net.egress:
            self._check_egress()
        if net.unrestricted and self.own_kernel:
            raise exc.LimitNotEnforceable(
                f"the {self.tier} tier runs without network on this host",
                setting="network",
                fix="use tier='docker' for network access",
            )
        weakened: list[str] = []
        walled = False
        if net.unrestricted:
            why = _netfull.unwalled(remote=self.remote)
            if why is not None and not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    f"the {self.tier} tier walls a full-network sandbox off from this host, the private "
                    f"network and other sandboxes with host firewall rules, and {why}",
                    setting="network",
                    fix="run as root beside the engine with iptables, pass allow_weaker=True to accept it, "
                    "or NetworkPolicy(allow_hosts=...) for an allowlist",
                )
            walled = why is None
            if not walled:
                weakened.append(
                    f"network: no firewall rules ({why}): sandboxes on {_netfull.NETWORK} cannot reach each "
                    "other, but reach the engine host's listeners and private addresses (169.254.169.254 too)"
                )
        if self.own_kernel and not self.host_tmpfs:
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    "gVisor's in-sandbox tmpfs cannot limit inodes, and host tmpfs mounts need root",
                    setting="inodes",
                    fix="run as root, or pass allow_weaker=True (inodes then bounded by the memory limit)",
                )
            weakened.append("inodes: bounded by the memory limit (gVisor tmpfs; size still enforced)")
        ptys = self._pty_mechanism()
        if ptys is Mechanism.NONE:
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    "the docker tier bounds a sandbox's ptys from this host, as root, with a local engine",
                    setting="ptys",
                    fix="run as root beside the engine, or pass allow_weaker=True (then only the "
                    "engine host's kernel.pty.max, shared, bounds them)",
                )
            weakened.append("ptys: bounded only by the engine host's kernel.pty.max, shared")
        limits = spec.limits
        if self.own_kernel:  # the container's cgroup holds gVisor's kernel and its gofer too
            own = _guest.own_kernel_limits(spec, self._runtime_platform())
            # gVisor's kernel and gofer get their descriptor limit from the host (root, a
            # local engine); otherwise they keep the engine's own, which no one here sets.
            if not self.host_tmpfs:
                weakened.append("open files: gVisor's host descriptors bounded by the engine's limit only")
            host = HostShare(
                memory_mb=own.host_memory // _guest.MiB,
                tasks=own.host_pids,
                open_files=_guest.gvisor_host_files(_guest.gvisor_fd_limit(limits, self._runtime_dcache())),
            )
        else:
            host = HostShare(
                memory_mb=limits.memory_mb,
                tasks=limits.pids,
                open_files=limits.total_open_files + RELAY_FILES,  # the supervisor's relay too
                mapped_files=_filetable.mapped_files(limits.memory_mb, limits.pids),
            )
        return Enforcement(
            memory=Mechanism.CONTAINER,
            cpus=Mechanism.CONTAINER,
            pids=Mechanism.RLIMIT if self.own_kernel else Mechanism.CONTAINER,
            disk=Mechanism.TMPFS,
            network=Mechanism.PROXY
            if net.egress
            else (Mechanism.FIREWALL if walled else Mechanism.NONE)
            if net.enabled
            else Mechanism.NAMESPACE,
            timeout=Mechanism.SUPERVISOR,
            ptys=ptys,
            host=host,
            weakened=tuple(weakened),
            # gVisor's kernel honours no priority: the supervisor's kill waits its turn
            timeout_margin_s=UNPRIORITIZED_TIMEOUT_MARGIN_S if self.own_kernel else TIMEOUT_MARGIN_S,
        )

    def _pty_mechanism(self) -> Mechanism:
        """runc mounts each container a devpts instance of its own, with no ``max``: the host
        (root, beside the engine) bounds it after the start. gVisor's ptys are its kernel's."""
        if self.own_kernel:
            return Mechanism.OWN_KERNEL
        return Mechanism.DEVPTS if not self.remote and os.geteuid() == 0 else Mechanism.NONE

    def _check_egress(self) -> None:
        """An allowlist needs the proxy's socket bound in: a local engine, and for gVisor a
        runtime that lets the sandbox connect to a host socket it was given."""
        if self.remote:
            raise exc.LimitNotEnforceable(
                f"the {self.tier} tier enforces a network allowlist on a local engine only: the "
                "sandbox reaches its egress proxy through a socket of this host",
                setting="network.allow_hosts",
                fix="run the engine on this host, or NetworkPolicy() for no network",
            )
        if self.own_kernel and not self._runtime_args(("--host-uds=open", "--host-uds=all")):
            raise exc.LimitNotEnforceable(
                f"the Docker runtime {self.runtime!r} does not let gVisor connect to the egress proxy's "
                "socket (its runtimeArgs lack --host-uds=open)",
                setting="network.allow_hosts",
                fix="add --host-uds=open to the runtime's runtimeArgs (scripts/setup-docker.sh), "
                "or use STOCKADE_GVISOR_MODE=runsc",
            )

    def unwalled_network(self) -> str | None:
        return None if self.own_kernel else _netfull.unwalled(remote=self.remote)  # (gVisor refuses it)
