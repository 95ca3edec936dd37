"""Shipped test doubles: test the logic above a sandbox without starting one.

``FakeBackend(handler)`` starts instances that answer every operation with
``handler(op)``. The default handler, ``MemoryWorkspace``, keeps files in memory (with the
same path rules as the real tiers) and answers commands with ``commands(op)``.

    backend = FakeBackend(MemoryWorkspace(commands=lambda op: CommandResult(...)))
    with Sandbox.create(backend=backend) as sbx: ...

A ``MemoryWorkspace`` sandbox can be snapshotted, paused and started from a snapshot (its
files only, ``snapshot.kind`` "files"), in a real ``SnapshotStore``, as the real tiers do.

``FaultInjectingBackend(backend, path=...)`` wraps any backend, the real tiers too, and makes
a read fail as a busy host would: what retries, audit trails and run stores must survive.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from stockade import exceptions as exc
from stockade.models.scripted import FunctionModel, ScriptedModel, tool_call
from stockade.sandbox.base import (
    AsyncBackend,
    AsyncInstance,
    Backend,
    Instance,
    OpResult,
    OutputSink,
    SandboxSpec,
    WrapperBackend,
    WrapperInstance,
)
from stockade.sandbox.ops import (
    GetArchive,
    ListDir,
    MakeDir,
    Op,
    Pause,
    PutArchive,
    ReadFile,
    Remove,
    Reset,
    RunCode,
    RunCommand,
    Stat,
    TakeExecs,
    TakeSnapshot,
    WriteFile,
)
from stockade.testing.audit import CapturedAudit, capture_audit
from stockade.types import (
    CommandResult,
    Enforcement,
    EntryInfo,
    EntryType,
    Execution,
    JudgedExecs,
    Listing,
    Mechanism,
    Snapshot,
    SnapshotKind,
    TierReport,
)

__all__ = [
    "CapturedAudit",
    "FakeBackend",
    "FakeInstance",
    "FaultInjectingBackend",
    "FunctionModel",
    "MemoryWorkspace",
    "ScriptedModel",
    "capture_audit",
    "tool_call",
]

Handler = Callable[[Op[Any]], OpResult]
FAKE_ENFORCEMENT = Enforcement(
    memory=Mechanism.NONE,
    cpus=Mechanism.NONE,
    pids=Mechanism.NONE,
    disk=Mechanism.NONE,
    network=Mechanism.NONE,
    timeout=Mechanism.NONE,
    weakened=("fake: nothing is enforced",),
)


def _ok(op: RunCommand) -> CommandResult:
    return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0.0)


def _no_code(op: RunCode) -> Execution:
    return Execution()


@dataclass
class MemoryWorkspace:
    """An in-memory workspace: files as bytes, directories implied or explicit."""

    commands: Callable[[RunCommand], CommandResult] = _ok
    code: Callable[[RunCode], Execution] = _no_code
    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)

    def __call__(self, op: Op[Any]) -> OpResult:
        match op:
            case RunCommand():
                return self.commands(op)
            case RunCode():
                return self.code(op)
            case ReadFile():
                return self._read(op)
            case WriteFile():
                return self._write(op)
            case MakeDir():
                return self._make_dir(op)
            case Stat():
                path = self._norm(op.path)
                return self._entry(path) if path in self.files or self._is_dir(path) else None
            case ListDir():
                return self._list(self._norm(op.path), op.depth)
            case Remove():
                self._remove(op)
                return None
            case PutArchive():
                self._put_archive(op)
                return None
            case GetArchive():
                return self._get_archive(op)
            case Reset():
                self.files.clear()
                self.dirs.clear()
                return None
            case TakeExecs():
                return JudgedExecs()  # it judges no execs
        raise exc.ConfigurationError(f"MemoryWorkspace cannot handle {op!r}")

    def _read(self, op: ReadFile) -> bytes:
        path = self._norm(op.path)
        if path in self.dirs or self._is_dir(path):
            raise exc.FileTypeError(f"{op.path!r} is a directory", path=op.path)
        if path not in self.files:
            raise exc.SandboxFileNotFound(f"{op.path!r}: no such file", path=op.path)
        data = self.files[path]
        if op.length is None and len(data) > op.max_bytes:  # as a sandbox refuses it
            raise exc.FileTooLarge(f"{op.path!r} is {len(data)} bytes (cap {op.max_bytes})", path=op.path)
        if op.offset == 0 and (op.length is None or op.length >= len(data)):
            return data
        return data[op.offset : None if op.length is None else op.offset + min(op.length, op.max_bytes)]

    def _write(self, op: WriteFile) -> EntryInfo:
        path = self._norm(op.path)
        if self._is_dir(path):
            raise exc.FileTypeError(f"{op.path!r} is a directory", path=op.path)
        self.files[path] = op.data
        self._add_parents(path)
        return self._entry(path)

    def _make_dir(self, op: MakeDir) -> EntryInfo:
        path = self._norm(op.path)
        if path in self.files:
            raise exc.FileTypeError(f"{op.path!r} exists and is not a directory", path=op.path)
        self.dirs.add(path)
        self._add_parents(path)
        return self._entry(path)

    def _remove(self, op: Remove) -> None:
        path = self._norm(op.path)
        if path not in self.files and not self._is_dir(path):
            raise exc.SandboxFileNotFound(f"{op.path!r}: no such file", path=op.path)
        self.files = {k: v for k, v in self.files.items() if k != path and not k.startswith(path + "/")}
        self.dirs = {d for d in self.dirs if d != path and not d.startswith(path + "/")}

    def _put_archive(self, op: PutArchive) -> None:
        data = op.data if op.folder is None else b"".join(op.folder.chunks())  # held in memory anyway
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                target = self._norm(posixpath.join(op.path, member.name))
                if member.isdir():
                    self.dirs.add(target)
                elif member.isfile():
                    extracted = tar.extractfile(member)
                    self.files[target] = extracted.read() if extracted else b""
                    self._add_parents(target)

    def _get_archive(self, op: GetArchive) -> bytes:
        buf = io.BytesIO()
        base = self._norm(op.path)
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path, data in sorted(self.files.items()):
                if base and not path.startswith(base + "/"):
                    continue
                info = tarfile.TarInfo(path[len(base) + 1 :] if base else path)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    @staticmethod
    def _norm(path: str) -> str:
        if path.startswith("/workspace"):
            path = path[len("/workspace") :]
        norm = posixpath.normpath("/" + path).lstrip("/")
        if norm.startswith(".."):
            raise exc.PathEscapeError(f"{path!r} leads outside the workspace", path=path)
        return "" if norm == "." else norm

    def _is_dir(self, path: str) -> bool:
        if path == "" or path in self.dirs:
            return True
        if path in self.files:  # a file, not also a folder unless made one: no scan of every file
            return False  # (each read of one scanned them all: quadratic in a workspace's files)
        prefix = path + "/"
        return any(k.startswith(prefix) for k in self.files) or any(d.startswith(prefix) for d in self.dirs)

    def _add_parents(self, path: str) -> None:
        parent = posixpath.dirname(path)
        while parent:
            self.dirs.add(parent)
            parent = posixpath.dirname(parent)

    def _entry(self, path: str) -> EntryInfo:
        is_file = path in self.files
        return EntryInfo(
            path=path,
            name=posixpath.basename(path),
            type=EntryType.FILE if is_file else EntryType.DIR,
            size=len(self.files[path]) if is_file else 0,
            mode=0o644 if is_file else 0o755,
            mtime=time.time(),
        )

    def _list(self, base: str, depth: int) -> Listing:
        if not self._is_dir(base):
            raise exc.FileTypeError(f"{base!r} is not a directory", path=base)
        names = set(self.files) | self.dirs
        out = []
        for path in sorted(names):
            rel = path[len(base) + 1 :] if base else path
            if base and not path.startswith(base + "/"):
                continue
            if rel and rel.count("/") < depth:
                out.append(self._entry(path))
        return Listing(out)


class FakeInstance(Instance, AsyncInstance):
    def __init__(self, handler: Handler, tier: str, number: int, *, spec: SandboxSpec | None = None) -> None:
        self.handler = handler
        self.spec = spec or SandboxSpec()
        self.rules = self.spec.rules
        self.id = self.spec.sandbox_id or f"fake-{number}"
        self.tier = tier
        # as a tier's: what is weaker is said only to a caller who accepted it (allow_weaker),
        # for code that refuses a weaker sandbox to be tested on the fake
        self.enforcement = (
            FAKE_ENFORCEMENT if self.spec.allow_weaker else replace(FAKE_ENFORCEMENT, weakened=())
        )
        self.ops: list[Op[Any]] = []
        self.closed = False
        self.cuts = 0  # ``cut_running`` calls that reached it

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        if self.closed:
            raise exc.SandboxClosed(f"sandbox {self.id} is closed")
        self.ops.append(op)
        if isinstance(op, TakeSnapshot | Pause) and isinstance(self.handler, MemoryWorkspace):
            return self._snapshot(op)
        result = self.handler(op)
        if sink is not None and isinstance(result, CommandResult):
            if result.stdout:
                sink(1, result.stdout.encode())
            if result.stderr:
                sink(2, result.stderr.encode())
        return result

    def _snapshot(self, op: TakeSnapshot | Pause) -> Snapshot:
        """The workspace's files as one object of the store, as a files snapshot of a real tier."""
        from stockade.sandbox._supervised import spec_state

        if op.memory:
            raise exc.LimitNotEnforceable(
                "the fake keeps files only in a snapshot", setting="snapshot memory", fix="pass memory=None"
            )
        assert isinstance(self.handler, MemoryWorkspace)
        digest = op.store.add_bytes(self.handler._get_archive(GetArchive()))
        pause = isinstance(op, Pause)
        snapshot = op.store.save(
            kind=SnapshotKind.FILES, tier=self.tier, source=self.id, spec=spec_state(self.spec),
            blobs={"workspace": digest}, ref=("paused", self.id) if pause else ("kept", ""),
        )  # fmt: skip
        if pause:
            self.close()
        return snapshot

    def seed(self, snapshot: Snapshot) -> None:
        """Put a snapshot's files into this fresh sandbox, every byte checked first."""
        from pathlib import Path

        from stockade.sandbox.snapshots import SnapshotStore

        store = SnapshotStore(Path(snapshot.store))
        manifest = store.verify(snapshot)
        if "workspace" not in manifest.blobs:
            raise exc.SnapshotIncompatible(f"snapshot {snapshot.id} was not taken by a fake sandbox")
        self.handler(PutArchive(data=store.check_object(manifest.blobs["workspace"]).read_bytes()))

    async def ahandle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        return self.handle(op, sink)

    @property
    def alive(self) -> bool:
        return not self.closed

    def close(self) -> None:
        self.closed = True

    def cut_running(self) -> None:
        self.cuts += 1

    async def aclose(self) -> None:
        self.close()


class FakeBackend(Backend, AsyncBackend):
    """A backend whose sandboxes answer every operation with ``handler(op)``.

    Each instance gets ``handler_factory()`` when one is given (a fresh workspace per
    sandbox), else the shared ``handler``. ``instances`` records what was started.
    """

    def __init__(
        self,
        handler: Handler | None = None,
        *,
        handler_factory: Callable[[], Handler] | None = None,
        tier: str = "fake",
    ) -> None:
        self.tier = tier
        self._handler = handler
        self._factory = handler_factory or (MemoryWorkspace if handler is None else None)
        self.instances: list[FakeInstance] = []
        self.specs: list[SandboxSpec] = []

    def probe(self) -> TierReport:
        return TierReport(tier=self.tier, available=True, detail="fake backend", enforcement=FAKE_ENFORCEMENT)

    def start(self, spec: SandboxSpec) -> FakeInstance:
        handler = self._factory() if self._factory is not None else self._handler
        assert handler is not None
        instance = FakeInstance(handler, self.tier, len(self.instances) + 1, spec=spec)
        if spec.snapshot is not None and isinstance(handler, MemoryWorkspace):
            instance.seed(spec.snapshot)
        self.instances.append(instance)
        self.specs.append(spec)
        return instance

    async def astart(self, spec: SandboxSpec) -> FakeInstance:
        return self.start(spec)


class _FaultInjectingInstance(WrapperInstance):
    def __init__(self, wrapped: Instance, backend: FaultInjectingBackend) -> None:
        super().__init__(wrapped)
        self.backend = backend

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        if self.backend.fails(op):
            raise exc.ResourceContention("injected: the host is busy")
        return self.wrapped.handle(op, sink)


class FaultInjectingBackend(WrapperBackend):
    """Starts ``wrapped``'s sandboxes; the next read of ``path`` in any of them fails with a
    transient ``ResourceContention`` (``times`` reads in all). With ``armed=False`` nothing
    fails until ``arm()`` is called (say, once the run has started). ``injected`` counts."""

    def __init__(self, wrapped: Backend, *, path: str, armed: bool = True, times: int = 1) -> None:
        super().__init__(wrapped)
        self.path = path
        self.armed = armed
        self.times = times
        self.injected = 0
        self._lock = threading.Lock()

    def arm(self) -> None:
        self.armed = True

    def fails(self, op: Op[Any]) -> bool:
        """Whether ``op`` is to fail (counted as injected if so)."""
        if not (self.armed and isinstance(op, ReadFile) and op.path == self.path):
            return False
        with self._lock:
            if self.injected >= self.times:
                return False
            self.injected += 1
            return True

    def start(self, spec: SandboxSpec) -> Instance:
        return _FaultInjectingInstance(self.wrapped.start(spec), self)
