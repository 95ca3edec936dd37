"""``Sandbox`` and ``AsyncSandbox``: the API users hold, the same on every tier.

Both turn friendly calls into ``ops`` values for an ``Instance``: ``_requests`` builds those
values and shapes the results, so that the twins differ only in ``await``; ``_namespaces``
holds their ``commands`` and ``files``, ``_startup`` the settings and tier a sandbox starts
with (from a snapshot too).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from stockade import exceptions as exc
from stockade._checks import check_host_folder
from stockade._threads import off_loop
from stockade.sandbox import _registry
from stockade.sandbox._approver import Approver, AsyncApprover, check_approver, on_loop
from stockade.sandbox._namespaces import AsyncCommands, AsyncFiles, Commands, Files, loop_sink
from stockade.sandbox._requests import TextCallback, as_execution, code_op, text_sink

# Kept importable from here, where the client and the tests have always found them.
from stockade.sandbox._requests import check_path as check_path  # noqa: PLC0414
from stockade.sandbox._requests import tar_directory as tar_directory  # noqa: PLC0414
from stockade.sandbox._startup import (
    check_backend,
    check_store,
    choose_tier,
    from_snapshot,
    sandbox_spec,
    store_of,
)
from stockade.sandbox.base import (
    AsyncBackend,
    AsyncInstance,
    Backend,
    Instance,
    ThreadedAsyncBackend,
    _ThreadedInstance,
    in_thread,
)
from stockade.sandbox.ops import Pause, Reset, RunCode, TakeSnapshot
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import (
    Enforcement,
    Execution,
    Limits,
    NetworkPolicy,
    SandboxRules,
    Snapshot,
    Trust,
)

__all__ = ["AsyncSandbox", "Sandbox"]


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
        approver: Approver | None = None,
        snapshot: Snapshot | str | None = None,
        store: SnapshotStore | None = None,
    ) -> Sandbox:
        """Start a sandbox on ``tier`` (default ``"process"``), or the cheapest tier this host has
        that ``trust`` allows (``prefer="strongest"``: the strongest); ``sbx.tier`` says which.

        ``workspace`` seeds the sandbox's workspace with a copy of a host directory; the
        sandbox never writes to the host directory itself (use ``files.download_dir``).
        ``rules`` are enforced on the code by the sandbox itself (``SandboxRules``: commands
        judged at each exec, read-only paths, denied programs masked, paths left out of the
        copy); ``approver`` is asked, on the host, about an exec the rules send for approval:
        only ``True`` (or ``Choice.APPROVED``) lets it run; anything else (``False``, ``None``,
        ``Choice.DENIED``, another value, an exception) refuses it, the reason in its record.
        The time it takes is not the call's: ``timeout_s`` stands still while it decides, for
        at most ``Limits.approval_wait_s`` (15 minutes) of a call in all.

        ``snapshot`` (a ``Snapshot`` or its id, in ``store``) starts the sandbox from a snapshot,
        as many times as wanted: on its tier and with its settings unless others are given;
        a memory snapshot goes on where its sandbox was, processes and variables included.
        """
        spec = sandbox_spec(limits, network, envs, allow_weaker, labels, rules=rules, approver=approver)
        check_backend(backend)
        if workspace is not None:  # checked before a sandbox starts, not after
            check_host_folder(workspace, argument="workspace")
        with contextlib.ExitStack() as reading:
            if snapshot is not None:
                # its objects stay while they are restored, even if it is deleted meanwhile
                reading.enter_context(store_of(snapshot, store).reading(snapshot))
                given = {"limits": limits, "network": network, "envs": envs}
                tier, spec = from_snapshot(snapshot, store, tier, spec, given)
            chosen = backend or _registry.backend(choose_tier(tier, trust, prefer))
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
    def rules(self) -> SandboxRules | None:
        """The rules the sandbox was started with (what its kernel holds of them:
        ``enforcement``); None: none, or not known."""
        return self.instance.rules

    @property
    def started_from(self) -> str:
        """What the sandbox started from where its tier makes something ahead (the microVM:
        "ready image", "boot image", "cold boot", "memory snapshot"); "" on other tiers."""
        return self.instance.started_from

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
        return self.instance.execute(TakeSnapshot(store=check_store(store), memory=memory))

    def pause(self, *, memory: bool | None = None, store: SnapshotStore | None = None) -> Snapshot:
        """Save the sandbox as ``snapshot`` does and stop it: ``Sandbox.resume(sbx.id)``, in this
        process or another one of this host, brings it back as it was."""
        return self.instance.execute(Pause(store=check_store(store), memory=memory))

    @classmethod
    def resume(
        cls,
        sandbox_id: str,
        *,
        store: SnapshotStore | None = None,
        backend: Backend | None = None,
        approver: Approver | None = None,
    ) -> Sandbox:
        """The paused sandbox ``sandbox_id``, running again under its id. One resume wins:
        the others (and a second one) get ``SnapshotNotFound``."""
        check_approver(approver)  # before the claim: a refused one must not use the pause up
        check_backend(backend)
        chosen = check_store(store)
        with chosen.claim("paused", sandbox_id) as ref:
            tier, spec = from_snapshot(
                ref["snapshot"],
                chosen,
                None,
                sandbox_spec(None, None, None, False, None),
                {},
                sandbox_id=sandbox_id,
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
        approver: AsyncApprover | None = None,
        snapshot: Snapshot | str | None = None,
        store: SnapshotStore | None = None,
    ) -> AsyncSandbox:
        """See ``Sandbox.create``; ``approver`` may also be an ``async def``, awaited on this
        loop while the call waits."""
        import asyncio  # lazily: importing stockade must stay cheap

        check_approver(approver, asynchronous=True)
        if approver is not None:
            approver = on_loop(approver, asyncio.get_running_loop())
        spec = sandbox_spec(limits, network, envs, allow_weaker, labels, rules=rules, approver=approver)
        check_backend(backend, asynchronous=True)
        if workspace is not None:  # checked before a sandbox starts, not after
            check_host_folder(workspace, argument="workspace")
        reading = contextlib.ExitStack()
        try:
            if snapshot is not None:
                # its objects stay while they are restored, even if it is deleted meanwhile
                held = store_of(snapshot, store).reading(snapshot)
                await off_loop(reading.enter_context, held)
                given = {"limits": limits, "network": network, "envs": envs}
                tier, spec = await off_loop(from_snapshot, snapshot, store, tier, spec, given)
            if backend is None:
                name = await off_loop(choose_tier, tier, trust, prefer)
                backend = await off_loop(_registry.backend, name)
            chosen = backend if isinstance(backend, AsyncBackend) else ThreadedAsyncBackend(backend)
            instance = await chosen.astart(spec)
        finally:
            await off_loop(reading.close)
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

    @property
    def started_from(self) -> str:
        """As ``Sandbox.started_from``."""
        return self.instance.started_from

    @property
    def alive(self) -> bool:
        return self.instance.alive

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
        sink = loop_sink(on_stdout, on_stderr)
        if isinstance(op, RunCode):
            return await self.instance.aexecute(op, sink)
        return as_execution(await self.instance.aexecute(op, sink))

    async def reset(self) -> None:
        await self.instance.aexecute(Reset())

    async def snapshot(self, *, memory: bool | None = None, store: SnapshotStore | None = None) -> Snapshot:
        """See ``Sandbox.snapshot``."""
        return await self.instance.aexecute(TakeSnapshot(store=check_store(store), memory=memory))

    async def pause(self, *, memory: bool | None = None, store: SnapshotStore | None = None) -> Snapshot:
        """See ``Sandbox.pause``."""
        return await self.instance.aexecute(Pause(store=check_store(store), memory=memory))

    @classmethod
    async def resume(
        cls,
        sandbox_id: str,
        *,
        store: SnapshotStore | None = None,
        backend: AsyncBackend | Backend | None = None,
        approver: AsyncApprover | None = None,
    ) -> AsyncSandbox:
        """See ``Sandbox.resume`` (and ``AsyncSandbox.create`` for ``approver``)."""
        import asyncio  # lazily: importing stockade must stay cheap

        check_approver(approver, asynchronous=True)
        if approver is not None:
            approver = on_loop(approver, asyncio.get_running_loop())
        if isinstance(backend, AsyncBackend):
            raise exc.InvalidArgument(
                "resume takes a blocking Backend", argument="backend", fix="give the tier's Backend instance"
            )
        check_backend(backend)
        if store is not None:  # checked here, as ``Sandbox.resume`` does
            check_store(store)
        sync = await in_thread(
            lambda: Sandbox.resume(sandbox_id, store=store, backend=backend, approver=approver),
            orphan=lambda resumed: _pause_again(resumed, store),
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

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} tier={self.tier} alive={self.alive}>"


def _pause_again(sbx: Sandbox, store: SnapshotStore | None) -> None:
    """A sandbox resumed as the task resuming it was cancelled: paused again, to be resumed
    later (closed if it cannot be), not left running with nobody holding it."""
    try:
        sbx.pause(store=store)
    finally:
        sbx.close()
