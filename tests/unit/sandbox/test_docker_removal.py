"""How a container is removed: never a kill racing its own exit, never a start held up by an old removal.

A forced removal sends a kill; sent while the container is already ending (its supervisor was
just told to stop), it races that exit inside containerd's shim, and the engine can then hold
the removal for 30-90 s. These tests drive the removal against a recording stand-in for the
engine's API, which is all the code under test talks to.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import pytest

from stockade.sandbox import _docker_engine
from stockade.sandbox._docker_engine import EXIT_WAIT_S, remove_exited, retry_removals
from tests.conftest import require


class RecordingEngine:
    """The two calls a removal makes, recorded in order; ``exits`` says whether the container ends."""

    def __init__(self, *, exits: bool = True, removal_blocks: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.exits = exits
        self.removal_blocks = removal_blocks

    def wait(self, cid: str, timeout: float) -> dict[str, int]:
        self.calls.append(("wait", cid, timeout))
        if not self.exits:
            import requests  # docker-py's transport: what its client raises on a read timeout

            raise requests.exceptions.ReadTimeout("still running")
        return {"StatusCode": 0}

    def remove_container(self, cid: str, force: bool, v: bool) -> None:
        self.calls.append(("remove", cid, force))
        if self.removal_blocks is not None:
            self.removal_blocks.wait(10)


@pytest.fixture(autouse=True)
def _no_pending_removals() -> Any:
    require("docker-py", importlib.util.find_spec("docker") is not None, "pip install 'stockade[docker]'")
    yield
    with _docker_engine._pending_lock:
        _docker_engine._pending.clear()


def test_a_closing_container_is_given_time_to_exit_before_it_is_removed() -> None:
    engine = RecordingEngine()
    assert remove_exited(engine, "c1")
    assert engine.calls == [("wait", "c1", EXIT_WAIT_S), ("remove", "c1", True)]


def test_a_container_that_does_not_exit_is_removed_by_force_after_the_wait() -> None:
    engine = RecordingEngine(exits=False)
    assert remove_exited(engine, "c2")
    assert [call[0] for call in engine.calls] == ["wait", "remove"]


def test_a_failed_removal_is_retried_without_holding_up_the_caller() -> None:
    with _docker_engine._pending_lock:
        _docker_engine._pending.add("stuck")
    release = threading.Event()
    engine = RecordingEngine(removal_blocks=release)

    thread = retry_removals(engine)  # returns while the engine still holds the removal
    assert thread is not None and thread.is_alive()
    assert retry_removals(engine) is None, "one retry at a time"
    release.set()
    thread.join(10)

    assert engine.calls == [("remove", "stuck", True)]
    assert not _docker_engine._pending, "the retried removal went through"
    assert retry_removals(engine) is None, "nothing left to retry"
