"""The kill switch: stop a run from outside its process, at once.

A kill is a marker that any process can set: a file (``FileKillSource``), a Redis key
(``RedisKillSource``) or a call in this process (``MemoryKillSource``, what an HTTP API uses);
the sources, their live marks and ``kill_all`` are ``kill_sources``' and stay importable here.
``KillSwitch.watch()`` polls the sources from a thread; when the switch is pulled it closes
every attached sandbox instance (closing kills the sandbox's whole process tree, mid-command),
and from then on ``check()`` and every op of an attached instance raise ``RunKilled``.
The agent calls ``check()`` between steps.

While it watches, a run is marked live in its sources (a heartbeat, refreshed every
``HEARTBEAT_S``), so that ``stockade kill`` can say whether there is a run to stop. When the
watch ends (the run ended, paused or died with its process), the mark goes and so does any
switch pulled for the run: a later run that reuses the id starts clean. A switch nobody acted
upon expires after ``KILL_TTL_S`` (a run that is resumed within a day still sees it).

The live marks say where each run runs and for which tenant, so that an operator can stop
every run of a tenant, or every run there is, at once: ``kill_all`` (``stockade kill --all``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from stockade.exceptions import RunInterrupted, RunKilled, StockadeError
from stockade.runtime.events import KillRequested, Observer, ignore
from stockade.runtime.kill_sources import (
    HEARTBEAT_S,
    KILL_TTL_S,
    LIVE_FOR_S,
    FileKillSource,
    KillSource,
    LiveRegistry,
    LiveRun,
    MemoryKillSource,
    RedisKillSource,
    check_kill_target,
    checked_run_id,
    default_kill_dir,
    kill_all,
    kill_source_for,
)
from stockade.sandbox.base import Instance, OpResult, OutputSink, WrapperInstance
from stockade.sandbox.ops import Op

# The sources, the live marks and the targets are kill_sources'; they stay importable from here.
__all__ = [
    "HEARTBEAT_S",
    "KILL_TTL_S",
    "LIVE_FOR_S",
    "FileKillSource",
    "KillSource",
    "KillSwitch",
    "KillableInstance",
    "LiveRegistry",
    "LiveRun",
    "MemoryKillSource",
    "RedisKillSource",
    "check_kill_target",
    "check_watched",
    "default_kill_dir",
    "kill_all",
    "kill_source_for",
]


# The switch watched in this context (``KillSwitch.watch``): a wait deep in a wrapper that does
# not know its run (a model waiting for a spend window) still stops when the run is killed.
_watched: contextvars.ContextVar[KillSwitch | None] = contextvars.ContextVar(
    "stockade_kill_switch", default=None
)


def check_watched() -> None:
    """Raise ``RunKilled`` (or ``RunInterrupted``) if the switch watched here was pulled."""
    switch = _watched.get()
    if switch is not None:
        switch.check()


def _here() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


class KillSwitch:
    """The kill switch of one run."""

    def __init__(
        self,
        run_id: str,
        sources: Sequence[KillSource] = (),
        *,
        poll_s: float = 0.1,
        observer: Observer = ignore,
        tenant: str | None = None,
    ) -> None:
        self.run_id = checked_run_id(run_id)
        self.tenant = tenant  # in the live mark: a kill-all of the tenant stops this run
        self.sources = tuple(sources)
        self.poll_s = poll_s
        self.observer = observer
        self._reason: str | None = None
        self._interrupted = False
        self._instances: list[Instance] = []
        self._lock = threading.Lock()

    @property
    def killed(self) -> bool:
        return self._reason is not None

    def kill(self, reason: str = "killed") -> None:
        """Pull the switch: every attached sandbox dies now."""
        self._pull(reason, interrupted=False)

    def interrupt(self, reason: str = "interrupted") -> None:
        """Stop the run as ``kill`` does, to be resumed: its ops raise ``RunInterrupted``, and the
        run ends "interrupted" with its state kept. Safe from any thread or a signal handler's."""
        self._pull(reason, interrupted=True)

    def _pull(self, reason: str, *, interrupted: bool) -> None:
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            self._interrupted = interrupted
            instances, self._instances = self._instances, []
        for instance in instances:
            with contextlib.suppress(Exception):
                instance.close()
        self.observer(
            KillRequested(
                run_id=self.run_id, reason=reason, killed_instances=len(instances), interrupted=interrupted
            )
        )

    def poll(self, *, fresh: bool = False) -> bool:
        """Look at every source once; pull the switch if one says so. ``fresh``: a source that
        answers from a cache of its reads (a service's database, read once per ``poll_s`` for
        every run of its process) is asked afresh (its ``reason_now``)."""
        if self._reason is None:
            for source in self.sources:
                ask = getattr(source, "reason_now", source.reason) if fresh else source.reason
                try:
                    reason = ask(self.run_id)
                except Exception:  # an unreachable source must not kill the run, nor the watcher
                    continue
                if reason is not None:
                    self.kill(reason)
                    break
        return self.killed

    def check(self) -> None:
        """Between steps (before each model call and each tool call): raise ``RunKilled`` if the
        switch was pulled. The sources are asked afresh: a kill answered while the run resumed
        was found only at the cache's next read, after a short run had made its calls and ended."""
        if self.poll(fresh=True):
            raise self._error()

    def raise_if_pulled(self) -> None:
        """``RunKilled`` (or ``RunInterrupted``) if the switch was pulled, without asking the
        sources (the watcher does): cheap enough for a tool's host loop (``checkpoint()``)."""
        if self._reason is not None:
            raise self._error()

    def _error(self) -> RunKilled | RunInterrupted:
        if self._interrupted:
            return RunInterrupted(
                f"run {self.run_id} was interrupted: {self._reason}",
                run_id=self.run_id,
                reason=self._reason or "",
            )
        return RunKilled(
            f"run {self.run_id} was killed: {self._reason}", run_id=self.run_id, reason=self._reason or ""
        )

    def attach(self, instance: Instance) -> KillableInstance:
        """Kill this sandbox with the run; returns the instance to use from now on."""
        with self._lock:
            if self._reason is None:
                self._instances.append(instance)
                return KillableInstance(instance, self)
        instance.close()
        raise self._error()

    def _each(self, method: str, *args: str) -> None:
        """Call ``method`` on every source that has it; an unreachable source is skipped."""
        for source in self.sources:
            call = getattr(source, method, None)
            if call is not None:
                with contextlib.suppress(Exception):
                    call(self.run_id, *args)

    @contextlib.contextmanager
    def watch(self) -> Iterator[KillSwitch]:
        """Poll the sources in a background thread for the duration of the block, with the run
        marked live in them; afterwards the mark and any switch pulled for the run are gone."""
        stop = threading.Event()
        here = LiveRun(run_id=self.run_id, where=_here(), tenant=self.tenant).encode()
        self._each("mark_live", here)

        def loop() -> None:
            beat = time.monotonic()
            while not stop.wait(self.poll_s):
                if self.poll():
                    return
                if time.monotonic() - beat >= HEARTBEAT_S:
                    beat = time.monotonic()
                    self._each("mark_live", here)

        thread = threading.Thread(target=loop, name=f"kill-switch-{self.run_id}", daemon=True)
        thread.start()
        token = _watched.set(self)
        try:
            yield self
        finally:
            _watched.reset(token)
            stop.set()
            thread.join()
            self._each("unmark_live")
            self._each("clear")  # acted upon, or too late to matter: the next run of this id starts clean


class KillableInstance(WrapperInstance):
    """An instance whose ops stop with ``RunKilled`` once its run is killed."""

    def __init__(self, wrapped: Instance, switch: KillSwitch) -> None:
        super().__init__(wrapped)
        self.switch = switch

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        if self.switch.killed:
            raise self.switch._error()
        try:
            result = self.wrapped.handle(op, sink)
        except StockadeError as err:
            if self.switch.killed:
                raise self.switch._error() from err
            raise
        if self.switch.killed:  # the command "finished" because we killed it
            raise self.switch._error()
        return result
