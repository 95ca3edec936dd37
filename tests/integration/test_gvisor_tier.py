"""gVisor specifics: its own kernel, and the mode without Docker (runsc on an OCI bundle)."""

from __future__ import annotations

import platform
from collections.abc import Iterator

import pytest

from stockade import Limits, Sandbox
from stockade.sandbox.gvisor import GVisorBackend, RunscBackend
from tests.conftest import require, require_tier

pytestmark = pytest.mark.gvisor


@pytest.fixture
def direct() -> Iterator[RunscBackend]:
    backend = RunscBackend()
    report = backend.probe()
    require("runsc without Docker", report.available, report.detail)
    yield backend


def test_gvisor_shows_its_own_kernel() -> None:
    require_tier("gvisor")
    with Sandbox.create("gvisor") as sbx:
        inside = sbx.commands.run("uname -r").stdout.strip()
    assert inside and inside != platform.release()


def test_runsc_without_docker_behaves_like_every_tier(direct: RunscBackend) -> None:
    with Sandbox.create(backend=direct, limits=Limits(memory_mb=256, timeout_s=10)) as sbx:
        assert sbx.commands.run("uname -r").stdout.strip() != platform.release()
        assert sbx.run_code("x = 41").error is None
        assert sbx.run_code("x + 1").text == "42"
        sbx.files.write("src/a.txt", "hello")
        assert sbx.commands.run("cat src/a.txt; echo; id -u").stdout == "hello\n1000\n"
        slow = sbx.commands.run("sleep 30", timeout_s=1)
        assert slow.timed_out
        bundle = direct.state_dir / f"gv-{sbx.id}"
        assert bundle.is_dir()
    assert not bundle.exists()


def test_runsc_without_docker_refuses_network(direct: RunscBackend) -> None:
    from stockade import exceptions as exc
    from stockade.types import NetworkPolicy

    with pytest.raises(exc.LimitNotEnforceable):
        Sandbox.create(backend=direct, network=NetworkPolicy(enabled=True))


def test_the_mode_is_a_setting() -> None:
    assert isinstance(GVisorBackend(mode="runsc").backend(), RunscBackend)
    assert GVisorBackend(mode="runsc", platform="kvm").platform == "kvm"
