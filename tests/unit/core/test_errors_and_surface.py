"""The error tree and the public surface: what users import and catch."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys

import pytest

import stockade
from stockade import exceptions

ALL_ERRORS = [
    obj
    for _, obj in inspect.getmembers(exceptions, inspect.isclass)
    if issubclass(obj, exceptions.StockadeError)
]


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_state(cls: type[exceptions.StockadeError]) -> None:
    err = cls.__new__(cls)
    exceptions.StockadeError.__init__(err, "boom", retry_after=2.5)
    err.extra = {"kept": True}  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == "boom" and back.retry_after == 2.5
    assert back.extra == {"kept": True}  # type: ignore[attr-defined]
    assert back.retryable is cls.retryable


def test_transient_and_permanent_errors_are_told_apart() -> None:
    transient = {exceptions.SandboxStartError, exceptions.BackendUnavailable, exceptions.ResourceContention}
    for cls in transient:
        assert cls.retryable, cls
    permanent = {
        exceptions.PolicyDenied, exceptions.PathEscapeError, exceptions.SandboxFileNotFound,
        exceptions.ConfigurationError, exceptions.LimitNotEnforceable, exceptions.TierUnavailable,
    }  # fmt: skip
    for cls in permanent:
        assert not cls.retryable, cls


def test_every_error_is_drawn_in_the_tree_docstring() -> None:
    doc = exceptions.__doc__ or ""
    missing = [cls.__name__ for cls in ALL_ERRORS if cls.__name__ not in doc]
    assert missing == []


def test_the_public_surface_is_pinned() -> None:
    assert set(stockade.__all__) >= {
        "Sandbox", "AsyncSandbox", "Limits", "NetworkPolicy", "CommandResult", "Execution",
        "StockadeError", "PathEscapeError", "LimitNotEnforceable", "Trust",
    }  # fmt: skip
    for name in stockade.__all__:
        assert hasattr(stockade, name), name


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
