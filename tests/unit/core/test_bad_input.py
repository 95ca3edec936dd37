"""A wrong value fails where it is passed, with a typed error naming it and what to give instead."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stockade import ConfigurationError, InvalidArgument, Limits, Sandbox, WorkspaceError
from stockade.assembly import AgentConfig
from stockade.cli.main import app
from stockade.models import ScriptedModel
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.types import Trust


def fake_sandbox(**kwargs: Any) -> Sandbox:
    return Sandbox.create(backend=FakeBackend(MemoryWorkspace()), **kwargs)


def test_an_unknown_trust_names_the_argument_and_the_choices() -> None:
    with pytest.raises(InvalidArgument) as caught:
        Sandbox.create(trust="bogus")
    assert caught.value.argument == "trust"
    for choice in ("trusted", "internal", "untrusted", "multi-tenant"):
        assert choice in str(caught.value)
    assert isinstance(caught.value, ConfigurationError)  # still the family callers already catch


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("memory_mb", "512", "whole number"),
        ("memory_mb", True, "whole number"),
        ("cpus", "1", "number"),
        ("timeout_s", math.inf, "finite"),
        ("timeout_s", math.nan, "finite"),
        ("pids", 10**9, "4194304"),
        ("pids", 2, "from 8"),
        ("memory_mb", 1.5, "whole number"),
    ],
)
def test_limits_name_the_field_and_the_range(field: str, value: object, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        Limits(**{field: value})  # type: ignore[arg-type]  # wrong on purpose
    assert caught.value.argument == f"Limits.{field}"
    assert says in str(caught.value) and caught.value.fix in str(caught.value)


class _Unshowable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_a_value_whose_repr_raises_is_still_refused_with_a_typed_error_naming_its_type() -> None:
    with pytest.raises(InvalidArgument, match="_Unshowable") as caught:
        Limits(memory_mb=_Unshowable())  # type: ignore[arg-type]  # wrong on purpose
    assert caught.value.argument == "Limits.memory_mb"


def test_the_largest_accepted_limits_are_what_the_kernel_takes() -> None:
    Limits(pids=4_194_304, timeout_s=3600.0, cpus=2, memory_mb=64)  # an int for cpus is fine


@pytest.mark.parametrize("name", ["A=B", "", "A\x00"])
def test_an_environment_name_a_process_cannot_receive_is_refused(name: str) -> None:
    with pytest.raises(InvalidArgument, match="name") as caught:
        fake_sandbox(envs={name: "x"})
    assert caught.value.argument == "envs"
    with fake_sandbox() as sbx, pytest.raises(InvalidArgument):
        sbx.commands.run("true", envs={name: "x"})


def test_an_environment_value_must_be_text() -> None:
    with pytest.raises(InvalidArgument, match="string"):
        fake_sandbox(envs={"N": 1})


@pytest.mark.parametrize("timeout", [-1, 0, math.inf, "5"])
def test_a_call_timeout_is_checked(timeout: object) -> None:
    with fake_sandbox() as sbx:
        with pytest.raises(InvalidArgument) as caught:
            sbx.commands.run("true", timeout_s=timeout)  # type: ignore[arg-type]
        assert caught.value.argument == "timeout_s"
        with pytest.raises(InvalidArgument):
            sbx.run_code("1", timeout_s=timeout)  # type: ignore[arg-type]


def test_an_unknown_tier_is_named_as_unknown_not_as_too_weak() -> None:
    with pytest.raises(InvalidArgument) as caught:
        AgentConfig(model=ScriptedModel(["hi"]), tier="bogus")
    assert caught.value.argument == "AgentConfig.tier"
    assert "weaker" not in str(caught.value) and "process" in str(caught.value)
    with pytest.raises(InvalidArgument, match="unknown tier"):
        Sandbox.create("bogus")


def test_agent_config_trust_is_checked_and_accepts_the_string() -> None:
    with pytest.raises(InvalidArgument, match=r"AgentConfig\.trust"):
        AgentConfig(model=ScriptedModel(["hi"]), trust="bogus")  # type: ignore[arg-type]
    config = AgentConfig(model=ScriptedModel(["hi"]), trust="trusted")  # type: ignore[arg-type]
    assert config.trust == "trusted"


def test_run_code_on_a_missing_file_says_so_without_a_traceback(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["run-code", str(tmp_path / "missing.py")])
    assert result.exit_code == 2
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "missing.py" in result.output and "No such file" in result.output
    assert "Traceback" not in result.output


def test_a_task_holding_a_lone_surrogate_is_refused_by_name(tmp_path: Path) -> None:
    """`run_sync("task \\ud800")` raised a bare UnicodeEncodeError from the run store. Refused,
    not stored escaped: an escape would change what the model is asked."""
    from stockade.assembly import build_agent

    config = AgentConfig(
        model=ScriptedModel(["done"]),
        trust=Trust.TRUSTED,
        backend=FakeBackend(MemoryWorkspace(), tier="process"),
        audit=f"sqlite:///{tmp_path / 'a.db'}",
        approval_dir=tmp_path / "approvals",
    )
    with build_agent(config) as agent, pytest.raises(InvalidArgument) as caught:
        agent.run_sync("task \ud800")
    assert caught.value.argument == "task" and "\\ud800" in str(caught.value)


@pytest.mark.parametrize(
    "too_long",
    [Path("x" * 300), Path(*["y" * 200] * 30)],
    ids=["a name past 255 bytes", "a path past 4096 bytes"],
)
def test_a_host_folder_whose_path_the_file_system_cannot_take_is_refused_naming_it(
    tmp_path: Path, too_long: Path
) -> None:
    """Sandbox.create(workspace=...) and upload_dir let the OSError of ENAMETOOLONG out;
    download_dir said so, with the path twice over."""
    folder = tmp_path / too_long
    with pytest.raises(InvalidArgument, match="longer than the file system takes") as caught:
        fake_sandbox(workspace=folder)
    assert caught.value.argument == "workspace"
    assert str(folder)[:40] in str(caught.value) and str(folder)[-40:] in str(caught.value)
    with fake_sandbox() as sandbox:
        sandbox.files.write("a.txt", "hi")
        with pytest.raises(InvalidArgument, match="longer than the file system takes") as caught:
            sandbox.files.upload_dir(folder)
        assert caught.value.argument == "source"
        with pytest.raises(WorkspaceError, match="longer than the file system takes") as refused:
            sandbox.files.download_dir(folder)
        assert str(refused.value).count(str(folder)) == 1  # once, not twice over


def test_run_code_on_a_fifo_refuses_it_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "code.py")
    result = CliRunner().invoke(app, ["run-code", str(tmp_path / "code.py")])  # hung for ever
    assert result.exit_code == 2 and "is a FIFO" in result.output, result.output


def test_workspaces_of_a_database_that_does_not_exist_are_refused_and_nothing_is_made(tmp_path: Path) -> None:
    """A mistyped --db made the folders and an empty database, and listed no workspaces, exit 0
    (`runs list` refuses the same mistake)."""
    db = f"sqlite:///{tmp_path / 'typo' / 'service.db'}"
    for argv in (["list"], ["delete", "--no-role"]):
        result = CliRunner().invoke(app, ["workspaces", *argv, "--tenant", "acme", "--db", db])
        assert result.exit_code == 2 and "no service database at" in result.output, result.output
    assert not (tmp_path / "typo").exists()


def test_a_tenant_of_bytes_that_are_no_utf8_is_refused_by_name(tmp_path: Path) -> None:
    """A shell passes ``$'a\\xff'`` as a lone surrogate: it raised UnicodeEncodeError."""
    from stockade.server.state.schema import open_database
    from stockade.server.state.store import ServiceStore

    ServiceStore(open_database(str(tmp_path / "service.db"))).close()
    result = CliRunner().invoke(
        app, ["workspaces", "delete", "--tenant", "a\udcff", "--db", str(tmp_path / "service.db"), "x"]
    )
    assert result.exit_code == 2 and "a tenant is text (UTF-8)" in result.output, result.output


@pytest.mark.parametrize("limit", ["99999999999999999999", "-1", "0"])
def test_runs_list_takes_a_count_of_runs_it_can_list(tmp_path: Path, limit: str) -> None:
    """One past SQLite's integers raised OverflowError; -1 listed every run."""
    result = CliRunner().invoke(app, ["runs", "list", "--db", str(tmp_path / "none.db"), "-n", limit])
    assert result.exit_code == 2 and "--limit" in result.output, result.output


def test_a_service_snapshot_dir_that_is_a_file_is_refused_at_start(tmp_path: Path) -> None:
    """It started, and each tenant's first snapshot failed."""
    from stockade.server.context import ServiceConfig

    (tmp_path / "plain").write_text("")
    with pytest.raises(InvalidArgument, match="is not a folder") as caught:
        ServiceConfig(tenants=None, database="sqlite:///x.db", snapshot_dir=tmp_path / "plain")  # type: ignore[arg-type]
    assert caught.value.argument == "snapshot_dir"
