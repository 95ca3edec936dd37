"""What is built ahead of a first start (the microVM's ready images, tests/integration): who
asks for it, and for which sandboxes. Over the shipped FakeBackend: nothing is started here."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from stockade.cli.main import app
from stockade.policy.load import parse_policy
from stockade.policy.prepare import prepare_policy
from stockade.sandbox.base import Backend, Instance, SandboxSpec, WrapperBackend
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.pool import SandboxPool
from stockade.testing import FakeBackend
from stockade.types import Limits
from tests.conftest import wait_for

runner = CliRunner()


class Preparing(WrapperBackend):
    """Records each prepare_for and start, in order; says it built a ready image."""

    def __init__(self) -> None:
        super().__init__(FakeBackend())
        self.calls: list[tuple[str, SandboxSpec]] = []

    def prepare_for(self, spec: SandboxSpec) -> str:
        self.calls.append(("prepare", spec))
        return "ready image"

    def start(self, spec: SandboxSpec) -> Instance:
        self.calls.append(("start", spec))
        return super().start(spec)


def test_a_pool_has_its_members_image_prepared_before_its_first_fill() -> None:
    backend = Preparing()
    limits = Limits(pids=64)
    with SandboxPool(backend=backend, size=2, limits=limits) as pool, pool.acquire():
        pass
    kinds = [kind for kind, _ in backend.calls]
    assert kinds[0] == "prepare" and kinds.count("prepare") == 1 and "start" in kinds
    prepared = backend.calls[0][1]
    assert all(spec == prepared for _, spec in backend.calls)  # the members' own spec


def test_a_tier_with_nothing_to_build_says_so_and_wrappers_pass_it_on() -> None:
    assert FakeBackend().prepare_for(SandboxSpec()) == ""
    assert WrapperBackend(Preparing()).prepare_for(SandboxSpec()) == "ready image"
    with Sandbox.create(backend=FakeBackend()) as sbx:
        assert sbx.started_from == ""


POLICY = """
[commands]
deny = ["curl"]

[roles.ci]

[roles.analyst]
"""


def test_a_policy_is_prepared_once_per_role_with_the_rules_its_sandboxes_get() -> None:
    backend = Preparing()
    policy = parse_policy(POLICY)
    assert prepare_policy(backend, policy, limits=Limits(memory_mb=256)) == {
        "ci": "ready image",
        "analyst": "ready image",
    }
    specs = [spec for _, spec in backend.calls]
    assert [spec.limits.memory_mb for spec in specs] == [256, 256]
    assert all(spec.rules is not None and "curl" in spec.rules.deny for spec in specs)
    assert all(not spec.network.egress and not spec.envs for spec in specs)
    assert prepare_policy(Preparing(), None) == {"": "ready image"}  # no policy: no rules


def test_the_cli_step_reports_what_starts_come_from(tmp_path: Path) -> None:
    result = runner.invoke(app, ["prepare", "--tier", "process"])
    assert result.exit_code == 0, result.output
    assert "nothing to build" in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[commands\n")
    result = runner.invoke(app, ["prepare", "--tier", "process", "--policy", str(bad)])
    assert result.exit_code == 2


def test_the_service_prepares_each_tenants_policy_at_start(tmp_path: Path) -> None:
    from stockade.server.context import ServiceConfig
    from stockade.server.service import Service
    from stockade.server.tenants import Tenant, Tenants

    backend = Preparing()
    policy = parse_policy(POLICY)
    tenants = Tenants(
        tenants={"acme": Tenant(id="acme", policy=policy), "other": Tenant(id="other")}, tokens={}
    )
    config = ServiceConfig(
        tenants=tenants, database=f"sqlite:///{tmp_path / 'service.db'}", temp_dir=tmp_path,
        prepare_tiers=("microvm",),
    )  # fmt: skip
    asked: list[str] = []

    def backends(tier: str) -> Backend:
        asked.append(tier)
        return backend

    service = Service(config, backends=backends)
    try:
        service.start()
        wait_for(lambda: len(backend.calls) == 3, what="the policies to be prepared", timeout_s=10)
    finally:
        service.close()
    assert set(asked) == {"microvm"}
    rules = [spec.rules for _, spec in backend.calls]
    assert sum(1 for r in rules if r is not None and "curl" in r.deny) == 2  # acme's two roles
