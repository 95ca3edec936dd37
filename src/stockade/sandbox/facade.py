"""``Sandbox`` and ``AsyncSandbox``: the API users hold, the same on every tier.

Both turn friendly calls into ``ops`` values for an ``Instance``; the shared helpers below
build those values and shape the results, so that the twins differ only in ``await``.
"""

from __future__ import annotations

import codecs
import dataclasses
import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal, overload

from stockade import exceptions as exc
from stockade._checks import check_choice, check_envs, check_timeout
from stockade.sandbox import _registry
from stockade.sandbox._supervised import WORKSPACE, spec_from_state
from stockade.sandbox.base import (
    AsyncBackend,
    AsyncInstance,
    Backend,
    Instance,
    OutputSink,
    SandboxSpec,
    ThreadedAsyncBackend,
    _ThreadedInstance,
)
from stockade.sandbox.ops import (
    DOWNLOAD_MAX_BYTES,
    DOWNLOAD_MAX_ENTRIES,
    GetArchive,
    ListDir,
    MakeDir,
    Pause,
    PutArchive,
    ReadFile,
    Remove,
    Reset,
    RunCode,
    RunCommand,
    Stat,
    TakeSnapshot,
    WriteFile,
    program_command,
)
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import (
    CommandResult,
    DownloadResult,
    Enforcement,
    EntryInfo,
    ExecRecord,
    Execution,
    ExecutionError,
    Limits,
    Logs,
    NetworkPolicy,
    SandboxRules,
    Snapshot,
    SnapshotKind,
    Trust,
)

__all__ = ["AsyncSandbox", "Sandbox"]

TextCallback = Callable[[str], object]

# run_code's language names -> the keys of ops.PROGRAM_ON_STDIN ("python" is the persistent
# interpreter; "python3" a fresh process).
INTERPRETERS: dict[str, str] = {
    "bash": "bash",
    "sh": "sh",
    "python3": "python3",
    "node": "node",
    "javascript": "node",
    "ruby": "ruby",
    "perl": "perl",
    "php": "php",
    "r": "r",
}


# -- shared helpers ----------------------------------------------------------------------


def check_path(path: str) -> str:
    """Refuse, before anything reaches the sandbox, paths that cannot be in the workspace."""
    if not isinstance(path, str):
        raise exc.ConfigurationError(f"paths are str, got {type(path).__name__}")
    if "\x00" in path:
        raise exc.PathEscapeError(f"{path!r} contains a NUL byte", path=path)
    if path.startswith("/") and not (path == WORKSPACE or path.startswith(WORKSPACE + "/")):
        raise exc.PathEscapeError(f"{path!r} is outside the workspace ({WORKSPACE})", path=path)
    relative = path[len(WORKSPACE) :] if path.startswith(WORKSPACE) else path
    depth = 0
    for part in relative.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                raise exc.PathEscapeError(f"{path!r} leads outside the workspace", path=path)
        elif part not in ("", "."):
            depth += 1
    return path


def command_op(
    cmd: str | Sequence[str],
    cwd: str | None,
    envs: Mapping[str, str] | None,
    timeout_s: float | None,
    stdin: str | bytes | None,
) -> RunCommand:
    argv = ("/bin/sh", "-c", cmd) if isinstance(cmd, str) else tuple(cmd)
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return RunCommand(
        argv=argv, cwd=cwd, envs=check_envs(envs), timeout_s=check_timeout(timeout_s), stdin=data
    )


def text_sink(on_stdout: TextCallback | None, on_stderr: TextCallback | None) -> OutputSink | None:
    """Adapt byte chunks to text callbacks; a UTF-8 character split across chunks survives."""
    if on_stdout is None and on_stderr is None:
        return None
    callbacks = {1: on_stdout, 2: on_stderr}
    decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in (1, 2)}

    def sink(fd: int, data: bytes) -> None:
        callback = callbacks.get(fd)
        if callback is not None:
            text = decoders[fd].decode(data)
            if text:
                callback(text)

    return sink


def as_execution(result: CommandResult) -> Execution:
    """A fresh-process run_code (bash, node, ...) reported like a Python one."""
    error = None
    if result.timed_out:
        error = ExecutionError(name="TimeoutError", value="the code ran past its timeout", traceback="")
    elif result.exit_code != 0:
        error = ExecutionError(
            name="NonZeroExit", value=f"exit code {result.exit_code}", traceback=result.stderr
        )
    return Execution(
        logs=Logs(stdout=result.stdout, stderr=result.stderr),
        error=error,
        duration_s=result.duration_s,
        timed_out=result.timed_out,
        truncated=result.truncated,
    )


def code_op(code: str, language: str, timeout_s: float | None) -> RunCode | RunCommand:
    if not isinstance(code, str):
        raise exc.InvalidArgument(
            f"code must be a str, got {type(code).__name__}", argument="code", fix="give the source as text"
        )
    timeout_s = check_timeout(timeout_s)
    lang = language.lower() if isinstance(language, str) else ""
    if lang in ("python", "py"):
        return RunCode(code=code, timeout_s=timeout_s)
    key = INTERPRETERS.get(lang)
    if key is None:
        raise exc.InvalidArgument(
            f"unknown language {language!r}",
            argument="language",
            fix=f"use python or one of {', '.join(sorted(INTERPRETERS))}",
        )
    # on standard input, never as an argument: the kernel caps one argument at 128 KiB
    return program_command(key, code, timeout_s)


def tar_directory(source: Path, hide: Sequence[str] = (), read: Sequence[str] = ("**",)) -> bytes:
    """``source`` as a tar archive: what ``read`` names (workspace globs), but what ``hide``
    names (a folder left out is left out with what it holds)."""
    import tarfile

    from stockade._globs import covers, glob_matches, may_hold

    if not source.is_dir():
        raise exc.ConfigurationError(f"workspace {str(source)!r} is not a directory")
    everything = "**" in (g.strip("/") for g in read)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if hide and covers(hide, info.name):
            return None
        if everything or glob_matches(read, info.name) or (info.isdir() and may_hold(read, info.name)):
            return info
        return None

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for child in sorted(source.iterdir()):
            tar.add(child, arcname=child.name, recursive=True, filter=keep)
    return buf.getvalue()


def _spec(
    limits: Limits | None,
    network: NetworkPolicy | None,
    envs: Mapping[str, str] | None,
    allow_weaker: bool,
    labels: Mapping[str, str] | None,
    *,
    rules: SandboxRules | None = None,
    approver: Callable[[ExecRecord], bool] | None = None,
) -> SandboxSpec:
    if limits is not None and not isinstance(limits, Limits):
        raise exc.InvalidArgument(
            f"limits must be a Limits, got {type(limits).__name__}",
            argument="limits",
            fix="give Limits(memory_mb=..., timeout_s=...)",
        )
    return SandboxSpec(
        limits=limits or Limits(),
        network=network or NetworkPolicy(),
        envs=check_envs(envs),
        allow_weaker=allow_weaker,
        labels=dict(labels or {}),
        rules=rules,
        approver=approver,
    )


def _from_snapshot(
    snapshot: Snapshot | str,
    store: SnapshotStore | None,
    tier: str | None,
    spec: SandboxSpec,
    given: Mapping[str, object],
    *,
    sandbox_id: str | None = None,
) -> tuple[str, SandboxSpec]:
    """The tier and settings of a sandbox started from ``snapshot``: the snapshot's, but what
    the caller gave (``given``: only what was not None). Memory keeps its machine: a snapshot
    of memory refuses other limits, and restores on another tier only its files, if it has them.
    """
    if not isinstance(snapshot, Snapshot | str):
        raise exc.InvalidArgument(
            f"snapshot must be a Snapshot or its id, got {type(snapshot).__name__}", argument="snapshot"
        )
    chosen = store or (SnapshotStore(Path(snapshot.store)) if isinstance(snapshot, Snapshot) else None)
    chosen = chosen or SnapshotStore.default()
    manifest = chosen.load(snapshot)
    value = manifest.snapshot
    kept = spec_from_state(manifest.spec)
    if value.kind is SnapshotKind.MEMORY and (tier is None or tier == value.tier):
        changed = sorted(k for k, v in given.items() if v is not None and k != "envs")
        if changed or given.get("envs"):
            raise exc.SnapshotIncompatible(
                f"snapshot {value.id} keeps a running sandbox's memory: its {', '.join(changed) or 'envs'} "
                "cannot change (take a files snapshot, memory=False, to start from it with other settings)"
            )
    limits = given.get("limits")
    network = given.get("network")
    envs = given.get("envs")
    merged = SandboxSpec(
        limits=limits if isinstance(limits, Limits) else kept.limits,
        network=network if isinstance(network, NetworkPolicy) else kept.network,
        envs={**kept.envs, **(envs if isinstance(envs, Mapping) else {})},
        allow_weaker=spec.allow_weaker or kept.allow_weaker,
        labels={**kept.labels, **spec.labels},
        rules=spec.rules if spec.rules is not None else kept.rules,
        approver=spec.approver,
        snapshot=value,
        sandbox_id=sandbox_id,
    )
    return tier or value.tier, merged


def _choose(tier: str | None, trust: Trust | str | None, prefer: _registry.Preference = "cheapest") -> str:
    if tier is not None and tier not in _registry.TIERS:
        raise exc.InvalidArgument(
            f"unknown tier {tier!r}", argument="tier", fix=f"give one of {', '.join(_registry.TIERS)}"
        )
    if trust is None:
        return tier or "process"
    level = check_choice(Trust, trust, argument="trust")
    allowed = _registry.allowed_tiers(level)
    if tier is not None:
        if tier not in allowed:
            raise exc.TierUnavailable(
                f"tier {tier!r} is too weak for trust {level.value!r}; allowed: {', '.join(allowed)}"
            )
        return tier
    return _registry.select_tier(level, prefer=prefer)


# -- sync --------------------------------------------------------------------------------


class Commands:
    def __init__(self, instance: Instance) -> None:
        self._instance = instance

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        stdin: str | bytes | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
    ) -> CommandResult:
        """Run ``cmd`` (a shell string, or an argv list run without a shell).

        A non-zero exit, a timeout or an OOM kill is reported in the result, never raised.
        """
        op = command_op(cmd, cwd, envs, timeout_s, stdin)
        return self._instance.execute(op, text_sink(on_stdout, on_stderr))


class Files:
    """The workspace (``/workspace`` inside). Paths are relative to it, or absolute under it."""

    def __init__(self, instance: Instance) -> None:
        self._instance = instance

    @overload
    def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        data = self._instance.execute(ReadFile(path=check_path(path)))
        return data if format == "bytes" else data.decode("utf-8", "replace")

    def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> EntryInfo:
        raw = data.encode() if isinstance(data, str) else data
        return self._instance.execute(WriteFile(path=check_path(path), data=raw, mode=mode))

    def list(self, path: str = "", *, depth: int = 1) -> list[EntryInfo]:
        return list(self._instance.execute(ListDir(path=check_path(path), depth=depth)))

    def stat(self, path: str) -> EntryInfo | None:
        return self._instance.execute(Stat(path=check_path(path), follow_symlinks=False))

    def exists(self, path: str) -> bool:
        return self.stat(path) is not None

    def remove(self, path: str) -> None:
        self._instance.execute(Remove(path=check_path(path)))

    def make_dir(self, path: str) -> EntryInfo:
        return self._instance.execute(MakeDir(path=check_path(path)))

    def upload_dir(
        self, source: str | Path, dest: str = "", *, hide: Sequence[str] = (), read: Sequence[str] = ("**",)
    ) -> None:
        """Copy a host directory into the workspace: what ``read`` names, but what ``hide``
        names (workspace globs)."""
        data = tar_directory(Path(source), hide, read)
        self._instance.execute(PutArchive(path=check_path(dest), data=data))

    def download_dir(
        self,
        dest: str | Path,
        source: str = "",
        *,
        max_bytes: int = DOWNLOAD_MAX_BYTES,
        max_entries: int = DOWNLOAD_MAX_ENTRIES,
    ) -> DownloadResult:
        """Copy a workspace folder (the whole workspace by default) into ``dest`` on the host.

        All or nothing, and nothing outside ``dest``: no link is followed while writing,
        symlinks are kept only when they resolve inside ``dest`` by every route, hard links
        stay hard links, FIFOs, sockets and devices are skipped (and listed in the result),
        setuid/setgid and group/other write bits are dropped. ``max_bytes`` caps the file
        contents written (1 GiB by default; a sparse file counts by its apparent size) and
        ``max_entries`` the entries: past either, ``FileTooLarge`` and nothing is left.
        """
        from stockade.sandbox._archive import Extraction

        op = GetArchive(path=check_path(source), max_bytes=max_bytes, max_entries=max_entries)
        with Extraction(dest, max_bytes=max_bytes, max_entries=max_entries) as unpack:
            whole = self._instance.execute(op, unpack.sink)
            if whole:  # a backend that answers with the whole archive (the shipped fakes)
                unpack.feed(whole)
            return unpack.finish()


class Sandbox:
    """One sandbox. Use ``Sandbox.create(...)`` as a context manager."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.commands = Commands(instance)
        self.files = Files(instance)

    @classmethod
    def create(
        cls,
        tier: str | None = None,
        *,
        trust: Trust | str | None = None,
        limits: Limits | None = None,
        network: NetworkPolicy | None = None,
        envs: Mapping[str, str] | None = None,
        workspace: str | Path | None = None,
        allow_weaker: bool = False,
        labels: Mapping[str, str] | None = None,
        backend: Backend | None = None,
        prefer: _registry.Preference = "cheapest",
        rules: SandboxRules | None = None,
        approver: Callable[[ExecRecord], bool] | None = None,
        snapshot: Snapshot | str | None = None,
        store: SnapshotStore | None = None,
    ) -> Sandbox:
        """Start a sandbox on ``tier`` (default ``"process"``), or the cheapest tier this host has
        that ``trust`` allows (``prefer="strongest"``: the strongest); ``sbx.tier`` says which.

        ``workspace`` seeds the sandbox's workspace with a copy of a host directory; the
        sandbox never writes to the host directory itself (use ``files.download_dir``).
        ``rules`` are enforced on the code by the sandbox itself (``SandboxRules``: commands
        judged at each exec, read-only paths, denied programs masked, paths left out of the
        copy); ``approver`` is asked, on the host, about an exec the rules send for approval.

        ``snapshot`` (a ``Snapshot`` or its id, in ``store``) starts the sandbox from a snapshot,
        as many times as wanted: on its tier and with its settings unless others are given;
        a memory snapshot goes on where its sandbox was, processes and variables included.
        """
        spec = _spec(limits, network, envs, allow_weaker, labels, rules=rules, approver=approver)
        if snapshot is not None:
            given = {"limits": limits, "network": network, "envs": envs}
            tier, spec = _from_snapshot(snapshot, store, tier, spec, given)
        chosen = backend or _registry.backend(_choose(tier, trust, prefer))
        instance = chosen.start(spec)
        sbx = cls(instance)
        if workspace is not None:
            try:
                sbx.files.upload_dir(
                    workspace, hide=rules.hide if rules else (), read=rules.read if rules else ("**",)
                )
            except BaseException:
                instance.close()
                raise
        return sbx

    @property
    def id(self) -> str:
        return self.instance.id

    @property
    def tier(self) -> str:
        return self.instance.tier

    @property
    def enforcement(self) -> Enforcement:
        """How each limit is enforced for this sandbox, and what was weakened (if allowed)."""
        return self.instance.enforcement

    @property
    def alive(self) -> bool:
        return self.instance.alive

    def run_code(
        self,
        code: str,
        language: str = "python",
        *,
        timeout_s: float | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
    ) -> Execution:
        """Run code. Python state persists between calls; other languages run fresh."""
        op = code_op(code, language, timeout_s)
        sink = text_sink(on_stdout, on_stderr)
        if isinstance(op, RunCode):
            return self.instance.execute(op, sink)
        return as_execution(self.instance.execute(op, sink))

    def reset(self) -> None:
        """Kill every process, drop interpreter state, empty the workspace and /tmp."""
        self.instance.execute(Reset())

    def snapshot(self, *, memory: bool | None = None, store: SnapshotStore | None = None) -> Snapshot:
        """Save the sandbox and go on; ``Sandbox.create(snapshot=...)`` starts copies of it.

        The workspace, /tmp (installed packages) and environment always; the memory of every
        process where the tier can (``snapshot.kind`` says which). ``memory=True`` requires
        it (``LimitNotEnforceable`` on a tier that cannot), ``memory=False`` keeps files only.
        Kept in ``store`` (``SnapshotStore.default()``) until deleted from it.
        """
        return self.instance.execute(TakeSnapshot(store=store or SnapshotStore.default(), memory=memory))

    def pause(self, *, memory: bool | None = None, store: SnapshotStore | None = None) -> Snapshot:
        """Save the sandbox as ``snapshot`` does and stop it: ``Sandbox.resume(sbx.id)``, in this
        process or another one of this host, brings it back as it was."""
        return self.instance.execute(Pause(store=store or SnapshotStore.default(), memory=memory))

    @classmethod
    def resume(
        cls,
        sandbox_id: str,
        *,
        store: SnapshotStore | None = None,
        backend: Backend | None = None,
        approver: Callable[[ExecRecord], bool] | None = None,
    ) -> Sandbox:
        """The paused sandbox ``sandbox_id``, running again under its id. One resume wins:
        the others (and a second one) get ``SnapshotNotFound``."""
        chosen = store or SnapshotStore.default()
        with chosen.claim("paused", sandbox_id) as ref:
            tier, spec = _from_snapshot(
                ref["snapshot"], chosen, None, _spec(None, None, None, False, None), {}, sandbox_id=sandbox_id
            )
            spec = dataclasses.replace(spec, approver=approver)
            instance = (backend or _registry.backend(tier)).start(spec)
        chosen.delete(ref["snapshot"])
        return cls(instance)

    def close(self) -> None:
        self.instance.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} tier={self.tier} alive={self.alive}>"


# -- async -------------------------------------------------------------------------------


def _threadsafe(callback: TextCallback | None) -> TextCallback | None:
    """Deliver streamed output on the event loop's thread, not the worker's."""
    import asyncio  # lazily: importing stockade must stay cheap

    if callback is None:
        return None
    loop = asyncio.get_running_loop()
    return lambda text: loop.call_soon_threadsafe(callback, text)


class AsyncCommands:
    def __init__(self, instance: AsyncInstance) -> None:
        self._instance = instance

    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        stdin: str | bytes | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
    ) -> CommandResult:
        op = command_op(cmd, cwd, envs, timeout_s, stdin)
        sink = text_sink(_threadsafe(on_stdout), _threadsafe(on_stderr))
        return await self._instance.aexecute(op, sink)


class AsyncFiles:
    def __init__(self, instance: AsyncInstance) -> None:
        self._instance = instance

    async def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        data = await self._instance.aexecute(ReadFile(path=check_path(path)))
        return data if format == "bytes" else data.decode("utf-8", "replace")

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> EntryInfo:
        raw = data.encode() if isinstance(data, str) else data
        return await self._instance.aexecute(WriteFile(path=check_path(path), data=raw, mode=mode))

    async def list(self, path: str = "", *, depth: int = 1) -> list[EntryInfo]:
        return list(await self._instance.aexecute(ListDir(path=check_path(path), depth=depth)))

    async def stat(self, path: str) -> EntryInfo | None:
        return await self._instance.aexecute(Stat(path=check_path(path), follow_symlinks=False))

    async def exists(self, path: str) -> bool:
        return await self.stat(path) is not None

    async def remove(self, path: str) -> None:
        await self._instance.aexecute(Remove(path=check_path(path)))

    async def make_dir(self, path: str) -> EntryInfo:
        return await self._instance.aexecute(MakeDir(path=check_path(path)))

    async def upload_dir(
        self, source: str | Path, dest: str = "", *, hide: Sequence[str] = (), read: Sequence[str] = ("**",)
    ) -> None:
        import asyncio  # lazily: importing stockade must stay cheap

        data = await asyncio.to_thread(tar_directory, Path(source), hide, read)
        await self._instance.aexecute(PutArchive(path=check_path(dest), data=data))

    async def download_dir(
        self,
        dest: str | Path,
        source: str = "",
        *,
        max_bytes: int = DOWNLOAD_MAX_BYTES,
        max_entries: int = DOWNLOAD_MAX_ENTRIES,
    ) -> DownloadResult:
        """See ``Files.download_dir``: the same guarantees, the disk work in a worker thread."""
        import asyncio  # lazily: importing stockade must stay cheap

        from stockade.sandbox._archive import Extraction

        op = GetArchive(path=check_path(source), max_bytes=max_bytes, max_entries=max_entries)
        unpack = await asyncio.to_thread(Extraction, dest, max_bytes=max_bytes, max_entries=max_entries)
        try:
            whole = await self._instance.aexecute(op, unpack.sink)
            if whole:  # a backend that answers with the whole archive (the shipped fakes)
                await asyncio.to_thread(unpack.feed, whole)
            return await asyncio.to_thread(unpack.finish)
        except BaseException:
            # Shielded: a second cancellation must not leave half a download behind.
            await asyncio.shield(asyncio.to_thread(unpack.abort))
            raise


class AsyncSandbox:
    """The asyncio twin of ``Sandbox``: ``sbx = await AsyncSandbox.create(...)``."""

    def __init__(self, instance: AsyncInstance) -> None:
        self.instance = instance
        self.commands = AsyncCommands(instance)
        self.files = AsyncFiles(instance)

    @classmethod
    async def create(
        cls,
        tier: str | None = None,
        *,
        trust: Trust | str | None = None,
        limits: Limits | None = None,
        network: NetworkPolicy | None = None,
        envs: Mapping[str, str] | None = None,
        workspace: str | Path | None = None,
        allow_weaker: bool = False,
        labels: Mapping[str, str] | None = None,
        backend: AsyncBackend | Backend | None = None,
        prefer: _registry.Preference = "cheapest",
        rules: SandboxRules | None = None,
        approver: Callable[[ExecRecord], bool] | None = None,
        snapshot: Snapshot | str | None = None,
        store: SnapshotStore | None = None,
    ) -> AsyncSandbox:
        """See ``Sandbox.create``."""
        import asyncio  # lazily: importing stockade must stay cheap

        spec = _spec(limits, network, envs, allow_weaker, labels, rules=rules, approver=approver)
        if snapshot is not None:
            given = {"limits": limits, "network": network, "envs": envs}
            tier, spec = await asyncio.to_thread(_from_snapshot, snapshot, store, tier, spec, given)
        if backend is None:
            name = await asyncio.to_thread(_choose, tier, trust, prefer)
            backend = await asyncio.to_thread(_registry.backend, name)
        chosen = backend if isinstance(backend, AsyncBackend) else ThreadedAsyncBackend(backend)
        instance = await chosen.astart(spec)
        sbx = cls(instance)
        if workspace is not None:
            try:
                seed = rules or SandboxRules()
                await sbx.files.upload_dir(workspace, hide=seed.hide, read=seed.read)
            except BaseException:
                await instance.aclose()
                raise
        return sbx

    @property
    def id(self) -> str:
        return self.instance.id

    @property
    def tier(self) -> str:
        return self.instance.tier

    @property
    def enforcement(self) -> Enforcement:
        return self.instance.enforcement

    async def run_code(
        self,
        code: str,
        language: str = "python",
        *,
        timeout_s: float | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
    ) -> Execution:
        op = code_op(code, language, timeout_s)
        sink = text_sink(_threadsafe(on_stdout), _threadsafe(on_stderr))
        if isinstance(op, RunCode):
            return await self.instance.aexecute(op, sink)
        return as_execution(await self.instance.aexecute(op, sink))

    async def reset(self) -> None:
        await self.instance.aexecute(Reset())

    async def snapshot(self, *, memory: bool | None = None, store: SnapshotStore | None = None) -> Snapshot:
        """See ``Sandbox.snapshot``."""
        return await self.instance.aexecute(
            TakeSnapshot(store=store or SnapshotStore.default(), memory=memory)
        )

    async def pause(self, *, memory: bool | None = None, store: SnapshotStore | None = None) -> Snapshot:
        """See ``Sandbox.pause``."""
        return await self.instance.aexecute(Pause(store=store or SnapshotStore.default(), memory=memory))

    @classmethod
    async def resume(
        cls,
        sandbox_id: str,
        *,
        store: SnapshotStore | None = None,
        backend: AsyncBackend | Backend | None = None,
        approver: Callable[[ExecRecord], bool] | None = None,
    ) -> AsyncSandbox:
        """See ``Sandbox.resume``."""
        import asyncio  # lazily: importing stockade must stay cheap

        if backend is not None and not isinstance(backend, Backend):
            raise exc.InvalidArgument("resume takes a blocking Backend", argument="backend")
        sync = await asyncio.to_thread(
            Sandbox.resume, sandbox_id, store=store, backend=backend, approver=approver
        )
        return cls(_ThreadedInstance(sync.instance))

    async def close(self) -> None:
        await self.instance.aclose()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
