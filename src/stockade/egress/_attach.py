"""What a tier does to give one sandbox its egress proxy (and nothing else) as a way out.

``attach`` starts the sandbox's proxy on a Unix socket in a folder of the sandbox's own
(``folder``, which the tier binds into the sandbox at ``SANDBOX_DIR``) and says what the
sandbox needs: the variables that point its programs at the proxy and its trust bundle,
and the relay the supervisor runs inside (``relay``: it listens on the sandbox's own
loopback, ``127.0.0.1:3128``, and carries each connection to the socket). The sandbox
keeps no network of its own: no interface but its loopback, no DNS.

On gVisor (``preload``) the folder also holds ``connect.so`` (``_preload.py``), which
``LD_PRELOAD`` loads into the sandbox's programs: their connects to the relay's port go to
the proxy's socket itself, without the relay's hop over gVisor's netstack.

The folder is 0700, owned by the sandbox's host uid: no other account of the host can
reach the socket (and with it the sandbox's credentials).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stockade.egress import _loop, _preload
from stockade.egress._mux import Mux
from stockade.egress._sources import SECRETS_TIMEOUT_S, secrets_within
from stockade.egress.proxy import MAX_CONNECTIONS, EgressProxy, Resolver
from stockade.sandbox.base import SandboxSpec

__all__ = ["PROXY_PORT", "SANDBOX_DIR", "Attachment", "attach", "attach_port", "proxy_env"]

PROXY_PORT = 3128
SANDBOX_DIR = "/run/stockade-egress"
SOCKET = "proxy.sock"
BUNDLE = "ca-bundle.pem"
CA = "ca.pem"
# Connections the relay keeps open to the proxy ahead of need (supervisor/egress.py), so a
# request skips the proxy's accept. Off: measured on an idle machine they gained nothing
# (added p50 on the process tier 1.11 ms cold, 1.43 ms warm; docker 1.41 and 1.40 ms), nor
# again on gVisor and docker once refilled off the request's path (docs/benchmarks.md), and
# each is a connection the proxy holds open for nothing; bench/egress.py turns them on.
WARM_CONNECTIONS = 0
SYSTEM_BUNDLES = ("etc/ssl/certs/ca-certificates.crt", "etc/pki/tls/certs/ca-bundle.crt", "etc/ssl/cert.pem")


@dataclass
class Attachment:
    """A running proxy for one sandbox. ``close`` (the boundary's kill) ends it at once."""

    proxy: EgressProxy
    folder: Path
    env: dict[str, str] = field(default_factory=dict)
    relay: dict[str, Any] = field(default_factory=dict)
    mux: Mux | None = None  # the microVM's streams over its egress port
    preload: str | None = None  # the connect shortcut's path in the sandbox (LD_PRELOAD)
    _closed: bool = False

    @property
    def socket_path(self) -> Path:
        return self.folder / SOCKET

    @property
    def violation(self) -> str | None:
        """Why the guest's end of the port was cut for breaking its protocol, if it was."""
        return self.mux.violation if self.mux is not None else None

    def renew(self) -> None:
        """For the sandbox's next user (a reset, once its supervisor renewed the relay):
        ``EgressProxy.renew``."""
        if not self._closed:
            # past the sources' deadline: one that hangs is the renew's ``SandboxStartError``,
            # not this wait's plain timeout
            _loop.call(self.proxy.renew(), timeout_s=self.proxy.secrets_timeout_s + 5)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # a loop already gone has nothing left to cut
            if self.mux is not None:
                _loop.call(self.mux.close(), timeout_s=10)
            _loop.call(self.proxy.close(), timeout_s=10)
        shutil.rmtree(self.folder, ignore_errors=True)


def proxy_env(ca_file: str | None, *, port: int = PROXY_PORT, folder: str = SANDBOX_DIR) -> dict[str, str]:
    """The variables every common client reads: curl, pip, requests, urllib, git, node."""
    url = f"http://127.0.0.1:{port}"
    env = {
        "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
        "ALL_PROXY": url, "all_proxy": url,
        # The sandbox's loopback is its own: what code serves there stays there.
        "NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1",
    }  # fmt: skip
    if ca_file is not None:
        bundle = f"{folder}/{BUNDLE}"
        env.update(
            SSL_CERT_FILE=bundle, REQUESTS_CA_BUNDLE=bundle, CURL_CA_BUNDLE=bundle, PIP_CERT=bundle,
            GIT_SSL_CAINFO=bundle, NODE_EXTRA_CA_CERTS=f"{folder}/{CA}",
        )  # fmt: skip
    return env


def _system_bundle(root: Path | None) -> bytes:
    candidates = [Path(root or "/", name) for name in SYSTEM_BUNDLES]
    if root is None:
        default = ssl.get_default_verify_paths().cafile
        if default:
            candidates.insert(0, Path(default))
    for path in candidates:
        with contextlib.suppress(OSError):
            return path.read_bytes()
    return b""


def attach(
    spec: SandboxSpec,
    folder: Path,
    *,
    uid: int | None = None,
    root: Path | None = None,
    resolver: Resolver | None = None,
    shared: bool = False,
    preload: bool = False,
) -> Attachment:
    """Start ``spec``'s proxy on ``folder/proxy.sock``; ``root`` is the sandbox's root
    filesystem (its system trust bundle is extended with the sandbox's CA), ``uid`` the
    host uid that owns the folder (the sandbox's), root's when ``None``.

    ``shared``: the sandbox's uid is no host uid of its own (gVisor run directly), so the
    socket is open to every uid that can reach it; the caller puts ``folder`` where only
    the sandbox can (a folder of root's, 0700, that the sandbox sees only as the mount).

    ``preload``: the sandbox's programs get the connect shortcut (``LD_PRELOAD``) where this
    host can build it; the tier starts its supervisor with ``Attachment.preload`` preloaded
    too, so that the interpreters it forks have it."""
    folder.mkdir(mode=0o700)
    try:
        secrets = secrets_within(spec.network, SECRETS_TIMEOUT_S)
        proxy = EgressProxy(
            spec.network,
            observer=spec.egress_observer,
            resolver=resolver,
            secrets=secrets,
            secrets_timeout_s=SECRETS_TIMEOUT_S,
        )
        _loop.call(proxy.start(str(folder / SOCKET)))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    attachment = Attachment(proxy=proxy, folder=folder)
    try:
        os.chmod(folder / SOCKET, 0o666 if shared else 0o600)
        if shared:
            os.chmod(folder, 0o711)
        ca = proxy.ca_pem
        if ca is not None:
            (folder / CA).write_bytes(ca)
            (folder / BUNDLE).write_bytes(_system_bundle(root).rstrip(b"\n") + b"\n" + ca)
            for name in (CA, BUNDLE):
                os.chmod(folder / name, 0o644)
        if uid is not None and os.geteuid() == 0:
            for path in (folder, *folder.iterdir()):
                os.chown(path, uid, uid)
        attachment.env = proxy_env(ca.decode() if ca is not None else None)
        shortcut = _preload.library(PROXY_PORT, f"{SANDBOX_DIR}/{SOCKET}") if preload else None
        if shortcut is not None:
            # Root's and read-only, written after the chown: the sandbox's uid owns the
            # folder, not the code every program of the sandbox loads.
            (folder / _preload.LIBRARY).write_bytes(shortcut)
            os.chmod(folder / _preload.LIBRARY, 0o444)
            attachment.preload = f"{SANDBOX_DIR}/{_preload.LIBRARY}"
            attachment.env["LD_PRELOAD"] = attachment.preload
        attachment.relay = {
            "listen": PROXY_PORT,
            "socket": f"{SANDBOX_DIR}/{SOCKET}",
            # The name the kernel gives the proxy's end of each connection, in the sandbox's
            # network namespace: a reset counts those as the host's (supervisor/netstate.py).
            "host_name": str(attachment.socket_path),
            "warm": WARM_CONNECTIONS,
            "pairs": MAX_CONNECTIONS,  # as many at once as the proxy serves
        }
    except BaseException:
        attachment.close()
        raise
    return attachment


GUEST_PORT_FD = 9  # where the microVM's init opens the egress port for the supervisor
GUEST_DIR = "/tmp/.stockade-egress"  # the trust files in a microVM (its root is read-only)


async def _start_mux(mux: Mux) -> None:
    mux.start()


def attach_port(
    spec: SandboxSpec, folder: Path, port: socket.socket, *, root: Path | None = None
) -> Attachment:
    """``attach`` for a sandbox whose way out is a byte stream (the microVM's virtio-serial
    port, ``port`` being our end): its streams go to the proxy's socket in ``folder``."""
    attachment = attach(spec, folder, root=root)
    try:
        attachment.mux = Mux(port, str(attachment.socket_path))
        _loop.call(_start_mux(attachment.mux))
        relay: dict[str, Any] = {"listen": PROXY_PORT, "fd": GUEST_PORT_FD}
        ca = attachment.proxy.ca_pem
        if ca is not None:  # no folder is bound into a VM: the supervisor writes the trust files
            relay["dir"] = GUEST_DIR
            relay["files"] = {name: (folder / name).read_text() for name in (CA, BUNDLE)}
            attachment.env = proxy_env(ca.decode(), folder=GUEST_DIR)
        attachment.relay = relay
    except BaseException:
        attachment.close()
        raise
    return attachment
