"""TLS for the egress proxy: the sandbox's own certificate authority, and reading the SNI.

The CA is made for one sandbox when its proxy starts (an ECDSA P-256 key: a millisecond,
where RSA takes tens), lives in the proxy's memory only, and signs certificates only for
the hosts the proxy must open TLS to (its name constraints say so: even a leaked key could
sign for no other name). Only its certificate enters the sandbox, in the trust bundle the
sandbox's programs are pointed at; nothing else trusts it, and it dies with the sandbox.
The server contexts it makes are kept for the ``CONTEXTS_KEPT`` hosts used last: a wildcard
rule lets code name ever new hosts, and each context holds about 30 KB.

The SNI is read from the client's first TLS record by hand (``server_name``): ``ssl`` can
only report it once it terminates the TLS, and a tunnel must not be terminated. The parser
reads at most one record (16 KiB), bounds every length by what is left, and answers
"no SNI" for anything it does not understand, which the proxy then refuses.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

__all__ = ["CONTEXTS_KEPT", "MAX_HELLO", "SandboxCA", "server_name"]

MAX_HELLO = 16384 + 5  # one TLS record: a ClientHello that needs more is refused
# Server contexts a CA keeps, the hosts used last: a sandbox opens the TLS of a few hosts,
# and one dropped costs a new one (under a millisecond) when its host comes back; at
# about 30 KB each, a sandbox naming ever new hosts under a wildcard holds 8 MB at most.
CONTEXTS_KEPT = 256


def _crypto() -> object:
    try:
        import cryptography
    except ImportError:  # pragma: no cover - a dependency of the egress extra
        from stockade.exceptions import ConfigurationError

        raise ConfigurationError(
            'credentials and method rules over HTTPS need `cryptography`: pip install "stockade[egress]"'
        ) from None
    return cryptography


class SandboxCA:
    """A certificate authority for one sandbox, and the TLS contexts of the hosts it serves."""

    def __init__(self, hosts: tuple[str, ...], *, name: str = "stockade sandbox") -> None:
        _crypto()
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        permitted: list[x509.GeneralName] = []
        for host in hosts:
            literal = _address(host)
            if literal is not None:
                permitted.append(x509.IPAddress(ipaddress.ip_network(literal)))
            else:  # "*.example.com" -> ".example.com" (the names below); else the name itself
                permitted.append(x509.DNSName(host[1:] if host.startswith("*.") else host))
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
        )
        if permitted:
            builder = builder.add_extension(
                x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=None), critical=True
            )
        self._cert = builder.sign(self._key, hashes.SHA256())
        self.pem = self._cert.public_bytes(serialization.Encoding.PEM)
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()  # the last used at the end
        self._lock = threading.Lock()

    def context(self, host: str) -> ssl.SSLContext:
        """A server context presenting a certificate for ``host``, kept for the
        ``CONTEXTS_KEPT`` hosts used last."""
        with self._lock:
            ctx = self._contexts.get(host)
            if ctx is not None:
                self._contexts.move_to_end(host)
                return ctx
            ctx = self._contexts[host] = self._server_context(host)
            if len(self._contexts) > CONTEXTS_KEPT:
                self._contexts.popitem(last=False)
            return ctx

    def forget(self) -> None:
        """Drop the server contexts (for the sandbox's next user: none of the last one's hosts)."""
        with self._lock:
            self._contexts.clear()

    def _server_context(self, host: str) -> ssl.SSLContext:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        literal = _address(host)
        alt: x509.GeneralName = (
            x509.IPAddress(ipaddress.ip_address(literal)) if literal is not None else x509.DNSName(host)
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        chain = (
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            + cert.public_bytes(serialization.Encoding.PEM)
            + self.pem
        )
        _load_chain(ctx, chain)
        return ctx


def _load_chain(ctx: ssl.SSLContext, chain: bytes) -> None:
    """Load a PEM key and chain into ``ctx``. ``ssl`` reads them from a path only: an
    anonymous file in memory where Linux has one (the key never reaches a file system, and
    a temporary folder's creation and removal were nine tenths of a context's cost), else
    a private temporary folder removed at once."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None and os.path.isdir("/proc/self/fd"):
        fd = memfd_create("stockade-egress-leaf", os.MFD_CLOEXEC)
        try:
            view = memoryview(chain)
            while view:
                view = view[os.write(fd, view) :]
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="stockade-egress-") as folder:
        pem = Path(folder, "leaf.pem")
        pem.touch(mode=0o600)
        pem.write_bytes(chain)
        ctx.load_cert_chain(pem)


def _address(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def server_name(hello: bytes) -> tuple[bool, str | None]:
    """From the first bytes a client sent in a tunnel: (is it a TLS ClientHello, its SNI).

    ``(True, None)``: a ClientHello without a server name; ``(False, None)``: not TLS, or
    a hello this parser could not read whole (the caller refuses both).
    """
    if len(hello) < 5 or hello[0] != 0x16 or hello[1] != 0x03:
        return False, None
    length = int.from_bytes(hello[3:5], "big")
    record = hello[5 : 5 + length]
    if len(record) < length or len(record) < 4 or record[0] != 0x01:  # handshake: client_hello
        return False, None
    body = record[4 : 4 + int.from_bytes(record[1:4], "big")]
    try:
        pos = 2 + 32  # client_version, random
        pos += 1 + body[pos]  # session_id
        pos += 2 + int.from_bytes(body[pos : pos + 2], "big")  # cipher_suites
        pos += 1 + body[pos]  # compression_methods
        if pos + 2 > len(body):
            return True, None  # no extensions at all
        end = pos + 2 + int.from_bytes(body[pos : pos + 2], "big")
        pos += 2
        while pos + 4 <= min(end, len(body)):
            kind = int.from_bytes(body[pos : pos + 2], "big")
            size = int.from_bytes(body[pos + 2 : pos + 4], "big")
            data = body[pos + 4 : pos + 4 + size]
            pos += 4 + size
            if kind != 0:  # server_name
                continue
            # server_name_list: length, then (type, length, name)...; type 0 is host_name
            at = 2
            while at + 3 <= len(data):
                name_type = data[at]
                name_len = int.from_bytes(data[at + 1 : at + 3], "big")
                name = data[at + 3 : at + 3 + name_len]
                at += 3 + name_len
                if name_type == 0 and len(name) == name_len:
                    return True, name.decode("ascii", "replace").lower().rstrip(".")
            return False, None
    except IndexError:
        return False, None
    return True, None
