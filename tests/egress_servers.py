"""Local servers for the egress tests: HTTP and HTTPS on 127.0.0.x under made-up names.

``Servers`` starts an HTTP server on 127.0.0.2 (``pkg.test``: pages, redirects, big bodies,
a package index) and an HTTPS server on 127.0.0.3 (``api.test``, a certificate from a test
CA) that remembers every ``Authorization`` it got. ``policy()`` builds the sandbox's
``NetworkPolicy``: the proxy's resolver maps the made-up names (``resolve``), and the two
addresses are allowed explicitly (loopback is refused otherwise).
"""

from __future__ import annotations

import base64
import datetime
import gzip
import hashlib
import http.server
import io
import ipaddress
import socketserver
import ssl
import threading
import time
import urllib.parse
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stockade.types import Credential, HostRule, NetworkPolicy

HTTP_ADDRESS = "127.0.0.2"
HTTPS_ADDRESS = "127.0.0.3"
TOKEN = "tok-" + hashlib.sha256(b"stockade egress test token").hexdigest()[:24]
MIXED_TOKEN = "Tok-Zq9xKp3LmW7vT2nR8sY4bQ6"  # in mixed case: a lowercased or uppercased echo differs
WHEEL_NAME = "tinypkg-1.0-py3-none-any.whl"
HTML = {"Content-Type": "text/html"}


def tiny_wheel() -> bytes:
    """A wheel of one module, ``tinypkg`` (``tinypkg.VALUE == 42``), built here."""
    files = {
        "tinypkg/__init__.py": b"VALUE = 42\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{name},,\n" for name in files) + "tinypkg-1.0.dist-info/RECORD,,\n"
    files["tinypkg-1.0.dist-info/RECORD"] = record.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


@dataclass(frozen=True)
class Hit:
    """One request as the server got it: when (``time.monotonic()``), where, which credential."""

    at: float
    path: str
    authorization: str | None


@dataclass
class Seen:
    authorizations: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    hits: list[Hit] = field(default_factory=list)
    # When a slow stream (``/stream``) lost its client before its last chunk: the proxy cut it.
    cut: list[float] = field(default_factory=list)
    # A slow answer (``/slow``) goes out at its ``s`` seconds or once this is set, whichever
    # is first: a test that knows it waited long enough need not wait the rest.
    slow_release: threading.Event = field(default_factory=threading.Event)
    # When a connection that served a slow answer ended (its client, the proxy, closed it):
    # no request can come over it any more.
    slow_ended: list[float] = field(default_factory=list)
    # The body bytes each POST brought, counted as they are read: a body cut short too.
    received: list[int] = field(default_factory=list)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: Seen
    wheel: bytes
    scheme: str
    served_slow = False

    def handle(self) -> None:
        try:
            super().handle()
        finally:
            if self.served_slow:
                self.seen.slow_ended.append(time.monotonic())

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        auth = self.headers.get("Authorization")
        self.seen.hits.append(Hit(at=time.monotonic(), path=self.path, authorization=auth))
        self.seen.paths.append(self.path)
        if auth is not None:
            self.seen.authorizations.append(auth)
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/redirect":
            self._send(302, b"", {"Location": query["to"]})
        elif url.path == "/big":
            self._send(200, b"x" * int(query.get("n", "1048576")))
        elif url.path == "/auth":  # whether a credential came, never its value
            self._send(200, f"{self.scheme} authorized={auth is not None}".encode())
        elif url.path == "/echo-auth":  # a server that reflects the credential back
            self._send(200, f"you sent: {auth}".encode(), {"X-Echo": auth or ""})
        elif url.path == "/echo-auth-as":  # reflects it transformed, whatever Accept-Encoding said
            self._echo_as(query.get("as", ""), auth or "")
        elif url.path == "/slow":  # the whole answer after ``s`` seconds
            self.served_slow = True
            self.seen.slow_release.wait(float(query.get("s", "3")))
            self._send(200, b"slow")
        elif url.path == "/stream":
            self._stream(int(query.get("chunks", "10")), float(query.get("every", "0.1")))
        elif url.path.startswith(("/simple", "/files/")):
            self._index(url.path)
        else:
            self._send(200, f"{self.scheme} hello {url.path}".encode())

    def _echo_as(self, how: str, auth: str) -> None:
        """``you sent: <the Authorization header>`` as ``how`` makes it: in the reason phrase,
        in a Content-Encoding (gzip, deflate; ``br``: bytes no one could decode), or encoded
        in the body (base64, URL-safe base64, hex, percent-encoding); or the bare secret in
        what the proxy refuses (``REFUSED_ECHOES``); or in another letter case (``lower``,
        ``upper``), in a folded header line (``folded``), in a second gzip member
        (``gzip-members``, ``gzip-members-padded``: zeros after each)."""
        secret = auth.rsplit(maxsplit=1)[-1] if auth else ""
        if how in REFUSED_ECHOES:
            name, value = REFUSED_ECHOES[how]
            status = 302 if name == "Location" else 200
            self._send(status, b"ok", {name: value.format(secret=secret)})
            return
        text = f"you sent: {auth}".encode()
        if how in ("lower", "upper"):  # the echo in another letter case, in a header and the body
            echo = text.lower() if how == "lower" else text.upper()
            self._send(200, echo, {"X-Echo": echo.decode()})
            return
        if how == "folded":  # the echo in a header folded inside the secret (obs-fold)
            cut = len(auth) - len(secret) // 2
            self.wfile.write(
                b"HTTP/1.1 200 OK\r\nX-Echo: %s\r\n %s\r\nContent-Length: 2\r\n\r\nok"
                % (auth[:cut].encode(), auth[cut:].encode())
            )
            return
        if how in ("gzip-members", "gzip-members-padded"):  # the secret in a second gzip member
            padding = b"\0" * 4 if how == "gzip-members-padded" else b""
            body = gzip.compress(b"you sent: ") + padding + gzip.compress(auth.encode()) + padding
            self._send(200, body, {"Content-Encoding": "gzip"})
            return
        if how == "reason":
            self.send_response(401, f"Unauthorized {auth}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if how in ("gzip", "deflate", "br"):
            self._send(200, encoded(how, text), {"Content-Encoding": how})
        elif how in HEADER_NAME_ECHOES:
            self._send(200, b"ok", {HEADER_NAME_ECHOES[how](secret): "1"})
        elif how in CODING_LISTS:
            values, body = CODING_LISTS[how], text
            for coding in (c.strip() for value in values for c in value.split(",")):
                body = encoded(coding, body) if coding != "identity" else body
            self.send_response(200)
            for value in values:  # a client reads the headers as one list, in order
                self.send_header("Content-Encoding", value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._send(200, encoded(how, text))

    def _stream(self, chunks: int, every: float) -> None:
        """A slow answer: ``chunks`` chunks, one every ``every`` seconds (chunked encoding)."""
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i in range(chunks):
                data = f"chunk {i}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(every)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # ssl.SSLError too: the client (the proxy) went away mid-stream
            self.seen.cut.append(time.monotonic())
            self.close_connection = True

    def _index(self, path: str) -> None:
        """A package index (PEP 503) of one wheel."""
        if path in ("/simple/", "/simple"):
            self._send(200, b'<html><body><a href="/simple/tinypkg/">tinypkg</a></body></html>', HTML)
        elif path == "/simple/tinypkg/":
            digest = hashlib.sha256(self.wheel).hexdigest()
            link = f'<a href="/files/{WHEEL_NAME}#sha256={digest}">{WHEEL_NAME}</a>'
            self._send(200, f"<html><body>{link}</body></html>".encode(), HTML)
        elif path == f"/files/{WHEEL_NAME}":
            self._send(200, self.wheel, {"Content-Type": "application/octet-stream"})
        else:
            self._send(404, b"not found")

    def do_POST(self) -> None:
        auth = self.headers.get("Authorization")
        self.seen.hits.append(Hit(at=time.monotonic(), path=self.path, authorization=auth))
        self.seen.paths.append(self.path)
        size, got = int(self.headers.get("Content-Length", "0")), 0
        try:
            while got < size:
                piece = self.rfile.read1(min(size - got, 65536))
                if not piece:
                    break
                got += len(piece)
        except OSError:  # ssl.SSLError too: the client (the proxy) cut the body
            pass
        self.seen.received.append(got)
        if got < size:
            self.close_connection = True
            return
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/redirect":  # the body taken whole, then sent elsewhere
            self._send(302, b"", {"Location": dict(urllib.parse.parse_qsl(url.query))["to"]})
        else:
            self._send(200, f"got {got} bytes".encode())


# The secret echoed into the fields the proxy refuses a reply for (``/echo-auth-as?as=``):
# a coding it cannot undo, a redirect to a host the policy refuses, to another scheme, to no host.
REFUSED_ECHOES = {
    "coding-secret": ("Content-Encoding", "{secret}"),
    "location-host": ("Location", "https://{secret}.evil.test/"),
    "location-scheme": ("Location", "{secret}://api.test/"),
    "location-no-host": ("Location", "http:///{secret}"),
}


# The secret echoed in a header's NAME (``/echo-auth-as?as=``): bare, and as hex and URL-safe base64.
HEADER_NAME_ECHOES: dict[str, Callable[[str], str]] = {
    "name": lambda secret: f"X-{secret}",
    "name-hex": lambda secret: f"X-{secret.encode().hex()}",
    "name-b64url": lambda secret: "X-" + base64.urlsafe_b64encode(secret.encode()).decode().rstrip("="),
}
# The echo compressed by a list of codings, as the Content-Encoding headers say (``/echo-auth-as?as=``).
CODING_LISTS = {
    "identity-then-gzip": ("identity", "gzip"),  # the header twice
    "gzip-then-identity": ("gzip", "identity"),
    "identity-gzip-listed": ("identity, gzip",),  # one header, a list
    "gzip-twice": ("gzip", "gzip"),
    "gzip-twice-listed": ("gzip, gzip",),
}


def encoded(how: str, data: bytes) -> bytes:
    """``data`` as ``/echo-auth-as?as=how`` sends it (``br``: bytes that are no brotli)."""
    if how == "gzip":
        return gzip.compress(data)
    if how == "deflate":
        return zlib.compress(data)
    if how == "br":
        return b"\x8b\x7fnot brotli"
    if how == "b64":
        return base64.b64encode(data)
    if how == "b64url":
        return base64.urlsafe_b64encode(data)
    if how == "hex":
        return data.hex().encode()
    return urllib.parse.quote(data, safe="").encode()  # pct


def _handler(seen: Seen, wheel: bytes, scheme: str) -> type[http.server.BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"seen": seen, "wheel": wheel, "scheme": scheme})


class _Threaded(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _test_ca(folder: Path) -> tuple[Path, ssl.SSLContext]:
    """A CA (its certificate written to ``folder/test-ca.pem``) and a server context for
    ``api.test`` signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "egress test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [
        x509.DNSName("api.test"),
        x509.DNSName("other.test"),
        x509.IPAddress(ipaddress.ip_address(HTTPS_ADDRESS)),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.test")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = folder / "test-ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    chain = folder / "server.pem"
    chain.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        + cert.public_bytes(serialization.Encoding.PEM)
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(chain)
    return ca_file, ctx


@dataclass
class Servers:
    http_port: int
    https_port: int
    ca_file: Path  # the test CA, which signed api.test's certificate
    http_seen: Seen
    https_seen: Seen

    def policy(self, token: str = TOKEN, **changes: Any) -> NetworkPolicy:
        """The allowlist of the tests: both servers by name, the credential (``token``) for api.test."""
        settings: dict[str, Any] = {
            "allow_hosts": (f"pkg.test:{self.http_port}",),
            "rules": (HostRule(host="api.test", ports=(self.https_port,)),),
            "allow_addresses": (f"{HTTP_ADDRESS}/32", f"{HTTPS_ADDRESS}/32"),
            "resolve": {
                "pkg.test": (HTTP_ADDRESS,),
                "api.test": (HTTPS_ADDRESS,),
                "other.test": (HTTPS_ADDRESS,),  # served, but not allowed
                "metadata.test": ("169.254.169.254",),
                "loopback.test": ("127.0.0.1",),
                "private.test": ("10.0.0.1",),
                "mixed.test": ("93.184.216.34", "192.168.1.1"),
                "v6.test": ("::1",),
            },
            "credentials": (Credential(name="api", hosts=("api.test",), source=_Literal(token)),),
            "upstream_ca": str(self.ca_file),
        }
        settings.update(changes)
        return NetworkPolicy(**settings)


@dataclass(frozen=True)
class _Literal:
    value: str

    def read(self) -> str:
        return self.value


@contextmanager
def servers(folder: Path) -> Iterator[Servers]:
    wheel = tiny_wheel()
    http_seen, https_seen = Seen(), Seen()
    plain = _Threaded((HTTP_ADDRESS, 0), _handler(http_seen, wheel, "http"))
    secure = _Threaded((HTTPS_ADDRESS, 0), _handler(https_seen, wheel, "https"))
    ca_file, ctx = _test_ca(folder)
    secure.socket = ctx.wrap_socket(secure.socket, server_side=True)
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (plain, secure)]
    for thread in threads:
        thread.start()
    try:
        yield Servers(
            http_port=plain.server_address[1],
            https_port=secure.server_address[1],
            ca_file=ca_file,
            http_seen=http_seen,
            https_seen=https_seen,
        )
    finally:
        for server in (plain, secure):
            server.shutdown()
            server.server_close()
        for thread in threads:
            thread.join(5)
