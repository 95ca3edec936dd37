"""A started container: its boundary, its instance, and the undoing of a start cut short.

``ContainerBoundary`` is what the supervised sandbox asks of its container: whether it is
alive, its OOM kills (the container's memory cgroup on this host, the engine's events for a
remote one), its removal, and why its supervisor's stream ended (``explain``).
``ContainerInstance`` raises that explanation instead of a bare crash, and keeps gVisor's
memory snapshots. ``Create`` and ``undo_start`` let go of what a failed start holds, even
when an interrupt lands while the engine makes the container.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _guest, _host, _thrash
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._docker_engine import (
    AttachStream,
    engine_error,
    engine_failures,
    remove_container,
    remove_exited,
)
from stockade.sandbox._docker_rundirs import release_mounts
from stockade.sandbox._docker_settings import START_TIMEOUT_S
from stockade.sandbox._gvisor_docker_memory import ContainerMemory
from stockade.sandbox._gvisor_memory import EGRESS_REFUSAL
from stockade.sandbox._supervised import Boundary, SupervisedInstance
from stockade.sandbox.base import OpResult, OutputSink
from stockade.sandbox.ops import Op
from stockade.sandbox.snapshots import Reservation


class ContainerBoundary(Boundary):
    def __init__(
        self,
        api: Any,
        cid: str,
        rundir: Path | None,
        mounts: list[Path],
        *,
        remote: bool,
        lease: _host.UidLease | None = None,
    ) -> None:
        self.api = api
        self.lease = lease
        self.cid = cid
        self.remote = remote
        self.since = time.time() - 1.0
        self.rundir = rundir
        self.mounts = mounts
        self._oom_file: Path | None = None
        self._oom_resolved = False
        self._oom_seen: int | None = None  # the kernel's count, read last
        self._thrash: _thrash.Watch | None = None

    def alive(self) -> bool:
        return not self._dead

    def oom_kills(self) -> int | None:
        # The engine reports OOM as a boolean on exit only; the container's memory cgroup
        # counts every kill, and is readable when the engine runs on this host (which also
        # watches it for thrashing, from the first look on). A remote engine's own events
        # count them too, one API call per look.
        if self.remote:
            return self._oom_events()
        if not self._oom_resolved:
            self._oom_resolved = True
            unknown: tuple[type[BaseException], ...] = (*engine_failures(), KeyError, TypeError, ValueError)
            try:
                pid = int(self.api.inspect_container(self.cid)["State"]["Pid"] or 0)
            except unknown:
                pid = 0
            group = _thrash.memory_group_of(pid) if pid else None
            if group is not None:
                self._oom_file = group.oom_counter
                self._thrash = _thrash.watch(group)
                if self._dead:  # killed meanwhile: _kill may have looked before the watch began
                    self._thrash.close()
        if self._oom_file is None:
            return None
        kernel = _guest.read_oom_kills(self._oom_file)
        if kernel is None:
            # The group is gone with its container: the watch's kill of its largest process
            # ended it (gVisor's sentry, under load), and the count read last still holds
            # (it read None, and the crash was "stopped from outside", not out of memory).
            kernel = self._oom_seen
        if kernel is None:
            return None
        self._oom_seen = kernel
        return kernel + (self._thrash.thrash_kills if self._thrash else 0)

    def lock_kills(self) -> int:
        return self._thrash.lock_kills if self._thrash else 0

    def _oom_events(self) -> int | None:
        # ``until`` in the past (to the microsecond) makes the engine replay and return at
        # once; a future one would hold the call open until then.
        until = f"{time.time():.6f}"
        try:
            with contextlib.closing(
                self.api.events(
                    since=self.since,
                    until=until,
                    filters={"container": self.cid, "event": "oom"},
                    decode=True,
                )
            ) as events:
                return sum(1 for _ in events)
        except engine_failures():
            return None

    def _kill(self) -> None:
        if self._thrash is not None:
            self._thrash.close()
        remove_exited(self.api, self.cid)  # the channel was closed first: the supervisor is ending
        release_mounts(self.rundir, self.mounts)
        if self.lease is not None:  # last: no process of the sandbox is left with the uid
            self.lease.release()

    def explain(self, err: exc.SandboxCrashed) -> exc.StockadeError:
        """Why the supervisor's stream ended: the engine went away, or the container died."""
        output = {"stdout": err.stdout, "stderr": err.stderr}
        try:
            state = self.api.inspect_container(self.cid)["State"]
        except engine_failures() as failure:
            mapped = engine_error(failure)
            if isinstance(mapped, exc.BackendUnavailable | exc.SandboxStartError):
                return exc.BackendUnavailable(
                    f"the Docker engine went away under sandbox {self.cid[:12]} ({err}); "
                    "start a new sandbox once it is back",
                    retry_after=1.0,
                )
            gone = f"the container was removed from outside ({err})"
            return exc.SandboxCrashed(gone, cause="killed", **output)
        if state.get("OOMKilled"):
            oom = "the container was killed by its memory limit; its state is lost"
            return exc.SandboxCrashed(oom, cause="out_of_memory", **output)
        if not state.get("Running"):
            code = state.get("ExitCode")
            if isinstance(code, int) and 0 <= code < 128:
                # not a signal's (128 + its number): the supervisor ended by itself, as it does
                # when its channel breaks; on gVisor code can reach that channel (/proc/1/fd)
                return exc.SandboxCrashed(
                    f"the sandbox's supervisor exited by itself (exit code {code}): code in the "
                    f"sandbox may have ended it or broken its channel to the host: {err}",
                    **output,
                )
            return exc.SandboxCrashed(
                f"the container stopped from outside (status {state.get('Status')}, exit code {code}): {err}",
                cause="killed",
                **output,
            )
        return err


class Create:
    """The engine's create, in a thread of its own: when the caller is interrupted while the
    engine answers, the container is made all the same, and this still learns its id."""

    def __init__(self, create: Callable[[], Mapping[str, Any]]) -> None:
        self._id = ""
        self._error: BaseException | None = None
        # Not Thread.join: a join cut short by an interrupt may take the thread for ended.
        self._answered = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(create,), name="stockade-docker-create", daemon=True
        )

    def start(self) -> None:
        """Apart from ``__init__``: the caller holds this object before an interrupt can land
        in ``Thread.start``, which waits for the thread while its create may be sent already."""
        self._thread.start()

    def _run(self, create: Callable[[], Mapping[str, Any]]) -> None:
        try:
            self._id = str(create()["Id"])
        except BaseException as err:  # raised in the caller's thread, by id()
            self._error = err
        finally:
            self._answered.set()

    def id(self, timeout: float | None = None) -> str:
        """The container's id, once the engine answered ("" past ``timeout``)."""
        self._answered.wait(timeout)
        if self._error is not None:
            raise self._error
        return self._id


def undo_start(
    api: Any,
    lease: _host.UidLease,
    *,
    cid: str,
    created: Create | None,
    name: str,
    stream: AttachStream | None,
    egress: EgressHandle | None,
    rundir: Path | None,
    mounts: list[Path],
) -> None:
    """What a failed start holds, let go; may run twice (again at exit, when interrupted)."""
    if stream is not None:  # a start the engine refused: its attach socket is ours to close
        stream.close()
    if egress is not None:
        egress.close()
    if not cid and created is not None:  # interrupted while the engine made it
        with contextlib.suppress(Exception):
            cid = created.id(START_TIMEOUT_S)
    remove_container(api, cid or name)  # an absent one is no error
    release_mounts(rundir, mounts)
    lease.release()


class ContainerInstance(SupervisedInstance):
    """A supervised sandbox whose crash reports say what happened to its container."""

    container: ContainerBoundary
    memory: ContainerMemory | None = None  # gVisor's checkpoints, when its runsc is on this host

    def memory_snapshots(self) -> str | None:
        if self.tier != "gvisor":
            return super().memory_snapshots()
        if self.spec.network.egress:
            return EGRESS_REFUSAL
        if self.memory is None:
            return (
                "gVisor under Docker keeps memory in a snapshot only with a local engine and root "
                "(its runsc and the sandbox's files are then on this host); this one keeps files only"
            )
        return self.memory.refusal()

    def save_memory(self, room: Reservation, *, stop: bool) -> tuple[dict[str, str], dict[str, Any]]:
        if self.memory is None:
            return super().save_memory(room, stop=stop)
        return self.memory.save(room, stop=stop)

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        try:
            return super().handle(op, sink)
        except exc.SandboxCrashed as err:
            if self._closed:  # closed here (a reset that failed, a call that timed out): it says why
                raise
            explained = self.container.explain(err)
            self.close()
            raise explained from None
