"""What the egress proxy lets through: host rules, and the addresses a name may lead to.

Every answer is a ``Verdict`` that names the rule that decided, so that a refusal the code
reads (``403 ... rule: ...``) and the audit event say the same thing.

Addresses: only public ones, unless the policy names a network (``allow_addresses``) or the
address itself (an IP literal rule). Public is written out here from IANA's special-purpose
registries, not left to ``ipaddress``'s ``is_global``, whose tables differ between Python
versions and called ``::ffff:0:a9fe:a9fe``, ``ff02::1`` and ``3fff::1`` public on ours. IPv4:
any address but private, loopback, link-local (169.254.169.254, the metadata service), shared
(CGNAT), documentation, benchmarking, ``192.0.0.0/24``, 6to4 relay, multicast and reserved.
IPv6: global unicast ``2000::/3`` only, less documentation (``2001:db8::/32``, ``3fff::/20``),
``2001::/23`` (protocol assignments: Teredo, benchmarking, ORCHID, anycast services) and SRv6
``5f00::/16``. An IPv6 address that carries an IPv4 one (mapped ``::ffff:0:0/96``, translated
``::ffff:0:0:0/96``, NAT64 ``64:ff9b::/96``, 6to4 ``2002::/16``) is judged as that IPv4
address; IPv4-compatible ``::/96`` and local-use NAT64 ``64:ff9b:1::/48`` lie outside
``2000::/3`` and are refused whatever they carry. The few public addresses inside refused
ranges (anycast services in ``192.0.0.0/24`` and ``2001::/23``) serve no HTTP and stay refused.
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


V4 = ipaddress.IPv4Network
V6 = ipaddress.IPv6Network
NOT_PUBLIC_V4 = tuple(
    V4(n)
    for n in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
        "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
        "198.51.100.0/24", "203.0.113.0/24",
        "224.0.0.0/4",  # multicast: ``is_global`` calls it public
        "240.0.0.0/4",  # reserved, and the broadcast address
    )
)  # fmt: skip
GLOBAL_UNICAST = V6("2000::/3")  # no other IPv6 range reaches a public host
NOT_PUBLIC_V6 = tuple(V6(n) for n in ("2001::/23", "2001:db8::/32", "3fff::/20", "5f00::/16"))
COMPATIBLE = V6("::/96")  # IPv4-compatible (RFC 4291, deprecated; :: and ::1 too): never public
CARRIERS = (  # IPv6 ranges whose last 32 bits are the IPv4 address the packets go to
    V6("::ffff:0:0/96"),  # mapped (RFC 4291)
    V6("::ffff:0:0:0/96"),  # translated (SIIT, RFC 2765)
    V6("64:ff9b::/96"),  # NAT64, well-known prefix (RFC 6052)
    COMPATIBLE,  # unwrapped only to match ``allow_addresses``
)


def _plain(address: Address) -> Address:
    """An IPv4 address carried in IPv6 (mapped, translated, NAT64, compatible, 6to4), as itself."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.sixtofour is not None:
            return address.sixtofour
        if int(address) > 1 and any(address in carrier for carrier in CARRIERS):  # not :: or ::1
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def _public(address: Address) -> bool:
    plain = _plain(address)
    if isinstance(plain, ipaddress.IPv4Address):  # itself, or carried: judged as that
        return address not in COMPATIBLE and not any(plain in n for n in NOT_PUBLIC_V4)
    return plain in GLOBAL_UNICAST and not any(plain in n for n in NOT_PUBLIC_V6)


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
            else "multicast" if plain.is_multicast
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
