"""How a host holds a sandbox to what was asked (``Enforcement``, ``Mechanism``, ``HostShare``),
what ``stockade doctor`` says of a tier (``TierReport``), and who the code is trusted as
(``Trust``).

Apart because these are about tiers: what one holds on this host, and which one a caller's
trust needs; never what a sandbox is asked to do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Mechanism(enum.StrEnum):
    """How a setting is enforced on this host."""

    CGROUP_V2 = "cgroup-v2"
    CGROUP_V1 = "cgroup-v1"
    RLIMIT = "rlimit"
    TMPFS = "tmpfs"
    NAMESPACE = "namespace"
    SUPERVISOR = "supervisor"
    CONTAINER = "container"
    VM = "vm"
    LANDLOCK = "landlock"  # the kernel's access control, applied to every process of the code
    SECCOMP_NOTIFY = "seccomp-notify"  # the kernel stops every exec until the supervisor rules
    MASK = "mask"  # what is denied is not there: an empty, unreadable file in its place
    PROXY = "proxy"  # no route out but an allowlist proxy on the host (stockade.egress)
    DEVPTS = "devpts"  # the sandbox's own devpts instance, its max= set by the host
    OWN_KERNEL = "own-kernel"  # the sandbox's kernel's own (gVisor's, a guest's): none of the host's
    FIREWALL = "firewall"  # the host's firewall: public addresses only, not the host's, no other sandbox
    NONE = "none"


@dataclass(frozen=True, kw_only=True)
class HostShare:
    """The most one sandbox can take from the host, everything in it together, as held here.

    ``memory_mb`` covers its processes, the kernel's memory for them (open files, page
    tables) and the files of /workspace, /tmp and /dev/shm, which are memory; a tier with a
    kernel of its own (gVisor, the microVM) adds that kernel. ``tasks`` counts host
    processes and threads, ``open_files`` the host's file descriptors. Each is a hard limit
    on this host (a cgroup or a kernel limit), not an estimate. ``mapped_files`` counts the
    host's open files held through mappings alone (``mmap``, then ``close``), which no
    descriptor limit sees: bounded by ``memory_mb`` (384 bytes of kernel memory each,
    charged) and by ``vm.max_map_count`` per task; 0 on the microVM, whose kernel maps its
    files in its own memory, and on gVisor, whose kernel holds host descriptors for the
    files mapped inside (about two each) under a descriptor limit of its own, which
    ``open_files`` states (when the code reaches it, its opens and mmaps of files fail with
    ``EMFILE``). The host's file table holds at most ``open_files + mapped_files`` of the
    sandbox's.
    """

    memory_mb: int
    tasks: int
    open_files: int
    mapped_files: int = 0


@dataclass(frozen=True, kw_only=True)
class Enforcement:
    """What is in effect for one sandbox, setting by setting.

    ``weakened`` lists, in words, every setting enforced less strictly than asked;
    it is empty unless the caller passed ``allow_weaker=True``.
    """

    memory: Mechanism
    cpus: Mechanism
    pids: Mechanism
    disk: Mechanism
    network: Mechanism
    timeout: Mechanism
    files: Mechanism = Mechanism.RLIMIT
    ptys: Mechanism = Mechanism.NONE  # NONE: only the host's kernel.pty.max, shared
    # The policy, from inside (SandboxRules): how execs are judged, how the workspace's
    # read-only paths are held, how denied programs are kept from running.
    commands: Mechanism = Mechanism.NONE
    paths: Mechanism = Mechanism.NONE
    programs: Mechanism = Mechanism.NONE
    host: HostShare | None = None  # None where this host cannot hold the total (rlimits only)
    weakened: tuple[str, ...] = ()
    # A call past its timeout_s has stopped within this much more, however busy the host is
    # (the supervisor kills it at the deadline, running above the code's priority; more on a
    # kernel that honours no priority: gVisor's, a guest emulated under TCG).
    timeout_margin_s: float = 1.0


class Trust(enum.StrEnum):
    """Who wrote the code and who the user is: decides the minimum tier (the README's trust table)."""

    TRUSTED = "trusted"  # your own team wrote it
    INTERNAL = "internal"  # an LLM, for an internal trusted user
    UNTRUSTED = "untrusted"  # an LLM, for an untrusted external user
    MULTI_TENANT = "multi-tenant"  # users share hosts


@dataclass(frozen=True, kw_only=True)
class TierReport:
    """What ``stockade doctor`` says about one tier on this host."""

    tier: str
    available: bool
    detail: str
    enforcement: Enforcement | None = None
    fixes: tuple[str, ...] = ()
