"""What the process tier enforces for a spec, and how: its ``Enforcement``, or a refusal.

A part of ``ProcessBackend``, apart from the start: the plan is made before anything is
created (``probe`` reports it), and it alone decides what is refused (limits without a cgroup,
inodes, ptys and a network the host shares, without root or consent) and what is only
weakened under ``allow_weaker``.
"""

from __future__ import annotations

from stockade import exceptions as exc
from stockade.sandbox import _filetable, _rules
from stockade.sandbox._process_settings import ProcessSettings
from stockade.sandbox._supervised_config import RELAY_FILES
from stockade.sandbox.base import SandboxSpec
from stockade.types import Enforcement, HostShare, Mechanism, NetworkPolicy


class ProcessPlan(ProcessSettings):
    """The capability part of ``ProcessBackend``."""

    def _plan(self, spec: SandboxSpec) -> Enforcement:
        cg = self._cgroups.mechanism
        weakened: list[str] = []
        if cg is Mechanism.NONE:
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    f"the process tier cannot enforce memory/cpu/pids limits here: {self._cgroups.detail}",
                    setting="memory,cpus,pids",
                    fix="run as root (or in a delegated cgroup), or pass allow_weaker=True for rlimits",
                )
            weakened += [
                "memory: RLIMIT_AS per process instead of a cgroup for the whole sandbox",
                "pids: RLIMIT_NPROC of the user instead of a cgroup",
                "cpus: not limited (no cgroup); timeouts still apply",
            ]
        disk = Mechanism.TMPFS
        if not self.is_root:
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    "the process tier can only bound the workspace's inodes as root",
                    setting="inodes",
                    fix="run as root, or pass allow_weaker=True (inodes then bounded by memory only)",
                )
            weakened.append("inodes: bounded by the memory limit (tmpfs size still enforced)")
            # (the bound is the host's remount of the sandbox's devpts: root's alone)
            weakened.append("ptys: bounded only by the host's kernel.pty.max, shared (no root)")
            if _rules.written_noexec(spec):  # (allow_weaker is already needed for the inodes)
                weakened.append(
                    "commands.allow: the written places are not noexec (bubblewrap's tmpfs, without root): "
                    "a library the code wrote can be loaded into a listed program"
                )
        net = spec.network
        if self._host_net(spec):
            if not spec.allow_weaker:
                raise exc.LimitNotEnforceable(
                    "network access on the process tier shares the host's network stack here: its "
                    f"loopback services and abstract AF_UNIX sockets ({self.unwalled})",
                    setting="network",
                    fix="run as root with iptables and slirp4netns, pass allow_weaker=True to accept it, "
                    "or use the docker tier",
                )
            weakened.append(
                "network: the host's own network stack is shared: its loopback services (databases, "
                "queues, APIs on 127.0.0.1), its abstract AF_UNIX sockets, and all it reaches "
                f"({self.unwalled})"
            )
        limited = cg if cg is not Mechanism.NONE else Mechanism.RLIMIT
        limits = spec.limits
        return Enforcement(
            memory=limited,
            cpus=cg,
            pids=limited,
            disk=disk,
            network=_network_mechanism(net, walled=net.unrestricted and not self._host_net(spec)),
            timeout=Mechanism.SUPERVISOR,
            ptys=Mechanism.DEVPTS if self.is_root else Mechanism.NONE,
            # The cgroup holds all of it: processes (bwrap's own included), their kernel
            # memory, and the tmpfs pages their files are.
            host=HostShare(
                memory_mb=limits.memory_mb,
                tasks=limits.pids,
                open_files=limits.total_open_files + RELAY_FILES,  # the supervisor's relay too
                mapped_files=_filetable.mapped_files(limits.memory_mb, limits.pids),
            )
            if cg is not Mechanism.NONE
            else None,
            weakened=tuple(weakened),
        )


def _network_mechanism(net: NetworkPolicy, *, walled: bool) -> Mechanism:
    if net.egress:
        return Mechanism.PROXY  # a network namespace whose only way out is the proxy's socket
    if walled:
        return Mechanism.FIREWALL  # a namespace whose way out is slirp4netns, walled (_slirp.py)
    return Mechanism.NONE if net.unrestricted else Mechanism.NAMESPACE
