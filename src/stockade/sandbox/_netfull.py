"""The docker tier's full network: a bridge of stockade's own, walled off from the host.

Docker's default bridge lets its containers reach each other, and every listener of the
host bound to 0.0.0.0 through its gateway (172.17.0.1) and the host's own addresses. A
sandbox with the whole network (``NetworkPolicy(enabled=True)``) joins ``stockade-net``
instead, a bridge (``stockade0``) created on first use with traffic between its containers
off (``enable_icc=false``), and the host's firewall refuses, of what comes in from it:

- anything for this host itself (``INPUT``: its loopback, its own addresses, every bridge's
  gateway), whatever port;
- anything for another container of the bridge (another sandbox);
- anything for a private, loopback, link-local (169.254.169.254, the cloud metadata
  service), shared, documentation or other special-purpose address: the egress proxy's
  table of what is not public (``stockade.egress._rules.NOT_PUBLIC_V4``);
- all of IPv6 (the network has none; a link-local address would reach the host).

The host's own resolvers are let through on port 53 only: Docker's embedded DNS (127.0.0.11
in each container) queries them from the container's namespace. The public internet is
left to Docker's own rules. Refusals are ``REJECT`` (a TCP reset, or port unreachable), so
that a connect fails at once instead of hanging until its timeout.

The rules are chains of their own (``STOCKADE-FWD``, ``STOCKADE-IN``, ``STOCKADE-REJECT``),
written whole by one ``iptables-restore --noflush`` (atomic: never a moment with a partial
chain), and one jump to each from ``DOCKER-USER`` (which Docker consults first and never
flushes) and ``INPUT``, added under a host-wide lock only when missing: they name the
bridge, not a sandbox, so one set serves every sandbox and process of the host. Like the
built image, the network and the rules are lasting infrastructure: ``stockade gc`` leaves
them (a sandbox of another process may be on the network), ``remove`` (``stockade gc
--network``) takes them away when this host's engine says no sandbox is on it (a sandbox
running as they went would stay unwalled). A reboot drops the rules: the first full-network
sandbox of each process writes them again, and every one checks the jumps (a missing one,
another process's ``gc --network``, has them all written again).

The process tier's whole network (``process.py``) leaves through slirp4netns, a host process
run as the sandbox's own leased uid (``_host.UID_BASE``, a range no account has). Its chain
(``STOCKADE-OUT``, jumped to from ``OUTPUT`` for that uid range only, ``ensure_uid_rules``)
refuses what the docker chains refuse: the host's own addresses (``addrtype LOCAL``, every
one of its interfaces), every address that is not public, all of IPv6; the host's resolvers
(loopback ones too: slirp4netns forwards the sandbox's queries to them from the host's
namespace) let through on port 53. It names no bridge and no sandbox: written once, it walls
every process-tier sandbox of the host, and ``remove`` leaves it (such a sandbox of another
process may be running; nothing but a leased uid matches it).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade.egress._rules import NOT_PUBLIC_V4
from stockade.sandbox import _guest
from stockade.sandbox._docker_engine import docker_py, mapped_engine_errors
from stockade.sandbox._host import UID_BASE, UID_SPAN

__all__ = ["BRIDGE", "NETWORK", "ensure_network", "ensure_rules", "ensure_uid_rules", "remove", "unwalled"]

NETWORK = "stockade-net"
BRIDGE = "stockade0"
FORWARD_CHAIN = "STOCKADE-FWD"
INPUT_CHAIN = "STOCKADE-IN"
REJECT_CHAIN = "STOCKADE-REJECT"
OUTPUT_CHAIN = "STOCKADE-OUT"  # the process tier's slirp4netns, by uid
OUTPUT_REJECT_CHAIN = "STOCKADE-OUT-REJECT"  # its own: `remove` takes STOCKADE-REJECT away
LEASED_UIDS = f"{UID_BASE}-{UID_BASE + UID_SPAN - 1}"
OPTIONS = {
    "com.docker.network.bridge.name": BRIDGE,
    "com.docker.network.bridge.enable_icc": "false",
    "com.docker.network.bridge.enable_ip_masquerade": "true",
}
RESOLV_CONFS = (Path("/etc/resolv.conf"), Path("/run/systemd/resolve/resolv.conf"))
IPTABLES_TIMEOUT_S = 30.0

_written = threading.Lock()
# The jumps to the chains, by tool: Docker consults DOCKER-USER first for its bridges' traffic.
_JUMPS = {
    "iptables": (("DOCKER-USER", FORWARD_CHAIN), ("INPUT", INPUT_CHAIN)),
    "ip6tables": (("FORWARD", FORWARD_CHAIN), ("INPUT", INPUT_CHAIN)),
}
# The process tier's: only what its leased uids send, from the host's own namespace.
_UID_JUMPS = {"iptables": (("OUTPUT", OUTPUT_CHAIN),), "ip6tables": (("OUTPUT", OUTPUT_CHAIN),)}
_written_here: set[str] = set()  # the tools whose chains this process wrote (a later resolver waits)
_uid_written_here: set[str] = set()


def unwalled(*, remote: bool) -> str | None:
    """Why this host cannot install the rules (then the sandbox would reach the host and the
    private network), or None when it can."""
    if remote:
        return "the engine runs on another host, whose firewall stockade does not manage"
    if os.geteuid() != 0:
        return "the firewall rules need root"
    missing = [tool for tool in _tools() if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found"
    return None


def _tools() -> tuple[str, ...]:
    return ("iptables", "iptables-restore", *(("ip6tables", "ip6tables-restore") if _has_ipv6() else ()))


def _has_ipv6() -> bool:
    return Path("/proc/sys/net/ipv6").is_dir()


def ensure_network(api: Any) -> str:
    """The network's name, after creating it if it is missing; refuses one of that name
    with other options (another's, or traffic between containers on)."""
    docker = docker_py()
    found = _inspect(api)
    if found is None:
        with contextlib.suppress(docker.errors.APIError):  # made meanwhile by another process: found below
            api.create_network(
                NETWORK,
                driver="bridge",
                options=OPTIONS,
                check_duplicate=True,
                labels={_guest.LABEL: "network"},
            )
        found = _inspect(api)
    if found is None:
        raise exc.ConfigurationError(f"the Docker network {NETWORK!r} could not be created")
    options = found.get("Options") or {}
    wrong = {k: options.get(k) for k, v in OPTIONS.items() if options.get(k) != v}
    if wrong or found.get("EnableIPv6"):
        raise exc.ConfigurationError(
            f"the Docker network {NETWORK!r} exists with other options ({wrong or 'IPv6 on'}): full-network "
            f"sandboxes would not be walled off; remove it (docker network rm {NETWORK}) for stockade's own"
        )
    return NETWORK


def _inspect(api: Any) -> dict[str, Any] | None:
    try:
        return dict(api.inspect_network(NETWORK))
    except docker_py().errors.NotFound:
        return None


def sandboxes_on(api: Any) -> int:
    """How many containers the engine has on the network (0 when there is none)."""
    with mapped_engine_errors():
        found = _inspect(api)
    return len((found or {}).get("Containers") or {})


def ensure_rules() -> None:
    """The host's rules for the bridge, in place: written whole once per process, and the
    jumps to them checked (and added when missing) for every sandbox."""
    _ensure(_JUMPS, _rule, {"iptables": _v4_tables, "ip6tables": _v6_tables}, _written_here)


def ensure_uid_rules() -> None:
    """The host's rules for the process tier's slirp4netns (what its leased uids send), in
    place: as ``ensure_rules``, for every process-tier sandbox with the whole network."""
    tables = {"iptables": _uid_v4_tables, "ip6tables": _uid_v6_tables}
    _ensure(_UID_JUMPS, _uid_rule, tables, _uid_written_here)


def _ensure(
    jumps_by_tool: Mapping[str, tuple[tuple[str, str], ...]],
    rule: Callable[[str], tuple[str, ...]],
    tables: dict[str, Callable[[], str]],
    written_here: set[str],
) -> None:
    with _written, _host_lock():
        try:
            for tool, jumps in jumps_by_tool.items():
                if tool == "ip6tables" and not _has_ipv6():
                    continue
                missing = [
                    (chain, target) for chain, target in jumps if not _run(tool, "-C", chain, *rule(target))
                ]
                if missing or tool not in written_here:
                    # A missing jump may be another process's `gc --network`, which took the
                    # chains too: written again (atomic, so a sandbox on them is never unwalled).
                    _restore(f"{tool}-restore", tables[tool]())
                    written_here.add(tool)
                for chain, target in missing:
                    _checked(tool, "-I", chain, "1", *rule(target))
        except (OSError, subprocess.SubprocessError) as err:
            raise exc.LimitNotEnforceable(
                f"the firewall rules that wall full-network sandboxes off could not be installed: {err}",
                setting="network",
                fix="run as root with iptables, or pass allow_weaker=True",
            ) from None


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """One process at a time checks and adds the jumps: two would add one each."""
    folder = _guest.default_state_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(folder / "network.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _resolvers(*, loopback: bool = False) -> list[str]:
    """The host's IPv4 resolvers that the rules would refuse (private ones): loopback ones
    are queried from the host's own namespace (by Docker, unwalled; by slirp4netns, walled
    when ``loopback``), public ones are let through anyway."""
    found: list[str] = []
    for conf in RESOLV_CONFS:
        with contextlib.suppress(OSError):
            for line in conf.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    with contextlib.suppress(ValueError):
                        address = ipaddress.ip_address(parts[1])
                        private = any(address in net for net in NOT_PUBLIC_V4)
                        if (
                            isinstance(address, ipaddress.IPv4Address)
                            and private
                            and (loopback or not address.is_loopback)
                        ):
                            found.append(str(address))
    return list(dict.fromkeys(found))


def _v4_tables() -> str:
    rejects = _rejects(REJECT_CHAIN, "icmp-port-unreachable")
    forward = [f"-A {FORWARD_CHAIN} -i {BRIDGE} -o {BRIDGE} -j {REJECT_CHAIN}"]  # another sandbox
    for resolver in _resolvers():
        forward += [
            f"-A {FORWARD_CHAIN} -i {BRIDGE} -d {resolver}/32 -p {p} --dport 53 -j RETURN"
            for p in ("udp", "tcp")
        ]
    forward += [f"-A {FORWARD_CHAIN} -i {BRIDGE} -d {net} -j {REJECT_CHAIN}" for net in NOT_PUBLIC_V4]
    inbound = [f"-A {INPUT_CHAIN} -i {BRIDGE} -j {REJECT_CHAIN}"]
    return _table([REJECT_CHAIN, FORWARD_CHAIN, INPUT_CHAIN], rejects + forward + inbound)


def _v6_tables() -> str:
    rejects = _rejects(REJECT_CHAIN, "icmp6-port-unreachable")
    rules = [f"-A {chain} -i {BRIDGE} -j {REJECT_CHAIN}" for chain in (FORWARD_CHAIN, INPUT_CHAIN)]
    return _table([REJECT_CHAIN, FORWARD_CHAIN, INPUT_CHAIN], rejects + rules)


def _uid_v4_tables() -> str:
    rejects = _rejects(OUTPUT_REJECT_CHAIN, "icmp-port-unreachable")
    out = [
        f"-A {OUTPUT_CHAIN} -d {resolver}/32 -p {p} --dport 53 -j RETURN"
        for resolver in _resolvers(loopback=True)
        for p in ("udp", "tcp")
    ]
    # Any address of this host (a public one too), then what is not public.
    out.append(f"-A {OUTPUT_CHAIN} -m addrtype --dst-type LOCAL -j {OUTPUT_REJECT_CHAIN}")
    out += [f"-A {OUTPUT_CHAIN} -d {net} -j {OUTPUT_REJECT_CHAIN}" for net in NOT_PUBLIC_V4]
    return _table([OUTPUT_REJECT_CHAIN, OUTPUT_CHAIN], rejects + out)


def _uid_v6_tables() -> str:
    rejects = _rejects(OUTPUT_REJECT_CHAIN, "icmp6-port-unreachable")
    return _table(
        [OUTPUT_REJECT_CHAIN, OUTPUT_CHAIN], [*rejects, f"-A {OUTPUT_CHAIN} -j {OUTPUT_REJECT_CHAIN}"]
    )


def _rejects(chain: str, unreachable: str) -> list[str]:
    """A refusal that fails at once: a TCP reset, else port unreachable (never a drop)."""
    return [
        f"-A {chain} -p tcp -j REJECT --reject-with tcp-reset",
        f"-A {chain} -j REJECT --reject-with {unreachable}",
    ]


def _table(chains: list[str], rules: list[str]) -> str:
    # A chain declared in a --noflush restore is emptied first: the whole set replaces the old one at once.
    return "\n".join(["*filter", *(f":{chain} - [0:0]" for chain in chains), *rules, "COMMIT", ""])


def _restore(tool: str, tables: str) -> None:
    _checked(tool, "--noflush", given=tables)


def _checked(tool: str, *args: str, given: str | None = None) -> None:
    done = subprocess.run(
        [tool, "-w", *args],
        input=given,
        text=True,
        capture_output=True,
        timeout=IPTABLES_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise OSError(f"{tool} {' '.join(args)}: {done.stderr.strip() or f'exit status {done.returncode}'}")


def _rule(target: str) -> tuple[str, ...]:
    return ("-i", BRIDGE, "-j", target)


def _uid_rule(target: str) -> tuple[str, ...]:
    return ("-m", "owner", "--uid-owner", LEASED_UIDS, "-j", target)


def remove(api: Any, *, remote: bool) -> list[str]:
    """The network and, once this host's engine said it is gone, the rules; nothing while a
    container is on the network (the engine refuses: the rules then stay too).

    The rules go only on this host's engine's word: an engine that cannot be asked raises
    (``BackendUnavailable``), one of another host has its network removed but says nothing
    of this host's rules (they stay), and a bridge of the network's name still here (another
    local engine's: ``DOCKER_HOST`` naming a second daemon) keeps them too, refused."""
    removed: list[str] = []
    with mapped_engine_errors():
        if _inspect(api) is not None:
            try:
                api.remove_network(NETWORK)
            except docker_py().errors.APIError:
                return removed  # a container is on it
            removed.append(f"network {NETWORK}")
    if remote or unwalled(remote=False) is not None:
        return removed
    with _written, _host_lock():
        # Checked under the lock: a start that makes the bridge after it finds the jumps
        # gone when its turn comes, and writes the rules again before its container runs.
        if _bridge_here():
            raise exc.ConfigurationError(
                f"the firewall rules of {NETWORK} were kept: its bridge {BRIDGE} is still on this host, so "
                "sandboxes of another engine may be on it"
                + (f" (removed: {', '.join(removed)})" if removed else "")
                + "; run it against this host's engine (DOCKER_HOST unset), or remove the other's network"
            )
        for tool, jumps in _JUMPS.items():
            if tool == "ip6tables" and not _has_ipv6():
                continue
            for chain, target in jumps:
                while _run(tool, "-D", chain, *_rule(target)):
                    removed.append(f"{tool} {chain} {' '.join(_rule(target))}")
            for target in (FORWARD_CHAIN, INPUT_CHAIN, REJECT_CHAIN):
                if _run(tool, "-F", target) and _run(tool, "-X", target):
                    removed.append(f"{tool} chain {target}")
        _written_here.clear()
    return removed


def _bridge_here() -> bool:
    """Whether the bridge is in this network namespace: the one whose firewall holds the rules."""
    try:
        socket.if_nametoindex(BRIDGE)
    except OSError:
        return False
    return True


def _run(tool: str, *args: str) -> bool:
    done = subprocess.run([tool, "-w", *args], capture_output=True, timeout=IPTABLES_TIMEOUT_S, check=False)
    return done.returncode == 0
