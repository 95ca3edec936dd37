"""Why a container's supervisor stream ended, as the engine's state tells it: a signal's exit
(128 + its number) is something outside; an exit of the supervisor's own is not."""

from __future__ import annotations

from typing import Any

import pytest

from stockade.exceptions import SandboxCrashed
from stockade.sandbox._docker_container import ContainerBoundary


class Engine:
    """The one engine call ``explain`` makes, answering with a stopped container's state."""

    def __init__(self, exit_code: int) -> None:
        self.state = {"Running": False, "Status": "exited", "ExitCode": exit_code, "OOMKilled": False}

    def inspect_container(self, cid: str) -> dict[str, Any]:
        return {"State": self.state}


def explained(exit_code: int) -> SandboxCrashed:
    boundary = ContainerBoundary(Engine(exit_code), "c0ffee", None, [], remote=True)
    error = boundary.explain(SandboxCrashed("sandbox is gone: the supervisor exited"))
    assert isinstance(error, SandboxCrashed)
    return error


@pytest.mark.parametrize("code", [137, 143])
def test_a_container_killed_by_a_signal_was_stopped_from_outside(code: int) -> None:
    error = explained(code)
    assert error.cause == "killed" and "from outside" in str(error)


@pytest.mark.parametrize("code", [0, 1, 2])
def test_a_supervisor_that_exited_by_itself_is_not_blamed_on_the_outside(code: int) -> None:
    """On gVisor code can open the supervisor's input (/proc/1/fd/3) and take a request off
    it: the supervisor exits 1, and the host said "stopped from outside", cause killed."""
    error = explained(code)
    assert error.cause != "killed" and "from outside" not in str(error)
    assert f"exit code {code}" in str(error) and "broken its channel" in str(error)
