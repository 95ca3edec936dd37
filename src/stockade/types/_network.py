"""A sandbox's network: the hosts its egress proxy lets code reach (``NetworkPolicy``,
``HostRule``), the credentials it adds (``Credential``, ``SecretSource``), and what it records of
each request (``EgressRecord``).

Apart because these are checked for the proxy (names, addresses, header names, a CA file)
and nothing else reads them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from stockade._checks import check_number, check_strings, check_text
from stockade.exceptions import InvalidArgument
from stockade.types._limits import MiB


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

    Every request has one record when it ends (``phase="end"``). A spliced tunnel (a
    ``CONNECT`` whose TLS is the client's own) also has one as it opens (``phase="open"``:
    ``allow``, status 200, no bytes yet), told as the proxy connects it to the server: a
    tunnel may stay open for the sandbox's whole life, and a host that dies first would
    leave no trace of it. Both carry the tunnel's id (``tunnel``); count requests by their
    ``end`` records.
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
    phase: Literal["open", "end"] = "end"
    tunnel: str = ""
