"""The kill switch: stop a run from outside its process, at once.

A kill is a marker that any process can set: a file (``FileKillSource``), a Redis key
(``RedisKillSource``) or a call in this process (``MemoryKillSource``, what an HTTP API uses).
``KillSwitch.watch()`` polls the sources from a thread; when the switch is pulled it closes
every attached sandbox instance (closing kills the sandbox's whole process tree, mid-command),
and from then on ``check()`` and every op of an attached instance raise ``RunKilled``.
The agent calls ``check()`` between steps.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from stockade.exceptions import ConfigurationError, RunKilled, StockadeError
from stockade.runtime.events import KillRequested, Observer, ignore
from stockade.sandbox.base import Instance, OpResult, OutputSink
from stockade.sandbox.ops import Op

__all__ = [
    "FileKillSource",
    "KillSource",
    "KillSwitch",
    "KillableInstance",
    "MemoryKillSource",
    "RedisKillSource",
    "default_kill_dir",
    "kill_source_for",
]

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _checked(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ConfigurationError(f"invalid run id {run_id!r}: letters, digits and ._:- only")
    return run_id


class KillSource(Protocol):
    def reason(self, run_id: str) -> str | None:
        """Why the run was killed, or None while it may go on."""

    def kill(self, run_id: str, reason: str) -> None: ...

    def clear(self, run_id: str) -> None: ...


class MemoryKillSource:
    def __init__(self) -> None:
        self._killed: dict[str, str] = {}

    def reason(self, run_id: str) -> str | None:
        return self._killed.get(run_id)

    def kill(self, run_id: str, reason: str) -> None:
        self._killed[run_id] = reason

    def clear(self, run_id: str) -> None:
        self._killed.pop(run_id, None)


def default_kill_dir() -> Path:
    """``$STOCKADE_KILL_DIR``, else ``~/.stockade/kill``."""
    configured = os.environ.get("STOCKADE_KILL_DIR")
    return Path(configured) if configured else Path.home() / ".stockade" / "kill"


class FileKillSource:
    """A run is killed when ``<directory>/<run_id>`` exists; the file holds the reason."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_kill_dir()

    def reason(self, run_id: str) -> str | None:
        try:
            text = (self.directory / _checked(run_id)).read_text(errors="replace").strip()
        except FileNotFoundError:
            return None
        return text or "killed"

    def kill(self, run_id: str, reason: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / _checked(run_id)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(reason or "killed")
        tmp.replace(target)  # atomic: a watcher never reads half a reason

    def clear(self, run_id: str) -> None:
        (self.directory / _checked(run_id)).unlink(missing_ok=True)


class RedisKillSource:
    """A run is killed when the key ``stockade:kill:<run_id>`` exists (value: the reason)."""

    def __init__(self, url: str, *, prefix: str = "stockade:kill:") -> None:
        try:
            import redis
        except ModuleNotFoundError:
            raise ConfigurationError('the Redis kill switch needs: pip install "stockade[redis]"') from None
        self.client = redis.Redis.from_url(url, socket_timeout=2.0)
        self.prefix = prefix

    def reason(self, run_id: str) -> str | None:
        value = self.client.get(self.prefix + _checked(run_id))
        if value is None:
            return None
        return bytes(value).decode(errors="replace") or "killed"  # type: ignore[arg-type]

    def kill(self, run_id: str, reason: str) -> None:
        self.client.set(self.prefix + _checked(run_id), reason or "killed")

    def clear(self, run_id: str) -> None:
        self.client.delete(self.prefix + _checked(run_id))


def kill_source_for(target: str | None) -> KillSource:
    """``redis://...`` -> Redis; a path or None -> the kill directory."""
    if target and target.startswith(("redis://", "rediss://", "unix://")):
        return RedisKillSource(target)
    return FileKillSource(target)


class KillSwitch:
    """The kill switch of one run."""

    def __init__(
        self,
        run_id: str,
        sources: Sequence[KillSource] = (),
        *,
        poll_s: float = 0.1,
        observer: Observer = ignore,
    ) -> None:
        self.run_id = _checked(run_id)
        self.sources = tuple(sources)
        self.poll_s = poll_s
        self.observer = observer
        self._reason: str | None = None
        self._instances: list[Instance] = []
        self._lock = threading.Lock()

    @property
    def killed(self) -> bool:
        return self._reason is not None

    def kill(self, reason: str = "killed") -> None:
        """Pull the switch: every attached sandbox dies now."""
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            instances, self._instances = self._instances, []
        for instance in instances:
            with contextlib.suppress(Exception):
                instance.close()
        self.observer(KillRequested(run_id=self.run_id, reason=reason, killed_instances=len(instances)))

    def poll(self) -> bool:
        """Look at every source once; pull the switch if one says so."""
        if self._reason is None:
            for source in self.sources:
                try:
                    reason = source.reason(self.run_id)
                except Exception:  # an unreachable source must not kill the run, nor the watcher
                    continue
                if reason is not None:
                    self.kill(reason)
                    break
        return self.killed

    def check(self) -> None:
        """Between steps: raise ``RunKilled`` if the switch was pulled."""
        if self.poll():
            raise self._error()

    def _error(self) -> RunKilled:
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

    @contextlib.contextmanager
    def watch(self) -> Iterator[KillSwitch]:
        """Poll the sources in a background thread for the duration of the block."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.poll_s):
                if self.poll():
                    return

        thread = threading.Thread(target=loop, name=f"kill-switch-{self.run_id}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()


class KillableInstance(Instance):
    """An instance whose ops stop with ``RunKilled`` once its run is killed."""

    def __init__(self, inner: Instance, switch: KillSwitch) -> None:
        self.inner = inner
        self.switch = switch
        self.id = inner.id
        self.tier = inner.tier
        self.enforcement = inner.enforcement

    def handle(self, op: Op, sink: OutputSink | None) -> OpResult:
        if self.switch.killed:
            raise self.switch._error()
        try:
            result = self.inner.handle(op, sink)
        except StockadeError as err:
            if self.switch.killed:
                raise self.switch._error() from err
            raise
        if self.switch.killed:  # the command "finished" because we killed it
            raise self.switch._error()
        return result

    def close(self) -> None:
        self.inner.close()

    @property
    def alive(self) -> bool:
        return self.inner.alive
