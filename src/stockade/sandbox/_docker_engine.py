"""The Docker Engine as the docker tier meets it: docker-py imported on first use, its
failures and the transport's translated once into the error tree (``engine_error``), the
attach stream that carries the supervisor's protocol, and containers removed now or, when
the engine is down, later.

Apart from ``docker.py`` and its parts, which plan, start and collect the sandboxes' containers,
because none of this knows what a sandbox is: it is the boundary with a foreign library.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox._channel import send_all

BUILD_HINT = "build it offline with `stockade image build --offline` (or scripts/build-image.sh)"
STDERR_KEEP = 16 * 1024


def no_logs() -> Any:
    """No log driver: the protocol runs over the container's stdio, and the engine would
    otherwise copy every byte of it (files read, results) to a log file on its disk."""
    return docker_py().types.LogConfig(type="none")


def docker_py() -> Any:
    try:
        import docker
    except ImportError:
        raise exc.TierUnavailable('the docker tier needs docker-py: pip install "stockade[docker]"') from None
    return docker


def engine_client(base_url: str | None, timeout: float) -> Any:
    """A docker-py API client for the engine at ``base_url`` (else the environment's), its API
    version agreed; raises docker-py's or the transport's error when no engine answers."""
    docker = docker_py()
    url = base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if url.startswith(("unix://", "http+unix://")):
        # docker-py leaves the socket of a refused connection to the garbage collector (a
        # ResourceWarning for each attempt while no engine runs): try the socket first here.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(timeout)
            probe.connect(url.split("://", 1)[1])
    if base_url:
        return docker.APIClient(base_url=base_url, version="auto", timeout=timeout)
    return docker.from_env(version="auto", timeout=timeout).api


def engine_error(err: BaseException, *, image: str = "", runtime: str | None = None) -> exc.StockadeError:
    """The one translation of a docker-py / transport failure into a stockade error."""
    if isinstance(err, exc.StockadeError):
        return err
    docker = docker_py()
    errors = docker.errors
    detail = str(getattr(err, "explanation", None) or err)
    if isinstance(err, errors.ImageNotFound) or (
        isinstance(err, errors.NotFound) and "image" in detail.lower() and "container" not in detail.lower()
    ):
        return exc.ImageNotFound(f"the sandbox image {image!r} is not on this Docker host; {BUILD_HINT}")
    if isinstance(err, errors.APIError):
        status = err.status_code or 0
        if status == 409:
            return exc.SandboxStartError(f"Docker refused a conflicting request: {detail}")
        if status == 400 and "unknown runtime" in detail.lower():
            return exc.ConfigurationError(
                f"Docker has no runtime {runtime!r}: {detail}; register it (scripts/setup-docker.sh)"
            )
        if status == 400:
            return exc.ConfigurationError(f"Docker rejected the sandbox settings: {detail}")
        if status == 404:
            return exc.SandboxCrashed(f"the container is gone: {detail}")
        if status >= 500 or status == 0:
            return exc.SandboxStartError(f"the Docker engine failed: {detail}")
        return exc.ConfigurationError(f"Docker refused the request ({status}): {detail}")
    if isinstance(err, errors.DockerException | OSError) or is_transport_error(err):
        return exc.BackendUnavailable(f"the Docker engine is unreachable: {detail}", retry_after=1.0)
    return exc.SandboxStartError(f"unexpected Docker failure: {type(err).__name__}: {detail}")


def is_transport_error(err: BaseException) -> bool:
    import requests

    return isinstance(err, requests.exceptions.RequestException)


def engine_failures() -> tuple[type[BaseException], ...]:
    import requests

    return (docker_py().errors.DockerException, requests.exceptions.RequestException, OSError)


@contextlib.contextmanager
def mapped_engine_errors(image: str = "", runtime: str | None = None) -> Iterator[None]:
    try:
        yield
    except engine_failures() as err:
        raise engine_error(err, image=image, runtime=runtime) from err


def is_remote(base_url: str | None) -> bool:
    forced = os.environ.get("STOCKADE_DOCKER_REMOTE")
    if forced in ("0", "1"):
        return forced == "1"
    url = base_url or os.environ.get("DOCKER_HOST") or ""
    return bool(url) and not url.startswith(("unix://", "/"))


# -- the attach stream ----------------------------------------------------------------------


class AttachStream:
    """The container's stdin/stdout over the engine's hijacked attach connection.

    Without a TTY the engine multiplexes stdout and stderr in frames of an 8-byte header
    (stream, 0, 0, 0, big-endian size) and a payload; stdout is the supervisor's protocol,
    stderr is kept (bounded) to explain a failed start.
    """

    def __init__(self, sock: socket.socket, keepalive: object) -> None:
        self._sock = sock
        self._keepalive = keepalive  # the HTTP response owning the socket must outlive it
        self._buf = bytearray()
        self.stderr = bytearray()

    def recv(self) -> bytes:
        while True:
            out = self._demux()
            if out:
                return out
            data = self._sock.recv(1 << 20)
            if not data:
                return b""
            self._buf += data

    def _demux(self) -> bytes:
        buf = self._buf
        out = bytearray()
        pos = 0
        while len(buf) - pos >= 8:
            size = int.from_bytes(buf[pos + 4 : pos + 8], "big")
            end = pos + 8 + size
            if end > len(buf):
                break
            if buf[pos] == 1:
                out += buf[pos + 8 : end]
            elif len(self.stderr) < STDERR_KEEP:
                self.stderr += buf[pos + 8 : end][: STDERR_KEEP - len(self.stderr)]
            pos = end
        del buf[:pos]
        return bytes(out)

    def send(self, data: bytes, deadline: float | None = None) -> None:
        sock = self._sock
        if isinstance(sock, ssl.SSLSocket):  # a remote engine over TLS: no flags to its send
            sock.sendall(data)
            return
        send_all(sock.fileno(), lambda view: sock.send(view, socket.MSG_DONTWAIT), data, deadline)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        # The socket only closes once the HTTP response's file object lets go of it.
        for closable in (self._keepalive, self._sock):
            with contextlib.suppress(OSError, AttributeError):
                closable.close()  # type: ignore[attr-defined]


# -- removal, now or later ------------------------------------------------------------------

# Containers whose removal failed (engine down, or the engine stuck on them): retried in the
# background at the next start, never in the start's own thread.
_pending: set[str] = set()
_pending_lock = threading.Lock()
_retrying = threading.Lock()  # held by the retry thread under way

# How long a closing sandbox is given to end by itself, before the engine is asked to kill it.
EXIT_WAIT_S = 2.0


def remove_exited(api: Any, cid: str) -> bool:
    """Remove a container whose supervisor was just told to end (its stdin closed).

    Waits up to ``EXIT_WAIT_S`` for the container to stop on its own before the forced removal:
    a kill sent while the container is already exiting races that exit inside containerd's shim
    (1.6: the kill holds the task's lock while the exit's delivery waits on it), and the engine
    then holds this removal, and every later call on the container, for 30-90 s. Seen on gVisor
    in a third of the closes after a fork bomb (the exit takes longer); none in 15 with the wait.
    """
    with contextlib.suppress(*engine_failures()):
        api.wait(cid, timeout=EXIT_WAIT_S)  # raises a read timeout when still running
    return remove_container(api, cid)


def remove_container(api: Any, cid: str) -> bool:
    docker = docker_py()
    try:
        api.remove_container(cid, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as err:
        if "already in progress" not in str(err):
            with _pending_lock:
                _pending.add(cid)
            return False
    except engine_failures():
        with _pending_lock:
            _pending.add(cid)
        return False
    with _pending_lock:
        _pending.discard(cid)
    return True


def retry_removals(api: Any) -> threading.Thread | None:
    """Retry the failed removals in a thread of their own (the one returned, if started): a
    removal the engine is stuck on must not hold up the start of the next sandbox."""
    with _pending_lock:
        todo = list(_pending)
    if not todo or not _retrying.acquire(blocking=False):
        return None

    def retry() -> None:
        try:
            for cid in todo:
                remove_container(api, cid)
        finally:
            _retrying.release()

    thread = threading.Thread(target=retry, name="stockade-docker-removals", daemon=True)
    thread.start()
    return thread
