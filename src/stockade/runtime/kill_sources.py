"""Where a run's kill switch is pulled, and where the runs watching it say they are live.

A kill is a marker that any process can set: a file (``FileKillSource``), a Redis key
(``RedisKillSource``) or a call in this process (``MemoryKillSource``, what an HTTP API uses);
``kill_source_for`` picks one from a target (a service's database has its own, in the server).
Each also keeps the live marks of the runs watching it (``LiveRun``: where a run runs and for
which tenant), which ``kill_all`` reads to stop every run of a tenant, or every run there is.
Apart from the switch (``killswitch``): these are the stores a switch polls and the CLI and
the service write to, without a run or a sandbox.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from stockade._private import private_dir, write_private
from stockade.exceptions import ConfigurationError, InvalidArgument

__all__ = [
    "HEARTBEAT_S",
    "KILL_TTL_S",
    "LIVE_FOR_S",
    "FileKillSource",
    "KillSource",
    "LiveRegistry",
    "LiveRun",
    "MemoryKillSource",
    "RedisKillSource",
    "check_kill_target",
    "checked_run_id",
    "default_kill_dir",
    "kill_all",
    "kill_source_for",
]

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")

HEARTBEAT_S = 2.0  # a live run refreshes its mark this often
LIVE_FOR_S = 10.0  # ... and counts as live this long after the last refresh (its process may have died)
KILL_TTL_S = 24 * 3600.0  # a switch nobody acted upon is forgotten after this


def checked_run_id(run_id: str) -> str:
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
        target = self.directory / checked_run_id(run_id)
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
        target = self.directory / checked_run_id(run_id)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)  # a folder planted there: the file replaces it
        tmp = target.with_name(f".{target.name}.tmp")
        write_private(tmp, reason or "killed")
        tmp.replace(target)  # atomic: a watcher never reads half a reason

    def clear(self, run_id: str) -> None:
        (self.directory / checked_run_id(run_id)).unlink(missing_ok=True)

    def mark_live(self, run_id: str, info: str) -> None:
        marks = self.directory / ".live"
        private_dir(marks)
        target = marks / checked_run_id(run_id)
        tmp = marks / f".{target.name}.{os.getpid()}.tmp"
        write_private(tmp, info)
        tmp.replace(target)  # a fresh mtime: the heartbeat

    def unmark_live(self, run_id: str) -> None:
        (self.directory / ".live" / checked_run_id(run_id)).unlink(missing_ok=True)

    def _mark(self, run_id: str) -> str | None:
        target = self.directory / ".live" / checked_run_id(run_id)
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
        value = self.client.get(self.prefix + checked_run_id(run_id))
        if value is None:
            return None
        return bytes(value).decode(errors="replace") or "killed"  # type: ignore[arg-type]

    def kill(self, run_id: str, reason: str) -> None:
        self.client.set(self.prefix + checked_run_id(run_id), reason or "killed", ex=max(1, int(self.ttl_s)))

    def clear(self, run_id: str) -> None:
        self.client.delete(self.prefix + checked_run_id(run_id))

    def mark_live(self, run_id: str, info: str) -> None:
        self.client.set(self.live_prefix + checked_run_id(run_id), info, ex=int(LIVE_FOR_S))

    def unmark_live(self, run_id: str) -> None:
        self.client.delete(self.live_prefix + checked_run_id(run_id))

    def live(self, run_id: str) -> str | None:
        value = self.client.get(self.live_prefix + checked_run_id(run_id))
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
