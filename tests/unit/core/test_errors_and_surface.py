"""The error tree and the public surface: what users import and catch."""

from __future__ import annotations

import importlib
import inspect
import pickle
import subprocess
import sys

import pytest

from stockade import exceptions

ALL_ERRORS: list[type[exceptions.StockadeError]] = [
    obj
    for _, obj in inspect.getmembers(exceptions, inspect.isclass)
    if issubclass(obj, exceptions.StockadeError)
]
ALL_SIGNALS: list[type[exceptions.RunStopped]] = [
    obj
    for _, obj in inspect.getmembers(exceptions, inspect.isclass)
    if issubclass(obj, exceptions.RunStopped)
]


ALL_RAISED: list[type[exceptions.StockadeError | exceptions.RunStopped]] = [*ALL_ERRORS, *ALL_SIGNALS]


@pytest.mark.parametrize("cls", ALL_RAISED, ids=lambda c: c.__name__)
def test_every_error_and_signal_pickles_with_its_state(
    cls: type[exceptions.StockadeError | exceptions.RunStopped],
) -> None:
    err = cls.__new__(cls)
    root = exceptions.RunStopped if issubclass(cls, exceptions.RunStopped) else exceptions.StockadeError
    root.__init__(err, "boom", retry_after=2.5)
    err.__dict__["extra"] = {"kept": True}
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == "boom" and back.retry_after == 2.5
    assert back.__dict__["extra"] == {"kept": True}
    assert back.retryable is cls.retryable


@pytest.mark.parametrize("cls", ALL_RAISED, ids=lambda c: c.__name__)
def test_every_error_and_signal_is_named_where_users_import_it(
    cls: type[exceptions.StockadeError | exceptions.RunStopped],
) -> None:
    # tracebacks and reprs show this name, and pickles hold it: one made by another version of
    # stockade loads only if no private module of the tree is named in it
    err = cls.__new__(cls)
    root = exceptions.RunStopped if issubclass(cls, exceptions.RunStopped) else exceptions.StockadeError
    root.__init__(err, "boom")
    assert cls.__module__ == "stockade.exceptions"
    assert b"stockade.exceptions._" not in pickle.dumps(err)


@pytest.mark.parametrize("cls", ALL_RAISED, ids=lambda c: c.__name__)
def test_every_error_and_signal_is_exported_and_reaches_a_client_as_itself(
    cls: type[exceptions.StockadeError | exceptions.RunStopped],
) -> None:
    # the client maps a service's error back to its class by the names the tree exports: one
    # left out (SnapshotStoreFull was) reached a client as whatever its HTTP status meant
    from stockade.client._http import _error_class

    assert cls.__name__ in exceptions.__all__
    if issubclass(cls, exceptions.StockadeError):
        assert _error_class(cls.__name__, 400) is cls


def test_transient_and_permanent_errors_are_told_apart() -> None:
    transient: set[type[exceptions.StockadeError]] = {
        exceptions.SandboxStartError,
        exceptions.BackendUnavailable,
        exceptions.ResourceContention,
    }
    for cls in transient:
        assert cls.retryable, cls
    permanent: set[type[exceptions.StockadeError]] = {
        exceptions.PolicyDenied, exceptions.PathEscapeError, exceptions.SandboxFileNotFound,
        exceptions.ConfigurationError, exceptions.LimitNotEnforceable, exceptions.TierUnavailable,
    }  # fmt: skip
    for cls in permanent:
        assert not cls.retryable, cls


def _drawn_parents() -> dict[str, str]:
    """Each class drawn in the module docstring's trees -> the class it is drawn under."""
    parents: dict[str, str] = {}
    path: list[str] = []
    for line in (exceptions.__doc__ or "").splitlines():
        if not line.startswith("    ") or not line.strip():
            continue
        body = line[4:]
        name = body.lstrip("│├└─ ").split(" ")[0]
        if not name.isidentifier():
            continue
        depth = (len(body) - len(body.lstrip("│├└─ "))) // 4
        path[depth:] = [name]
        if depth:
            parents[name] = path[depth - 1]
    return parents


def test_the_tree_docstring_is_the_class_tree() -> None:
    drawn = _drawn_parents()
    assert set(drawn) | {"StockadeError", "RunStopped"} == {c.__name__ for c in ALL_RAISED}
    for cls in ALL_RAISED:
        if cls.__name__ in drawn:
            assert cls.__bases__[0].__name__ == drawn[cls.__name__], cls


def test_run_signals_are_control_flow_no_except_exception_can_swallow() -> None:
    for cls in ALL_SIGNALS:
        assert not issubclass(cls, Exception) and not issubclass(cls, exceptions.StockadeError), cls
    with pytest.raises(exceptions.RunKilled):
        try:
            raise exceptions.RunKilled("killed", run_id="r")
        except Exception:  # what a tool or a wrapper may write
            pytest.fail("a kill was swallowed")


# What users import, name by name: a name added or removed is a decision, made here too.
PUBLIC: dict[str, set[str]] = {
    "stockade": {
        "AsyncSandbox", "BackendUnavailable", "CommandResult", "ConfigurationError", "DownloadResult",
        "Enforcement", "EntryInfo", "EntryType", "ExecRecord", "Execution", "ExecutionError", "FileTooLarge",
        "FileTypeError", "HostShare", "InvalidArgument", "LimitNotEnforceable", "Limits", "Listing",
        "ListingTooLarge",
        "Logs", "Mechanism",
        "NetworkPolicy", "PathEscapeError", "PathTooLong", "PolicyDenied", "ProtocolError",
        "ResourceContention",
        "Result", "Sandbox", "SandboxClosed", "SandboxCrashed", "SandboxError", "SandboxFileNotFound",
        "SandboxPool", "SandboxRules", "SandboxStartError", "SkippedEntry", "Snapshot", "SnapshotCorrupt",
        "SnapshotError", "SnapshotIncompatible", "SnapshotKind", "SnapshotNotFound", "SnapshotStore",
        "SnapshotStoreFull", "StockadeError", "TierReport",
        "TierUnavailable", "Trust", "WorkspaceError", "WorkspaceFull", "__version__",
    },
    "stockade.sandbox": {
        "TIMEOUT_MARGIN_S", "AsyncBackend", "AsyncInstance", "AsyncSandbox", "Backend", "Instance",
        "PoolStats", "Sandbox", "SandboxPool", "SandboxSpec", "SnapshotStore", "SpareBackend",
        "WrapperBackend", "WrapperInstance",
    },
    "stockade.agent": {
        "DEFAULT_SYSTEM_PROMPT", "Agent", "AgentEvent", "AgentRun", "CallToolsNode", "CheckFinished",
        "CheckNode", "CheckRecord", "Checkpointer", "DurableCheckpointer", "End", "Guard", "GuardContext",
        "JsonFileCheckpointer", "MemoryCheckpointer", "ModelDenied", "ModelRequestNode", "ModelRequested",
        "ModelResponded", "Node", "NodeKind", "Observer", "RunFinished", "RunLimits", "RunResult",
        "RunResumed", "RunStarted", "RunState", "RunStatus", "StepFinished", "StepRecord", "ToolCallRecord",
        "ToolCalled", "ToolDenied", "ToolRejected", "ToolReturned",
    },
    "stockade.assembly": {"AgentConfig", "AgentSession", "GuardedAgent", "build_agent", "effective_trust"},
    "stockade.client": {
        "AsyncClient", "AsyncRemoteRun", "AsyncRemoteSandbox", "AsyncRuns", "Client", "RemoteRun",
        "RemoteSandbox", "RunEvent", "Runs",
    },
    "stockade.testing": {
        "CapturedAudit", "FakeBackend", "FakeInstance", "FaultInjectingBackend", "FunctionModel",
        "MemoryWorkspace", "ScriptedModel", "capture_audit", "tool_call",
    },
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_surface_is_pinned(module: str) -> None:
    exported = importlib.import_module(module).__all__
    assert len(set(exported)) == len(exported), "a name is exported twice"
    assert set(exported) == PUBLIC[module]
    for name in exported:
        assert hasattr(importlib.import_module(module), name), name


def test_import_has_no_side_effects_and_loads_no_optional_dependency() -> None:
    # Block the optional dependencies: importing stockade must still work.
    code = (
        "import sys\n"
        "for name in ('docker', 'openai', 'anthropic', 'redis', 'psycopg', 'opentelemetry',"
        " 'celery', 'fastapi', 'mcp', 'llm_sandbox'):\n"
        "    sys.modules[name] = None\n"
        "import threading, os\n"
        "before = set(os.listdir('/proc/self/fd')); threads = threading.active_count()\n"
        "import stockade\n"
        "after = set(os.listdir('/proc/self/fd'))\n"
        "assert threading.active_count() == threads, 'a thread was started'\n"
        "assert len(after - before) <= 1, after - before\n"
        "optional = ('docker', 'pyseccomp', 'typer', 'rich', 'structlog', 'stamina')\n"
        "heavy = [m for m in optional if sys.modules.get(m) is not None]\n"
        "assert heavy == [], heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
