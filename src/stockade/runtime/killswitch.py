"""The kill switch: stop a run from outside its process, at once.

A kill is a marker that any process can set: a file (``FileKillSource``), a Redis key
(``RedisKillSource``) or a call in this process (``MemoryKillSource``, what an HTTP API uses).
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
import importlib
import json
import os
import re
import shutil
import socket
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from stockade._private import private_dir, write_private
from stockade.exceptions import ConfigurationError, InvalidArgument, RunInterrupted, RunKilled, StockadeError
from stockade.runtime.events import KillRequested, Observer, ignore
from stockade.sandbox.base import Instance, OpResult, OutputSink, WrapperInstance
from stockade.sandbox.ops import Op

__all__ = [
    "HEARTBEAT_S",
    "KILL_TTL_S",
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

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")

HEARTBEAT_S = 2.0  # a live run refreshes its mark this often
LIVE_FOR_S = 10.0  # ... and counts as live this long after the last refresh (its process may have died)
KILL_TTL_S = 24 * 3600.0  # a switch nobody acted upon is forgotten after this


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


def _checked(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ConfigurationError(f"invalid run id {run_id!r}: letters, digits and ._:- only")
    return run_id


class KillSource(Protocol):
    """Where a run's switch is pulled. A source whose ``reason`` answers from a cache of its
    reads also has ``reason_now(run_id)``, read afresh: what ``KillSwitch.check`` asks."""

    def reason(self, run_id: str) -> str | None:
        """Why the run was killed, or None while it may go on."""

    def kill(self, run_id: str, reason: str) -> None: ...

    def clear(self, run_id: str) -> None: ...


class LiveRegistry(Protocol):
    """What a kill source knows about the runs watching it (the built-in sources all do)."""

    def mark_live(self, run_id: str, info: str) -> None:
        """The run is live now (``info``: where it runs, see ``LiveRun``); refreshed every
        ``HEARTBEAT_S``."""

    def unmark_live(self, run_id: str) -> None: ...

    def live(self, run_id: str) -> str | None:
        """Where the run runs, in words, if it is live (its mark is fresh), else None."""

    def live_runs(self) -> list[LiveRun]:
        """Every run live now."""


@dataclass(frozen=True, kw_only=True)
class LiveRun:
    """A run whose kill switch is watched now: where it runs, and for which tenant."""

    run_id: str
    where: str
    tenant: str | None = None

    def encode(self) -> str:
        return json.dumps({"where": self.where, "tenant": self.tenant})

    @classmethod
    def decode(cls, run_id: str, info: str) -> LiveRun:
        """A mark as written by ``encode``; any other text is where the run runs."""
        try:
            data = json.loads(info)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("where"), str):
            tenant = data.get("tenant")
            return cls(run_id=run_id, where=data["where"], tenant=tenant if isinstance(tenant, str) else None)
        return cls(run_id=run_id, where=info or "live")

    def __str__(self) -> str:
        return self.where + (f", tenant {self.tenant}" if self.tenant is not None else "")


def _here() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _shown(run_id: str, info: str | None) -> str | None:
    return None if info is None else str(LiveRun.decode(run_id, info))


class MemoryKillSource:
    def __init__(self, *, ttl_s: float = KILL_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._killed: dict[str, tuple[str, float]] = {}
        self._live: dict[str, tuple[str, float]] = {}

    def reason(self, run_id: str) -> str | None:
        found = self._killed.get(run_id)
        if found is None:
            return None
        if time.monotonic() - found[1] > self.ttl_s:
            self._killed.pop(run_id, None)
            return None
        return found[0]

    def kill(self, run_id: str, reason: str) -> None:
        self._killed[run_id] = (reason, time.monotonic())

    def clear(self, run_id: str) -> None:
        self._killed.pop(run_id, None)

    def mark_live(self, run_id: str, info: str) -> None:
        self._live[run_id] = (info, time.monotonic())

    def unmark_live(self, run_id: str) -> None:
        self._live.pop(run_id, None)

    def live(self, run_id: str) -> str | None:
        found = self._live.get(run_id)
        fresh = found is not None and time.monotonic() - found[1] <= LIVE_FOR_S
        return _shown(run_id, found[0]) if found is not None and fresh else None

    def live_runs(self) -> list[LiveRun]:
        now = time.monotonic()
        return [
            LiveRun.decode(run_id, info)
            for run_id, (info, at) in sorted(self._live.items())
            if now - at <= LIVE_FOR_S
        ]


def default_kill_dir() -> Path:
    """``$STOCKADE_KILL_DIR``, else ``~/.stockade/kill``."""
    configured = os.environ.get("STOCKADE_KILL_DIR")
    return Path(configured) if configured else Path.home() / ".stockade" / "kill"


class FileKillSource:
    """A run is killed when ``<directory>/<run_id>`` exists; the file holds the reason. A live
    run keeps ``<directory>/.live/<run_id>`` fresh (its mtime is the heartbeat)."""

    def __init__(self, directory: str | Path | None = None, *, ttl_s: float = KILL_TTL_S) -> None:
        self.directory = Path(directory) if directory is not None else default_kill_dir()
        check_kill_target(str(self.directory))
        self.ttl_s = ttl_s

    def reason(self, run_id: str) -> str | None:
        target = self.directory / _checked(run_id)
        # Something other than a file there (a folder, a FIFO, a link) kills too: an error
        # reading a folder was swallowed, so whoever planted one made the run unkillable, and
        # reading a FIFO blocked the watcher. Opened without waiting, and read bounded.
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        not_a_file = f"killed (the kill switch's entry {target} is not a file)"
        try:
            fd = os.open(target, flags)
        except FileNotFoundError:
            return None
        except OSError:
            return not_a_file
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return not_a_file
            text = os.read(fd, 4096).decode("utf-8", "replace").strip()
        finally:
            os.close(fd)
        if time.time() - st.st_mtime > self.ttl_s:  # pulled long ago for a run that never came
            target.unlink(missing_ok=True)
            return None
        return text or "killed"

    def kill(self, run_id: str, reason: str) -> None:
        private_dir(self.directory)
        target = self.directory / _checked(run_id)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)  # a folder planted there: the file replaces it
        tmp = target.with_name(f".{target.name}.tmp")
        write_private(tmp, reason or "killed")
        tmp.replace(target)  # atomic: a watcher never reads half a reason

    def clear(self, run_id: str) -> None:
        (self.directory / _checked(run_id)).unlink(missing_ok=True)

    def mark_live(self, run_id: str, info: str) -> None:
        marks = self.directory / ".live"
        private_dir(marks)
        target = marks / _checked(run_id)
        tmp = marks / f".{target.name}.{os.getpid()}.tmp"
        write_private(tmp, info)
        tmp.replace(target)  # a fresh mtime: the heartbeat

    def unmark_live(self, run_id: str) -> None:
        (self.directory / ".live" / _checked(run_id)).unlink(missing_ok=True)

    def _mark(self, run_id: str) -> str | None:
        target = self.directory / ".live" / _checked(run_id)
        try:
            info = target.read_text(errors="replace").strip()
            age = time.time() - target.stat().st_mtime
        except FileNotFoundError:
            return None
        return info if age <= LIVE_FOR_S else None

    def live(self, run_id: str) -> str | None:
        return _shown(run_id, self._mark(run_id))

    def live_runs(self) -> list[LiveRun]:
        try:
            names = sorted(os.listdir(self.directory / ".live"))
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            if name.startswith(".") or not _RUN_ID.match(name):
                continue  # a mark being written
            info = self._mark(name)
            if info is not None:
                found.append(LiveRun.decode(name, info))
        return found


class RedisKillSource:
    """A run is killed when the key ``stockade:kill:<run_id>`` exists (value: the reason)."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "stockade:kill:",
        live_prefix: str = "stockade:live:",
        ttl_s: float = KILL_TTL_S,
    ) -> None:
        try:
            import redis
        except ModuleNotFoundError:
            raise ConfigurationError('the Redis kill switch needs: pip install "stockade[redis]"') from None
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=2.0)
        except ValueError as error:  # urllib's "Invalid IPv6 URL", a port that is no number, ...
            raise _not_redis(url, error) from None
        self.prefix = prefix
        self.live_prefix = live_prefix
        self.ttl_s = ttl_s

    def reason(self, run_id: str) -> str | None:
        value = self.client.get(self.prefix + _checked(run_id))
        if value is None:
            return None
        return bytes(value).decode(errors="replace") or "killed"  # type: ignore[arg-type]

    def kill(self, run_id: str, reason: str) -> None:
        self.client.set(self.prefix + _checked(run_id), reason or "killed", ex=max(1, int(self.ttl_s)))

    def clear(self, run_id: str) -> None:
        self.client.delete(self.prefix + _checked(run_id))

    def mark_live(self, run_id: str, info: str) -> None:
        self.client.set(self.live_prefix + _checked(run_id), info, ex=int(LIVE_FOR_S))

    def unmark_live(self, run_id: str) -> None:
        self.client.delete(self.live_prefix + _checked(run_id))

    def live(self, run_id: str) -> str | None:
        value = self.client.get(self.live_prefix + _checked(run_id))
        return None if value is None else _shown(run_id, bytes(value).decode(errors="replace"))  # type: ignore[arg-type]

    def live_runs(self) -> list[LiveRun]:
        found = []
        for key in self.client.scan_iter(match=self.live_prefix + "*", count=500):
            run_id = bytes(key).decode(errors="replace")[len(self.live_prefix) :]
            value = self.client.get(key)
            if value is not None:  # not expired meanwhile
                found.append(LiveRun.decode(run_id, bytes(value).decode(errors="replace")))  # type: ignore[arg-type]
        return sorted(found, key=lambda run: run.run_id)


def kill_all(source: KillSource, reason: str, *, tenant: str | None = None) -> list[LiveRun]:
    """Pull the switch of every run live in ``source`` now (of ``tenant`` only, when given);
    returns them. A run that starts afterwards is not stopped."""
    registry = getattr(source, "live_runs", None)
    if registry is None:
        raise ConfigurationError(f"{type(source).__name__} does not know which runs are live")
    pulled: list[LiveRun] = []
    for run in registry():
        if tenant is None or run.tenant == tenant:
            source.kill(run.run_id, reason)
            pulled.append(run)
    return pulled


# A service's database (``stockade serve --db``): its runs watch switches kept there.
_DATABASE_URLS = ("sqlite:///", "postgresql://", "postgres://")


_REDIS_URLS = ("redis://", "rediss://", "unix://")


def check_kill_target(target: str | None) -> None:
    """``InvalidArgument`` when ``target`` can name no kill source: a Redis URL that does not
    parse, or a path to something that is not a folder. Checked before anything is made for a
    run (an agent with a bad target had made its audit database already). Nothing is reached."""
    if target and target.startswith(_REDIS_URLS):
        try:
            urlsplit(target).port  # noqa: B018 (parsing it raises for a bad host or port)
        except ValueError as error:  # "Invalid IPv6 URL", a port that is no number, ...
            raise _not_redis(target, error) from None
    elif target and not target.startswith(_DATABASE_URLS):
        folder = Path(target)
        if folder.exists() and not folder.is_dir():  # made when first used, if missing
            raise InvalidArgument(
                f"the kill directory {target!r} is not a folder",
                argument="--target",
                fix="give a folder (or redis://..., or the service's database URL)",
            )


def _not_redis(url: str, error: ValueError) -> InvalidArgument:
    return InvalidArgument(
        f"the kill target {url!r} is no Redis URL: {error}",
        argument="--target",
        fix="give redis://HOST:PORT/DB",
    )


def kill_source_for(target: str | None) -> KillSource:
    """``redis://...`` -> Redis; a service's database (``sqlite:///PATH``, ``postgresql://...``)
    -> its switches; a path or None -> the kill directory."""
    check_kill_target(target)
    if target and target.startswith(_REDIS_URLS):
        return RedisKillSource(target)
    if target and target.startswith(_DATABASE_URLS):
        # the service's tables are the server's business: imported only for such a target, so
        # the runtime layer depends on nothing above it
        state = importlib.import_module("stockade.server.state.kills")
        source: KillSource = state.database_kill_source(target)
        return source
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
        tenant: str | None = None,
    ) -> None:
        self.run_id = _checked(run_id)
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
