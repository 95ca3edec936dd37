"""Frozen value objects shared by every part of stockade."""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from stockade._checks import MAX_TIMEOUT_S, check_number, check_strings, check_text
from stockade._globs import workspace_globs
from stockade.exceptions import InvalidArgument

__all__ = [
    "CommandResult",
    "Credential",
    "DownloadResult",
    "EgressRecord",
    "Enforcement",
    "EntryInfo",
    "EntryType",
    "ExecRecord",
    "Execution",
    "ExecutionError",
    "HostRule",
    "HostShare",
    "JudgedExecs",
    "Limits",
    "Listing",
    "Logs",
    "Mechanism",
    "NetworkPolicy",
    "ReadOnly",
    "Result",
    "SandboxRules",
    "SecretSource",
    "SkippedEntry",
    "Snapshot",
    "SnapshotKind",
    "TierReport",
    "Trust",
]

MiB = 1024 * 1024
MIN_FILES_PER_PROCESS = 32  # Python and a shell need about 10 each
# The most kernel memory one file can take beyond the bytes a tmpfs counts, its name at the
# longest (255 bytes): its inode, dentry and name. Measured as the growth of the sandbox's
# cgroup over 8,000-20,000 of them: process 1,572 bytes a file, folder or short symlink,
# 1,966 with the user xattrs an inode's share of a tmpfs allows; docker 1,520 and 1,835
# (the host's slab, charged to the sandbox); gVisor 2,149-2,280 a file, 2,360 a folder,
# 2,371 a symlink, 2,512 a symlink past its target's page (its kernel's dentry beside the
# host's inode); the microVM 2,202 a file (the guest's pages, seen from the host). The
# largest, with a fifth more for other kernels' slabs.
FILE_COST_BYTES = 3072
INODES_PER_MIB = 64  # the workspace's files by default: 32,768 at 512 MiB, 96 MiB of that
MIN_SCRATCH_INODES = 256  # /tmp's and /dev/shm's at the least (a build's temporary files)
MAX_INODES = 2**31 - 1  # a tmpfs's nr_inodes on every tier's kernel
MAX_PENDING_APPROVALS = 100  # requests a run keeps pending at most (RunLimits.max_pending_approvals)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Resource limits of one sandbox. Every tier enforces all of them or says it cannot.

    ``timeout_s`` is the default wall-clock limit of each command or ``run_code`` call; its
    clock stands still while an exec of the call waits for the sandbox's ``approver`` (a
    human's time is not the code's), for at most ``approval_wait_s`` of the call in all
    (the wall time during which at least one of its execs waited): past it, the call's
    deadline runs even while an exec waits, so that code which keeps an approval pending
    at all times still ends within ``timeout_s + approval_wait_s``;
    ``output_bytes`` caps stdout and stderr each, and a ``run_code``'s results and error
    together (bytes of JSON, cut inside with a mark: ``Execution.truncated``).
    ``open_files`` bounds the file descriptors the whole sandbox can hold: each of its (at
    most ``pids``) processes may open
    ``open_files // pids``, and at least 32 (``files_per_process``, ``total_open_files``).
    ``ptys`` bounds the pseudo-terminals it can hold open at once (its devpts instance's
    ``max``: past it, opening /dev/ptmx fails with ENOSPC), out of the host's shared
    ``kernel.pty.max``; a tier with a kernel of its own (gVisor, the microVM) takes none of the
    host's: its ptys, if any, are its kernel's, in its memory (``Enforcement.ptys``).

    The workspace, /tmp and /dev/shm are memory (tmpfs), charged to ``memory_mb``: everything
    the sandbox takes from the host's memory, processes and files together, stays within it,
    but for kernel memory a (v1) cgroup does not charge, bounded apart: TCP buffers (an
    eighth of it, at least 16 MiB) and POSIX file locks (4,096, 768 KiB, counted by the host,
    which kills the processes holding the most past them, as for memory). On gVisor, memory
    its kernel holds outside a process's address space (TCP buffers, a memfd, pipe buffers,
    AF_UNIX queues) has no bound apart: filling it ends the whole sandbox
    (``SandboxCrashed(cause="out_of_memory")``), where a process's own allocations are a
    ``MemoryError``. There and on the microVM, ``RLIMIT_AS = memory_mb`` per process also
    bounds threads (each thread's 8 MiB stack is address space; those tiers set
    ``MALLOC_ARENA_MAX=1``, so that no 64 MiB arena a thread counts too): about
    ``memory_mb / 8 MiB`` a process, whatever ``pids`` (code that needs more sets
    ``threading.stack_size()``).
    The workspace holds ``disk_mb`` MiB (three eighths of ``memory_mb`` unless given) and
    ``inodes`` files and folders (64 per MiB of ``memory_mb`` unless given: 32,768 at the
    default 512, room for a node_modules of that many files); /tmp and /dev/shm hold ``tmp_mb``
    each (a sixteenth of ``memory_mb``, at most 64, unless given) and an eighth of ``inodes``
    (at least 256). A file costs kernel memory no size counts, empty or not (its inode, its
    dentry and its name: up to ``FILE_COST_BYTES``, 3 KiB, on the tier that needs the most),
    so the rule is: everything the places can hold, their bytes and their files at that cost,
    takes at most three quarters of ``memory_mb``, and a ``Limits`` that breaks it is refused
    (``InvalidArgument`` naming the fields). So a full workspace is ``WorkspaceFull`` (ENOSPC
    inside), files past a place's count fail with ENOSPC, not a sandbox killed for memory,
    and a sandbox whose places are full still answers and resets.
    """

    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 128
    timeout_s: float = 30.0
    disk_mb: int | None = None
    inodes: int | None = None
    tmp_mb: int | None = None
    output_bytes: int = 1 * MiB
    open_files: int = 16384
    ptys: int = 64
    approval_wait_s: float = 900.0

    def __post_init__(self) -> None:
        for name, (integer, low, high, unit) in _LIMIT_RANGES.items():
            value = getattr(self, name)
            if value is None and name in ("disk_mb", "tmp_mb", "inodes"):
                continue  # sized from memory_mb
            check_number(
                value, argument=f"Limits.{name}", integer=integer, low=low, high=high,
                unit=unit, low_inclusive=low > 0 or name == "approval_wait_s",  # 0: never stands still
            )  # fmt: skip
        if 4 * self.files_memory > 3 * self.memory_mb * MiB:
            given = [name for name in ("disk_mb", "tmp_mb", "inodes") if getattr(self, name) is not None]
            needed = _least_memory(self.memory_mb, self.disk_mb, self.tmp_mb, self.inodes)
            raise InvalidArgument(
                f"Limits: the workspace ({self.workspace_mb} MiB, {self.workspace_inodes:,} files) "
                f"and /tmp and /dev/shm ({self.tmp_size_mb} MiB, {self.scratch_inodes:,} files "
                f"each) are memory, each file up to {FILE_COST_BYTES:,} bytes of the kernel's "
                f"even empty: {-(-self.files_memory // MiB)} MiB in all, which would leave less "
                f"than a quarter of memory_mb={self.memory_mb} to the processes",
                argument="Limits." + (given[-1] if given else "memory_mb"),
                fix=f"raise memory_mb to at least {needed}, or lower "
                + (", ".join(given) if given else "disk_mb, tmp_mb or inodes"),
            )

    @property
    def workspace_mb(self) -> int:
        """The workspace's size: ``disk_mb``, or three eighths of ``memory_mb`` when not given."""
        return _workspace_mb(self.memory_mb, self.disk_mb)

    @property
    def workspace_inodes(self) -> int:
        """The files and folders the workspace holds: ``inodes``, or 64 per MiB of
        ``memory_mb`` when not given."""
        return _workspace_inodes(self.memory_mb, self.inodes)

    @property
    def scratch_inodes(self) -> int:
        """The files and folders /tmp and /dev/shm hold, each: an eighth of the workspace's,
        at least 256."""
        return _scratch_inodes(self.workspace_inodes)

    @property
    def files_memory(self) -> int:
        """The most memory, in bytes, the three places can take: their sizes, and each file
        they can hold at its worst-case kernel memory (``FILE_COST_BYTES``)."""
        return _files_memory(self.memory_mb, self.disk_mb, self.tmp_mb, self.inodes)

    @property
    def tmp_size_mb(self) -> int:
        """The size of /tmp and of /dev/shm, each: ``tmp_mb``, or a sixteenth of ``memory_mb``
        (at most 64 MiB) when not given."""
        return _tmp_size_mb(self.memory_mb, self.tmp_mb)

    @property
    def files_per_process(self) -> int:
        """RLIMIT_NOFILE of every process of the sandbox: ``open_files`` shared by ``pids``
        processes, but never fewer than 32 each (a shell or Python needs about ten)."""
        return max(MIN_FILES_PER_PROCESS, self.open_files // self.pids)

    @property
    def total_open_files(self) -> int:
        """What the whole sandbox can hold: ``open_files``, or 32 per process when more."""
        return self.files_per_process * self.pids


def _workspace_mb(memory_mb: int, disk_mb: int | None) -> int:
    return disk_mb if disk_mb is not None else max(1, 3 * memory_mb // 8)


def _tmp_size_mb(memory_mb: int, tmp_mb: int | None) -> int:
    return tmp_mb if tmp_mb is not None else max(1, min(64, memory_mb // 16))


def _workspace_inodes(memory_mb: int, inodes: int | None) -> int:
    return inodes if inodes is not None else min(MAX_INODES, INODES_PER_MIB * memory_mb)


def _scratch_inodes(workspace_inodes: int) -> int:
    return max(MIN_SCRATCH_INODES, workspace_inodes // 8)


def _files_memory(memory_mb: int, disk_mb: int | None, tmp_mb: int | None, inodes: int | None) -> int:
    workspace_inodes = _workspace_inodes(memory_mb, inodes)
    sizes = _workspace_mb(memory_mb, disk_mb) + 2 * _tmp_size_mb(memory_mb, tmp_mb)
    return sizes * MiB + (workspace_inodes + 2 * _scratch_inodes(workspace_inodes)) * FILE_COST_BYTES


def _least_memory(memory_mb: int, disk_mb: int | None, tmp_mb: int | None, inodes: int | None) -> int:
    """The least ``memory_mb`` whose three quarters hold the places, those not given sized from
    it too (each grows by less than it: the search is over a rising margin)."""
    low, high = memory_mb, 1 << 33  # high fits: what is given is at most 2**32 MiB and 2**31 files
    while low < high:
        middle = (low + high) // 2
        if 4 * _files_memory(middle, disk_mb, tmp_mb, inodes) <= 3 * middle * MiB:
            high = middle
        else:
            low = middle + 1
    return low


# Limits.inodes's default before a file's kernel memory counted (2026-12-06), when the places
# were sized apart from it: a client or a store of then wrote it out with every Limits.
OLD_DEFAULT_INODES = 65536


def limits_from_fields(fields: Mapping[str, Any]) -> Limits:
    """A ``Limits`` from its fields as a client or a store wrote them out: one from before
    2026-12-06 names the then default ``inodes=65536`` whatever ``memory_mb``, which today's rule
    refuses below ~954 MiB. Meant as the default, it is taken as today's (a count asked for on
    purpose and refused stays refused)."""
    try:
        return Limits(**fields)
    except InvalidArgument:
        if fields.get("inodes") != OLD_DEFAULT_INODES:
            raise
        return Limits(**{**fields, "inodes": None})


def limits_of_old_places(fields: Mapping[str, Any]) -> Limits:
    """The ``Limits`` a sandbox kept (snapshotted, paused) before 2026-12-06 is restored with:
    its places as they were then, so its files always fit again (the workspace half of
    ``memory_mb``, /tmp and /dev/shm an eighth, at most 64 MiB, unless given, and its
    ``inodes``), and ``memory_mb`` raised to the least that holds them by today's rule. Only
    one whose count is the old default is changed: another was refused or kept as it is."""
    if fields.get("inodes") != OLD_DEFAULT_INODES:
        return limits_from_fields(fields)
    memory_mb = Limits(**{**fields, "inodes": None, "disk_mb": None, "tmp_mb": None}).memory_mb
    disk_mb, tmp_mb = fields.get("disk_mb"), fields.get("tmp_mb")
    old = {
        **fields,
        "disk_mb": memory_mb // 2 if disk_mb is None else disk_mb,
        "tmp_mb": max(1, min(64, memory_mb // 8)) if tmp_mb is None else tmp_mb,
    }
    least = _least_memory(memory_mb, old["disk_mb"], old["tmp_mb"], OLD_DEFAULT_INODES)
    return Limits(**{**old, "memory_mb": least})


# field: (whole number, lowest, highest, unit). The lowest values are what the sandbox machinery
# needs (a few processes, an interpreter's memory); the highest are what every tier's kernel,
# engine and runtime accept (PID_MAX_LIMIT; sizes whose bytes, plus a runtime's overhead, fit
# 64 bits; a tmpfs's inode count), so a value that passes here never fails at start.
_LIMIT_RANGES: dict[str, tuple[bool, float, float, str]] = {
    "memory_mb": (True, 32, 2**32, "MiB"),
    "cpus": (False, 0, 4096, "cores"),
    "pids": (True, 8, 4_194_304, "processes"),
    "timeout_s": (False, 0, MAX_TIMEOUT_S, "seconds"),
    "disk_mb": (True, 1, 2**32, "MiB"),
    "inodes": (True, 1, MAX_INODES, "inodes"),
    "tmp_mb": (True, 1, 2**32, "MiB"),
    "output_bytes": (True, 1, 2**50, "bytes"),
    "open_files": (True, 1, 2**31 - 1, "descriptors"),
    "ptys": (True, 1, 1 << 20, "pseudo-terminals"),  # NR_UNIX98_PTY_MAX
    "approval_wait_s": (False, 0, MAX_TIMEOUT_S, "seconds"),
}


class SecretSource(Protocol):
    """Where a credential's value comes from, read on the host when a sandbox's egress proxy
    starts and again at each reset of the sandbox for a pool's next user
    (``stockade.egress.EnvSecret``, ``FileSecret``, or your own, e.g. a vault). A failure is
    a ``StockadeError`` of its own or becomes a ``SandboxStartError``."""

    def read(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class HostRule:
    """One destination code in a sandbox may reach through its egress proxy.

    ``host`` is a name (``pypi.org``), a wildcard for the names below one (``*.github.com``:
    ``api.github.com``, not ``github.com``), or an IP literal (``10.0.0.5``, ``::1``), which
    also allows that address. ``ports``: where, for plain HTTP (``http://host:port/``, any of
    them) and for HTTPS (a CONNECT tunnel, which must carry TLS from its first byte to its
    last, both ways: a server that does not answer the ClientHello as TLS, such as a
    non-TLS server on an allowed port, gets the ClientHello's bytes and nothing more); a
    credential is added over TLS only, never to plain HTTP. ``methods``: empty for any; else
    only these (for HTTPS the proxy then opens the TLS, with the sandbox's own CA, to see
    them).
    """

    host: str
    ports: tuple[int, ...] = (80, 443)
    methods: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_text(self.host, argument="HostRule.host", fix='give a name such as "pypi.org"')
        if not isinstance(self.ports, list | tuple):
            raise InvalidArgument(
                f"HostRule.ports must be a tuple of ports, got {type(self.ports).__name__}",
                argument="HostRule.ports",
                fix="give ports=(443,)",
            )
        check_strings(self.methods, argument="HostRule.methods")
        host = self.host.strip().lower().rstrip(".")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not host or any(c in host for c in "/ @?#") or "*" in host.removeprefix("*."):
            raise InvalidArgument(
                f"HostRule: {self.host!r} is not a host name, *.suffix or IP address",
                argument="HostRule.host",
                fix='give a name ("pypi.org"), a wildcard ("*.github.com") or an address',
            )
        for port in self.ports:
            check_number(port, argument="HostRule.ports", integer=True, low=1, high=65535, unit="port")
        with contextlib.suppress(ValueError):  # an address, spelled as the proxy spells a request's
            host = str(ipaddress.ip_address(host))
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "methods", tuple(m.upper() for m in self.methods))

    @classmethod
    def parse(cls, text: str) -> HostRule:
        """``"pypi.org"``, ``"*.github.com"``, ``"example.com:8443"``, ``"[::1]:8080"``."""
        host, port = text.strip(), ""
        if host.startswith("["):
            inside, _, rest = host[1:].partition("]")
            host, port = inside, rest.removeprefix(":")
        elif host.count(":") == 1:
            host, port = host.split(":")
        if port:
            if not port.isdigit():
                raise InvalidArgument(
                    f"{text!r}: the port must be a number", argument="allow_hosts", fix='"host:443"'
                )
            return cls(host=host, ports=(int(port),))
        return cls(host=host)


CREDENTIAL_STYLES = ("bearer", "basic", "header")
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110, 5.1)


@dataclass(frozen=True, kw_only=True)
class Credential:
    """A secret the egress proxy adds to requests for ``hosts``; it never enters the sandbox.

    ``style``: ``"bearer"`` (``Authorization: Bearer VALUE``), ``"basic"`` (``Authorization:
    Basic`` of ``username:VALUE``) or ``"header"`` (``HEADER: VALUE``, e.g. ``X-Api-Key``).
    Over HTTPS the proxy opens the TLS with a certificate authority made for the sandbox
    alone (only that sandbox trusts it) to add the header; plain HTTP never carries it.
    """

    name: str
    hosts: tuple[str, ...]
    source: SecretSource
    style: Literal["bearer", "basic", "header"] = "bearer"
    header: str = "Authorization"
    username: str = ""

    def __post_init__(self) -> None:
        check_text(self.name, argument="Credential.name")
        label = f"credential {self.name!r}" if self.name else "a credential"
        hosts = check_strings(self.hosts, argument="Credential.hosts")  # a lone str is no tuple of names
        if not hosts:
            raise InvalidArgument(
                f"{label} names no host", argument="Credential.hosts",
                fix='give the hosts it is for: hosts=("api.github.com",)',
            )  # fmt: skip
        # The same patterns, checked and spelled the same way: the proxy and the server's
        # policy compare these with the rules' hosts, and ``API.GitHub.com.`` matched none.
        object.__setattr__(self, "hosts", tuple(HostRule(host=host).host for host in hosts))
        if not callable(getattr(self.source, "read", None)):
            raise InvalidArgument(
                f"{label}: its source has no read()", argument="Credential.source",
                fix='give a SecretSource, e.g. EnvSecret("GITHUB_TOKEN")',
            )  # fmt: skip
        # Checked here, not per request: another style once sent the bare value, and a header
        # name with a line break in it would write a header of the code's choosing.
        if self.style not in CREDENTIAL_STYLES:
            raise InvalidArgument(
                f"{label}: style {self.style!r} is none of {', '.join(CREDENTIAL_STYLES)}",
                argument="Credential.style", fix='give style="bearer", "basic" or "header"',
            )  # fmt: skip
        if not isinstance(self.header, str) or not HEADER_NAME.fullmatch(self.header):
            raise InvalidArgument(
                f"{label}: header {self.header!r} is no HTTP header name",
                argument="Credential.header", fix='give a name such as "Authorization" or "X-Api-Key"',
            )  # fmt: skip
        check_text(self.username, argument="Credential.username")
        if self.style == "basic" and any(c == ":" or ord(c) < 32 or ord(c) == 127 for c in self.username):
            raise InvalidArgument(
                f"{label}: a basic username holds no colon and no control character",
                argument="Credential.username", fix="give the account's name alone",
            )  # fmt: skip

    def __repr__(self) -> str:  # the source may hold the secret itself (a literal): never shown
        return f"Credential(name={self.name!r}, hosts={self.hosts!r}, style={self.style!r})"


@dataclass(frozen=True, kw_only=True)
class NetworkPolicy:
    """Network access of a sandbox: none by default.

    With ``allow_hosts`` or ``rules``, code reaches only those hosts, over HTTP and HTTPS,
    through an egress proxy stockade runs for the sandbox (its only route out: no other
    address, no DNS). Addresses that are not public (private, loopback, link-local, the
    metadata service, their IPv6 forms) are refused, asked for as an IP literal or reached
    through a name that resolves to one, unless ``allow_addresses`` (networks,
    ``"10.1.0.0/16"``) lets them or a rule names that literal itself (``HostRule``: the
    caller's own choice; ``stockade serve`` refuses a tenant's non-public literal).
    ``resolve`` pins names to addresses on the proxy's side (like ``curl --resolve``).
    ``credentials`` are added by the proxy to the requests for their hosts. Past
    ``max_requests_per_minute`` or ``max_bytes_per_minute`` (both directions) requests are
    refused. ``upstream_ca`` is a file of certificates the proxy trusts, besides the
    system's, for the servers it opens TLS to (credentials, method rules).

    ``enabled=True`` without any allowed host means unrestricted egress (the host's
    network, where a tier can give it); a tier that cannot enforce a setting refuses it.
    """

    enabled: bool = False
    allow_hosts: tuple[str, ...] = ()
    rules: tuple[HostRule, ...] = ()
    allow_addresses: tuple[str, ...] = ()
    resolve: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    credentials: tuple[Credential, ...] = ()
    max_requests_per_minute: int = 600
    max_bytes_per_minute: int = 1024 * MiB
    upstream_ca: str | None = None

    def __post_init__(self) -> None:
        check_strings(self.allow_hosts, argument="NetworkPolicy.allow_hosts")
        check_strings(self.allow_addresses, argument="NetworkPolicy.allow_addresses")
        if not isinstance(self.rules, list | tuple) or not all(isinstance(r, HostRule) for r in self.rules):
            raise InvalidArgument(
                f"NetworkPolicy.rules must be a tuple of HostRule, got {type(self.rules).__name__}",
                argument="NetworkPolicy.rules",
                fix='give rules=(HostRule(host="api.github.com", methods=("GET",)),)',
            )
        self.host_rules  # noqa: B018  (parses allow_hosts: a bad one fails here, not at start)
        for text in self.allow_addresses:
            _network(text, argument="NetworkPolicy.allow_addresses")
        object.__setattr__(self, "resolve", _pinned(self.resolve))
        if not isinstance(self.credentials, list | tuple) or not all(
            isinstance(c, Credential) for c in self.credentials
        ):
            raise InvalidArgument(
                "NetworkPolicy.credentials must be a tuple of Credential, "
                f"got {type(self.credentials).__name__}",
                argument="NetworkPolicy.credentials",
                fix='give credentials=(Credential(name=..., hosts=("api.github.com",), source=...),)',
            )
        if self.upstream_ca is not None:
            object.__setattr__(self, "upstream_ca", _check_ca_file(self.upstream_ca))
        check_number(
            self.max_requests_per_minute, argument="NetworkPolicy.max_requests_per_minute",
            integer=True, low=1, high=10**9, unit="requests",
        )  # fmt: skip
        check_number(
            self.max_bytes_per_minute, argument="NetworkPolicy.max_bytes_per_minute",
            integer=True, low=1, high=2**50, unit="bytes",
        )  # fmt: skip

    @property
    def host_rules(self) -> tuple[HostRule, ...]:
        """Every allowed destination: ``allow_hosts`` parsed, then ``rules``."""
        return (*(HostRule.parse(h) for h in self.allow_hosts), *self.rules)

    @property
    def egress(self) -> bool:
        """Whether this sandbox goes out through an allowlist proxy."""
        return bool(self.allow_hosts or self.rules)

    @property
    def unrestricted(self) -> bool:
        """Whether this asks for the host's network, with no allowlist."""
        return self.enabled and not self.egress


def _network(text: str, *, argument: str) -> None:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise InvalidArgument(
            f"{argument}: {text!r} is not an address or network", argument=argument,
            fix='give networks such as "10.1.0.0/16" or addresses such as "10.1.2.3"',
        ) from None  # fmt: skip


def _pinned(resolve: object) -> dict[str, tuple[str, ...]]:
    """``NetworkPolicy.resolve`` checked: names to addresses (a lone str is one address, as
    in ``curl --resolve``; not the characters of one, which the proxy once looked up)."""
    argument = "NetworkPolicy.resolve"
    if not isinstance(resolve, Mapping):
        raise InvalidArgument(
            f"{argument} must be a mapping of names to addresses, got {type(resolve).__name__}",
            argument=argument, fix='give resolve={"db.internal": ("10.1.2.3",)}',
        )  # fmt: skip
    pinned: dict[str, tuple[str, ...]] = {}
    for name, addresses in resolve.items():
        check_text(name, argument=argument, fix='give resolve={"db.internal": ("10.1.2.3",)}')
        found = (addresses,) if isinstance(addresses, str) else check_strings(addresses, argument=argument)
        for address in found:
            try:
                ipaddress.ip_address(check_text(address, argument=argument))
            except ValueError:
                raise InvalidArgument(
                    f"{argument}: {name} is pinned to {address!r}, which is no IP address",
                    argument=argument, fix='give addresses such as "10.1.2.3" or "fd00::5"',
                ) from None  # fmt: skip
        if not found:
            raise InvalidArgument(
                f"{argument}: {name} is pinned to no address", argument=argument,
                fix='give at least one, e.g. ("10.1.2.3",)',
            )  # fmt: skip
        pinned[name] = found
    return pinned


def _check_ca_file(path: object) -> str:
    """``NetworkPolicy.upstream_ca``: a file of PEM certificates the host can read (else every
    request to a server whose TLS the proxy opens would fail, each a 502)."""
    import ssl  # here: most users of these types never open TLS

    argument = "NetworkPolicy.upstream_ca"
    text = check_text(os.fspath(path) if isinstance(path, os.PathLike) else path, argument=argument)
    try:
        ssl.create_default_context().load_verify_locations(cafile=text)
    except (OSError, ssl.SSLError) as err:
        raise InvalidArgument(
            f"{argument}: {text!r} is no file of certificates this host can read ({err})",
            argument=argument, fix="give the path of a PEM file of the CA certificates to trust",
        ) from None  # fmt: skip
    return text


@dataclass(frozen=True, kw_only=True)
class EgressRecord:
    """One request through a sandbox's proxy, as the audit trail keeps it.

    ``method`` is ``CONNECT`` for a tunnel (then ``sni`` is what the TLS asked for and
    ``path`` is empty); ``decision`` is ``"deny"`` for a request refused before anything of
    it reached the server, ``"allow"`` for one that went, however it ended; ``rule`` the
    rule that decided, or that ended a request that went (a redirect or an answer refused,
    a limit hit mid-body: then ``reason`` says what the server answered, if it did, and
    why it ended); ``status`` what the client got (the server's, once its head was passed
    on; 0 when the request was cut before its answer: the proxy closed, the client gone;
    ``reason`` says which); ``bytes_out`` the body bytes passed on to the server,
    ``bytes_in`` those passed back, counted as they go (a request ended early keeps what
    went). ``credential`` names the one added, once a request's head carried it.
    """

    host: str
    port: int
    method: str
    path: str = ""
    sni: str = ""
    status: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    decision: str = "allow"
    rule: str = ""
    reason: str = ""
    credential: str = ""
    duration_s: float = 0.0


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
class ReadOnly:
    """Workspace paths (globs) code may read but never change, whatever ``write`` grants:
    a data class the role may read and not write. ``setting`` names the rule they come from
    (a refusal names it)."""

    paths: tuple[str, ...]
    setting: str = "read_only"


@dataclass(frozen=True, kw_only=True)
class SandboxRules:
    """What the sandbox itself enforces of a policy, whatever code runs in it and by what route.

    ``deny``, ``approve`` and ``allow`` are command patterns (``"curl"``, ``"rm -r"``,
    ``"git push"``), judged at every exec inside the sandbox with the argv the kernel was
    given: denied, it fails (exit 126, ``denied by policy: RULE`` on its stderr); to be
    approved, it waits at its exec while the host asks the sandbox's ``approver``. A
    non-empty ``allow`` lets only what it names run (its words where the program reads them:
    python's module or script, git's command, the leading operands; not an option's value),
    and nothing in a writable place can be executed. A program denied whatever its arguments
    is also masked: it cannot be read, copied or run under any name. ``write`` names the
    workspace paths code may change (``dir/**``, ``dir``, a file; ``**`` is everything): the
    rest of the workspace is read-only to code, by the kernel. Only what ``read`` names, and
    nothing ``hide`` names, enters the sandbox when a folder seeds it: what the rules do not
    let the run read is not there to be read, by any program. Each of ``read_only`` must
    stay read-only to code: Landlock grants whole folders and cannot take a part of a written
    one back, so where one of its globs may match beneath a ``write`` target (``src/data/**``
    under ``src/**``, anything under ``**``) the sandbox refuses (``LimitNotEnforceable``,
    naming its ``setting``) unless the caller accepts less; elsewhere the kernel holds it.
    ``write``, ``read`` and ``hide`` are workspace globs, kept normalised (``./a``,
    ``/workspace/a`` and ``a//b`` are ``a`` and ``a/b``); one that climbs (``..``) or names
    another absolute path is an ``InvalidArgument``.
    """

    deny: tuple[str, ...] = ()
    approve: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    write: tuple[str, ...] = ("**",)
    read: tuple[str, ...] = ("**",)
    hide: tuple[str, ...] = ()
    read_only: tuple[ReadOnly, ...] = ()

    def __post_init__(self) -> None:
        for name in ("write", "read", "hide"):  # matched in one form, whatever the spelling
            globs = check_strings(getattr(self, name), argument=f"SandboxRules.{name}")
            object.__setattr__(self, name, workspace_globs(globs, setting=f"SandboxRules.{name}"))
        for name in ("deny", "approve", "allow"):
            # checked as a policy file's are: a str read a character at a time judged nothing,
            # and shlex.split(None) read the host's stdin
            argument = f"SandboxRules.{name}"
            patterns = check_strings(getattr(self, name), argument=argument)
            for pattern in patterns:
                try:
                    words = shlex.split(pattern)
                except ValueError as err:
                    raise InvalidArgument(
                        f"{argument}: {pattern!r} is not valid shell words: {err}", argument=argument
                    ) from None
                if not words:
                    raise InvalidArgument(f"{argument}: a command pattern cannot be empty", argument=argument)
            object.__setattr__(self, name, patterns)

    @property
    def judges_execs(self) -> bool:
        return bool(self.deny or self.approve or self.allow)

    @property
    def confines_writes(self) -> bool:
        return "**" not in (w.strip("/") for w in self.write)

    @property
    def judges_paths(self) -> bool:
        """Rules over the workspace's paths: then a files call never follows a symbolic link
        (the path it names is the one judged)."""
        return self.confines_writes or bool(self.hide) or "**" not in (r.strip("/") for r in self.read)


@dataclass(frozen=True, kw_only=True)
class ExecRecord:
    """One exec the sandbox judged: the program run, its argv, and the verdict.

    ``verdict`` is ``"allow"``, ``"deny"``, ``"approve"`` (a human said yes) or ``"refuse"``
    (a human said no, or nobody could be asked); ``rule`` names the rule that decided.
    ``own_code``, on an exec the host is asked to approve: nothing but the code of the call
    it is credited to can have started it (a command's own processes, or the first
    ``run_code`` in a new interpreter), so an approval of that call may answer for it.
    ``between``: no call's code ran it; what an earlier call left running did (a thread of
    the interpreter, a child), after that call returned. Such execs are listed first in the
    next call's ``execs`` (or taken with ``TakeExecs``); one needing an approval was refused,
    with no call to ask under. ``runs``, on an exec the host is asked to approve: the command
    the rule matched, as the judge found it runs, where that is not ``argv`` (the code
    chooses argv: ``exec -a true rm -r x`` runs ``rm -r x``, as does a copy of rm named
    true, or a script whose ``#!`` line is ``/bin/rm -r``). ``file``: the file that ran, where
    ``path`` led to another through links (a link the code made, ``/tmp/pip3`` to
    ``/usr/bin/python3.11``; the image's own, ``/bin/sh`` to ``dash``); empty where it is
    ``path`` itself.
    """

    path: str
    argv: tuple[str, ...]
    verdict: str
    rule: str = ""
    own_code: bool = False
    between: bool = False
    runs: tuple[str, ...] = ()
    file: str = ""


@dataclass(frozen=True, kw_only=True)
class JudgedExecs:
    """The execs judged while no call ran that no call's result listed yet (``TakeExecs``):
    each ``ExecRecord.between``; ``execs_omitted`` counts those past what a report keeps."""

    execs: tuple[ExecRecord, ...] = ()
    execs_omitted: int = 0


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


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    """The outcome of one command. A non-zero exit is a result, never an exception.

    ``stdout``/``stderr`` are decoded as UTF-8 (invalid bytes replaced); ``stdout_bytes`` and
    ``stderr_bytes`` are the true sizes produced, even when ``truncated``.
    ``signal`` is set when the process was killed by one. ``oom_killed``: the command was
    killed by the memory limit (or for thrashing at it): it died of a SIGKILL while the
    sandbox's count of such kills rose, not only beside another call's; ``locks_killed``: for
    holding more file locks than a sandbox may (4,096: kernel memory no memory limit counts).
    """

    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    locks_killed: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    signal: int | None = None
    execs: tuple[ExecRecord, ...] = ()  # what the sandbox's rules judged (with SandboxRules)
    execs_omitted: int = 0  # execs past what a report keeps (its count, then its bytes)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class Result:
    """One displayable value: a MIME bundle such as ``{"text/plain": "42"}``.

    Binary types (``image/png``) are base64 text, as in Jupyter.
    """

    data: Mapping[str, str]

    @property
    def text(self) -> str | None:
        return self.data.get("text/plain")

    @property
    def png(self) -> str | None:
        return self.data.get("image/png")

    @property
    def html(self) -> str | None:
        return self.data.get("text/html")


@dataclass(frozen=True, kw_only=True)
class ExecutionError:
    """An exception raised by the executed code (not by stockade)."""

    name: str
    value: str
    traceback: str


@dataclass(frozen=True, kw_only=True)
class Logs:
    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True, kw_only=True)
class Execution:
    """The outcome of ``run_code``: displayed results, printed logs, and the error if any."""

    results: tuple[Result, ...] = ()
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    duration_s: float = 0.0
    timed_out: bool = False
    truncated: bool = False
    execs: tuple[ExecRecord, ...] = ()  # what the sandbox's rules judged (with SandboxRules)
    execs_omitted: int = 0  # execs past what a report keeps (its count, then its bytes)

    @property
    def text(self) -> str | None:
        """The text of the last result (the trailing expression's value), if any."""
        for result in reversed(self.results):
            if result.text is not None:
                return result.text
        return None


class EntryType(enum.StrEnum):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"  # FIFO, socket, device: never opened by the files API


@dataclass(frozen=True, kw_only=True)
class EntryInfo:
    """One entry of the workspace. ``path`` is relative to the workspace root."""

    path: str
    name: str
    type: EntryType
    size: int
    mode: int
    mtime: float
    # Its status change time and inode number, where the tier says (0: not known). Code can set
    # mtime back (utime), never ctime: a write, a utime, a chmod or a rename moves it to now.
    ctime_ns: int = 0
    inode: int = 0
    # Its name (or a folder's it is in) is not UTF-8: ``path`` shows those bytes as U+FFFD, so
    # no files call can name it. Diffs and the run store name it as left out, not dropped.
    lossy: bool = False


class Listing(list[EntryInfo]):
    """``files.list``'s entries. ``truncated``: the listing stopped at its cap (100,000 entries)
    and the folder holds more; list a folder inside it, or to a smaller depth, to see them."""

    def __init__(self, entries: Iterable[EntryInfo] = (), *, truncated: bool = False) -> None:
        super().__init__(entries)
        self.truncated = truncated

    def __repr__(self) -> str:
        return f"Listing({super().__repr__()}, truncated={self.truncated})"


@dataclass(frozen=True, kw_only=True)
class SkippedEntry:
    """An entry ``files.download_dir`` did not bring to the host: a FIFO, socket or device,
    a symlink that would lead out of the folder, or a folder past the depth a download takes.

    ``kind`` is ``"fifo"``, ``"socket"``, ``"char device"``, ``"block device"``, ``"link out"``,
    ``"too deep"`` (a folder 128 deep: it and all in it were left out) or ``"other"``;
    ``path`` is relative to the downloaded folder.
    """

    path: str
    kind: str


@dataclass(frozen=True, kw_only=True)
class DownloadResult:
    """What one ``files.download_dir`` wrote under ``dest`` on the host.

    ``bytes_written`` counts file contents (a hard-linked file once, as it is stored);
    ``files`` counts regular files, of which ``hard_links`` are further names of a file of
    the same download; ``skipped`` lists what was left out (special files, links out), the
    first thousand of them; ``skipped_count`` counts them all.
    """

    dest: str
    bytes_written: int = 0
    files: int = 0
    directories: int = 0
    symlinks: int = 0
    hard_links: int = 0
    skipped: tuple[SkippedEntry, ...] = ()
    skipped_count: int = 0


class SnapshotKind(enum.StrEnum):
    """What a snapshot keeps of a sandbox.

    ``files``: the workspace, /tmp (where ``pip install --user`` puts packages, as ``$HOME``
    is /tmp) and the environment; a restored sandbox starts fresh processes on them.
    ``memory``: all of that and the memory of every process, so the interpreter's variables
    and its threads go on where they were (gVisor without Docker, the microVM).
    """

    FILES = "files"
    MEMORY = "memory"


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """A saved sandbox, kept in a snapshot store (``stockade.sandbox.SnapshotStore``) under
    ``id``, the hash of what it is made of: restoring checks every byte against it.

    ``Sandbox.create(snapshot=...)`` starts a new sandbox from it (as many as wanted);
    ``source`` is the sandbox it was taken from, ``store`` the folder that keeps it.
    """

    id: str
    kind: SnapshotKind
    tier: str
    source: str
    taken_at: float
    size_bytes: int
    store: str
