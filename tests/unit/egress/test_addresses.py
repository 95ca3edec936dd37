"""Which addresses a name may lead to (egress/_rules.py): only globally reachable ones, in
whatever IPv6 form they come, judged against IANA's special-purpose registries written out
here as they are published (each range with its "globally reachable" column)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade.egress import Judge, NetworkPolicy

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# IANA IPv4 and IPv6 Special-Purpose Address Registries: (range, globally reachable). "N/A"
# is counted as not reachable; the most specific range decides.
REGISTRY: list[tuple[Network, bool]] = [
    (ipaddress.ip_network(text), reachable)
    for text, reachable in [
        ("0.0.0.0/8", False), ("10.0.0.0/8", False), ("100.64.0.0/10", False),
        ("127.0.0.0/8", False), ("169.254.0.0/16", False), ("172.16.0.0/12", False),
        ("192.0.0.0/24", False), ("192.0.0.9/32", True), ("192.0.0.10/32", True),
        ("192.0.2.0/24", False), ("192.31.196.0/24", True), ("192.52.193.0/24", True),
        ("192.88.99.0/24", False), ("192.168.0.0/16", False), ("192.175.48.0/24", True),
        ("198.18.0.0/15", False), ("198.51.100.0/24", False), ("203.0.113.0/24", False),
        ("224.0.0.0/4", False),  # multicast (its own registry)
        ("240.0.0.0/4", False), ("255.255.255.255/32", False),
        ("::1/128", False), ("::/128", False), ("::ffff:0:0/96", False), ("64:ff9b::/96", True),
        ("64:ff9b:1::/48", False), ("100::/64", False), ("100:0:0:1::/64", False),
        ("2001::/23", False), ("2001::/32", False), ("2001:1::1/128", True),
        ("2001:1::2/128", True), ("2001:1::3/128", True), ("2001:2::/48", False),
        ("2001:3::/32", True), ("2001:4:112::/48", True), ("2001:10::/28", False),
        ("2001:20::/28", True), ("2001:30::/28", True), ("2001:db8::/32", False),
        ("2002::/16", False), ("2620:4f:8000::/48", True), ("3fff::/20", False),
        ("5f00::/16", False), ("fc00::/7", False), ("fe80::/10", False),
        ("fec0::/10", False), ("ff00::/8", False),
    ]
]  # fmt: skip
GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")  # IPv6 outside it reaches no public host
CARRIERS = [  # IPv6 forms that lead to an IPv4 address: judged as that address
    ipaddress.IPv6Network("::ffff:0:0/96"),  # mapped
    ipaddress.IPv6Network("::ffff:0:0:0/96"),  # translated (SIIT)
    ipaddress.IPv6Network("64:ff9b::/96"),  # NAT64
]


def reachable(address: Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        if address.sixtofour is not None:
            return reachable(address.sixtofour)
        for carrier in CARRIERS:
            if address in carrier:
                return reachable(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    rows = [(n, ok) for n, ok in REGISTRY if n.version == address.version and address in n]
    if rows:
        return max(rows, key=lambda row: row[0].prefixlen)[1]
    return address.version == 4 or address in GLOBAL_UNICAST


def refusal(address: str) -> str | None:
    verdict = Judge(NetworkPolicy(allow_hosts=("pkg.test",))).address(ipaddress.ip_address(address))
    return None if verdict is None else verdict.rule


@pytest.mark.parametrize(
    "address",
    [
        "::ffff:0:a9fe:a9fe",  # translated (SIIT) metadata service
        "::ffff:0:7f00:1",  # ... loopback
        "::ffff:0:a00:1",  # ... a private address
        "ff02::1",  # multicast, all nodes
        "ff0e::1",  # multicast, global scope
        "224.0.0.1",  # IPv4 multicast
        "239.255.255.250",
        "5f00::1",  # SRv6 segment identifiers
        "3fff::1",  # documentation
        "2001:db8::1",
        "2001:2::1",  # benchmarking
        "::1:7f00:1",  # outside global unicast, whatever the last 32 bits say
        "64:ff9b::1:a9fe:a9fe",  # local-use NAT64 (64:ff9b:1::/48)
        "100::1",  # discard
        "192.0.0.8",  # IPv4 dummy address
    ],
)
def test_addresses_that_reach_no_public_host_are_refused(address: str) -> None:
    assert refusal(address) == "addresses (not public)"


@pytest.mark.parametrize(
    "address",
    ["1.1.1.1", "2606:4700::1", "::ffff:1.1.1.1", "::ffff:0:101:101", "64:ff9b::101:101", "2002:101:101::"],
)
def test_public_addresses_in_each_form_are_reached(address: str) -> None:
    assert refusal(address) is None


def test_a_refused_multicast_address_is_called_multicast() -> None:
    verdict = Judge(NetworkPolicy(allow_hosts=("pkg.test",))).address(ipaddress.ip_address("ff02::1"))
    assert verdict is not None and "is a multicast address" in verdict.reason


SPECIAL = [n for n, _ in REGISTRY] + CARRIERS + [ipaddress.IPv6Network("::/96"), GLOBAL_UNICAST]
V4_SPECIAL = [n for n in SPECIAL if isinstance(n, ipaddress.IPv4Network)]
WRAPS = [  # ways to carry an IPv4 address in IPv6
    lambda v4: ipaddress.IPv6Address(int(ipaddress.IPv6Address("::ffff:0:0")) | int(v4)),
    lambda v4: ipaddress.IPv6Address(int(ipaddress.IPv6Address("::ffff:0:0:0")) | int(v4)),
    lambda v4: ipaddress.IPv6Address(int(ipaddress.IPv6Address("64:ff9b::")) | int(v4)),
    lambda v4: ipaddress.IPv6Address(int(ipaddress.IPv6Address("64:ff9b:1::")) | int(v4)),
    lambda v4: ipaddress.IPv6Address(int(v4)),  # IPv4-compatible
    lambda v4: ipaddress.IPv6Address((0x2002 << 112) | (int(v4) << 80) | 1),  # 6to4
]
ADDRESSES = st.one_of(
    st.ip_addresses(),
    st.sampled_from(SPECIAL).flatmap(lambda network: st.ip_addresses(network=network)),
    st.tuples(
        st.sampled_from(WRAPS),
        st.sampled_from(V4_SPECIAL).flatmap(lambda network: st.ip_addresses(network=network)),
    ).map(lambda pair: pair[0](pair[1])),
)


@settings(max_examples=2000, deadline=None)
@given(ADDRESSES)
def test_no_address_the_registries_call_not_globally_reachable_is_reached(address: Address) -> None:
    if refusal(str(address)) is None:
        assert reachable(address), f"{address} was allowed"
