"""What the egress proxy lets through: host rules, and the addresses a name may lead to.

Every answer is a ``Verdict`` that names the rule that decided, so that a refusal the code
reads (``403 ... rule: ...``) and the audit event say the same thing.

Addresses: only public ones, unless the policy names a network (``allow_addresses``) or the
address itself (an IP literal rule). ``ipaddress``'s ``is_global`` is the test: it is false
for private, loopback, link-local (169.254.169.254, the metadata service), shared (CGNAT),
reserved, multicast and unspecified addresses, and the IPv6 forms of all of them. An IPv6
address that carries an IPv4 one (mapped, 6to4, Teredo, NAT64 ``64:ff9b::/96``) is judged
as that IPv4 address too. A few IPv6 ranges ``is_global`` calls public in some Python
versions reach no public host and are refused: IPv4-compatible ``::/96`` (deprecated; a
host may route it to the IPv4 address inside), local-use NAT64 ``64:ff9b:1::/48`` (a
network's own translator, to any IPv4 address) and site-local ``fec0::/10``.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from stockade.types import Credential, HostRule, NetworkPolicy

__all__ = ["Judge", "Verdict", "host_matches", "ip_literal"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
KEPT = 1024  # verdicts a judge keeps (then it starts again): a sandbox asks about few places


@dataclass(frozen=True, kw_only=True)
class Verdict:
    allowed: bool
    rule: str  # the rule that decided, as the policy spells it
    reason: str = ""
    intercept: bool = False  # TLS must be opened: a credential or a method rule needs it
    credential: Credential | None = None
    methods: tuple[str, ...] = ()  # when not empty, the only methods allowed


@functools.lru_cache(maxsize=KEPT)
def ip_literal(host: str) -> Address | None:
    """``host`` as an IP address, if it is one (any spelling ``ipaddress`` accepts). Kept:
    asked for each request's host, and a name fails two parsers, each with an exception."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def host_matches(pattern: str, host: str) -> bool:
    """``*.example.com`` matches the names below example.com (not itself); else exact."""
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known prefix (RFC 6052): the IPv4 address last
COMPATIBLE = ipaddress.IPv6Network("::/96")  # IPv4-compatible (RFC 4291, deprecated), :: and ::1 too
NOT_PUBLIC_V6 = (  # reach no public host, whatever ``is_global`` says in this Python
    COMPATIBLE,
    ipaddress.IPv6Network("64:ff9b:1::/48"),  # local-use NAT64 (RFC 8215): a network's own translator
    ipaddress.IPv6Network("fec0::/10"),  # site-local (RFC 3879, deprecated)
)


def _plain(address: Address) -> Address:
    """An IPv4 address carried in IPv6 (mapped, compatible, 6to4, Teredo, NAT64), as itself."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
        if address.teredo is not None:
            return address.teredo[1]  # the client's: where the relay sends the packets
        if address in NAT64 or (address in COMPATIBLE and int(address) > 1):  # not :: or ::1
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def _public(address: Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and any(address in n for n in NOT_PUBLIC_V6):
        return False
    plain = _plain(address)
    return plain.is_global and address.is_global


class Judge:
    """The decisions of one sandbox's proxy, over its ``NetworkPolicy``."""

    def __init__(self, policy: NetworkPolicy) -> None:
        self.rules = policy.host_rules
        self.credentials = policy.credentials
        self.networks: list[tuple[Network, str]] = []
        for text in policy.allow_addresses:
            self.networks.append((ipaddress.ip_network(text, strict=False), f"allow_addresses: {text}"))
        for rule in self.rules:  # an IP literal rule allows its own address
            literal = ip_literal(rule.host)
            if literal is not None:
                self.networks.append((ipaddress.ip_network(literal), f"allow: {rule.host}"))
        # The policy does not change, so neither do its verdicts: a sandbox's requests go to
        # a few places again and again, and judging one anew (names, wildcards, address
        # parsing) was a tenth of the proxy's own time per request.
        self._requests: dict[tuple[str, int, str], Verdict] = {}
        self._addresses: dict[tuple[str, tuple[str, ...]], tuple[tuple[str, ...], Verdict | None]] = {}

    def request(self, host: str, port: int, method: str) -> Verdict:
        """May ``method`` go to ``host:port``? (CONNECT for a tunnel.)"""
        key = (host, port, method)
        verdict = self._requests.get(key)
        if verdict is None:
            verdict = self._request(host, port, method)
            if len(self._requests) >= KEPT:
                self._requests.clear()
            self._requests[key] = verdict
        return verdict

    def _request(self, host: str, port: int, method: str) -> Verdict:
        host = host.lower().rstrip(".")
        literal = ip_literal(host)
        if literal is not None:
            host = str(literal)
        matched = [r for r in self.rules if self._names(r, host, literal)]
        if not matched:
            what = "IP address" if literal is not None else "host"
            return Verdict(
                allowed=False, rule="allow (no rule)",
                reason=f"the {what} {host} is not in the sandbox's network allowlist",
            )  # fmt: skip
        on_port = [r for r in matched if port in r.ports]
        if not on_port:
            rule = matched[0]
            return Verdict(
                allowed=False, rule=f"allow: {_spell(rule)}",
                reason=f"port {port} of {host} is not allowed (allowed: {', '.join(map(str, rule.ports))})",
            )  # fmt: skip
        credential = self.credential_for(host)
        unrestricted = [r for r in on_port if not r.methods]
        if unrestricted:
            rule = unrestricted[0]
            return Verdict(
                allowed=True, rule=f"allow: {_spell(rule)}", credential=credential,
                intercept=credential is not None,
            )  # fmt: skip
        methods = tuple(dict.fromkeys(m for r in on_port for m in r.methods))
        rule = on_port[0]
        if method != "CONNECT" and method not in methods:
            return Verdict(
                allowed=False, rule=f"allow: {_spell(rule)}",
                reason=f"{method} to {host} is not allowed (allowed: {', '.join(methods)})",
            )  # fmt: skip
        # A tunnel to a host with method rules is opened: the methods are inside the TLS.
        return Verdict(
            allowed=True, rule=f"allow: {_spell(rule)}", credential=credential,
            intercept=True, methods=methods,
        )  # fmt: skip

    def _names(self, rule: HostRule, host: str, literal: Address | None) -> bool:
        if literal is not None:  # a wildcard never matches an address
            pattern = ip_literal(rule.host)
            return pattern is not None and pattern == literal
        return host_matches(rule.host, host)

    def credential_for(self, host: str) -> Credential | None:
        for credential in self.credentials:
            if any(host_matches(pattern, host) for pattern in credential.hosts):
                return credential
        return None

    def addresses(self, host: str, found: Iterable[str]) -> tuple[list[str], Verdict | None]:
        """The addresses of ``found`` that may be reached, or the verdict refusing them all.

        Any address that may not be reached refuses the whole name: a name whose answers
        mix a public and a private address is a rebinding attempt, not a choice to make.
        """
        key = (host, tuple(found))
        kept = self._addresses.get(key)
        if kept is None:
            allowed, refusal = self._check_addresses(host, key[1])
            kept = (tuple(allowed), refusal)
            if len(self._addresses) >= KEPT:
                self._addresses.clear()
            self._addresses[key] = kept
        return list(kept[0]), kept[1]

    def _check_addresses(self, host: str, found: Iterable[str]) -> tuple[list[str], Verdict | None]:
        allowed: list[str] = []
        for text in found:
            address = ip_literal(text)
            if address is None:
                continue
            verdict = self.address(address)
            if verdict is not None:
                return [], Verdict(
                    allowed=False, rule=verdict.rule,
                    reason=f"{host} resolves to {address}: {verdict.reason}",
                )  # fmt: skip
            allowed.append(str(address))
        if not allowed:
            return [], Verdict(allowed=False, rule="dns", reason=f"{host} has no address")
        return allowed, None

    def address(self, address: Address) -> Verdict | None:
        """``None`` when ``address`` may be reached, else why not."""
        for network, _ in self.networks:
            if address.version == network.version and address in network:
                return None
            plain = _plain(address)
            if plain.version == network.version and plain in network:
                return None
        if _public(address):
            return None
        plain = _plain(address)
        kind = (
            "loopback" if plain.is_loopback
            else "link-local" if plain.is_link_local
            else "private" if plain.is_private
            else "not public"
        )  # fmt: skip
        return Verdict(
            allowed=False, rule="addresses (not public)",
            reason=f"{address} is a {kind} address; allow it with allow_addresses",
        )  # fmt: skip


def _spell(rule: HostRule) -> str:
    text = rule.host
    if rule.ports != (80, 443):
        text += ":" + ",".join(map(str, rule.ports))
    if rule.methods:
        text += " " + ",".join(rule.methods)
    return text
