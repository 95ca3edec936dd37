"""Config files are read bounded (regular files only, a size cap), and bad input on the command
line ends in one line and a documented exit code, never a traceback, a hang or MemoryError."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade._config_file import read_config_bytes, read_config_text
from stockade.assembly import AgentConfig
from stockade.cli.main import app
from stockade.exceptions import ConfigurationError, InvalidArgument, PolicyFileError
from stockade.policy.load import load_policy, parse_policy
from stockade.runtime.killswitch import FileKillSource, kill_source_for

# nine levels of anchors, each used ten times: 10^9 strings from a few hundred bytes
BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env=env)
    assert "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        result.exception
    )
    return result.exit_code, result.output


# -- the reader ---------------------------------------------------------------------------------


def test_a_symlink_to_dev_zero_is_refused_not_read(tmp_path: Path) -> None:
    (tmp_path / "z.toml").symlink_to("/dev/zero")
    with pytest.raises(InvalidArgument, match=r"z\.toml' is a character device"):
        read_config_bytes(tmp_path / "z.toml", what="the policy file")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "f.toml")
    with pytest.raises(InvalidArgument, match="is a FIFO"):
        read_config_bytes(tmp_path / "f.toml", what="the policy file")


def test_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="is a folder"):
        read_config_bytes(tmp_path, what="the key file")


def test_a_file_over_the_cap_is_refused_naming_the_file_and_the_cap(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(InvalidArgument, match=r"big.toml' is over 1 MiB") as caught:
        read_config_bytes(big, what="the policy file", max_bytes=1 << 20)
    assert caught.value.argument == "the policy file"
    assert read_config_bytes(big, what="the policy file", max_bytes=2 << 20) == b"#" * (2 << 20)


def test_a_missing_file_and_bytes_that_are_no_utf8_are_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"cannot read the tenants file .*No such file"):
        read_config_text(tmp_path / "none.toml", what="the tenants file")
    (tmp_path / "bad.toml").write_bytes(b"a = 1\n\xff")
    with pytest.raises(ConfigurationError, match="byte 6 is not UTF-8"):
        read_config_text(tmp_path / "bad.toml", what="the tenants file")


FIX = "give a readable text file, or - to read the code from standard input"


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("missing", "cannot read FILE '{path}': No such file or directory"),
        ("fifo", "FILE '{path}' is a FIFO"),
        ("folder", "FILE '{path}' is a folder"),
        ("no utf-8", "FILE '{path}': byte 1 is not UTF-8 (it must be UTF-8 text)"),
        ("too big", "FILE '{path}' is over 1 MiB, more than any FILE needs"),
    ],
)
def test_a_file_a_command_argument_names_is_refused_with_the_arguments_own_fix(
    tmp_path: Path, case: str, said: str
) -> None:
    """``run-code FILE``: whatever is wrong with the file, the error names the argument and
    says what it takes, once (the command rebuilt each error to swap the fix before)."""
    path = tmp_path / "code.py"
    if case == "fifo":
        os.mkfifo(path)
    elif case == "folder":
        path.mkdir()
    elif case == "no utf-8":
        path.write_bytes(b"x\xff")
    elif case == "too big":
        path.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(InvalidArgument) as caught:
        read_config_text(path, what="FILE", max_bytes=1 << 20, fix=FIX)
    assert str(caught.value) == f"{said.format(path=path)}; {FIX}" and caught.value.argument == "FILE"


def test_a_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "real.toml").write_text("[trust]\n")
    (tmp_path / "link.toml").symlink_to(tmp_path / "real.toml")
    assert read_config_text(tmp_path / "link.toml", what="the policy file") == "[trust]\n"


# -- what reads config files --------------------------------------------------------------------


def test_a_yaml_billion_laughs_is_refused_before_it_expands() -> None:
    with pytest.raises(PolicyFileError, match="expands to more than"):
        parse_policy(BILLION_LAUGHS, format="yaml", source="bomb.yaml")


def test_yaml_aliases_within_the_budget_still_load() -> None:
    policy = parse_policy(
        "commands: &c\n  deny: [curl, wget]\nnetwork:\n  enabled: false\n", format="yaml", source="p.yaml"
    )
    assert list(policy.commands.deny) == ["curl", "wget"]


def test_policy_files_tenants_files_and_scripted_turns_refuse_special_files(tmp_path: Path) -> None:
    from stockade.models import ScriptedModel
    from stockade.server.tenants import Tenants

    (tmp_path / "z.toml").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "f.json")
    with pytest.raises(InvalidArgument, match="policy file"):
        load_policy(tmp_path / "z.toml")
    with pytest.raises(InvalidArgument, match="tenants file"):
        Tenants.load(tmp_path / "z.toml")
    with pytest.raises(InvalidArgument, match="scripted turns file"):
        ScriptedModel.from_file(tmp_path / "f.json")
    (tmp_path / "t.toml").write_text('[tenants.acme]\npolicy = "z.toml"\n')
    with pytest.raises(InvalidArgument, match="policy file"):  # a tenant's policy: `serve` said MemoryError
        Tenants.load(tmp_path / "t.toml")


def test_policy_check_of_dev_zero_and_a_yaml_bomb_end_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "z.toml").symlink_to("/dev/zero")
    (tmp_path / "bomb.yaml").write_text(BILLION_LAUGHS)
    for name in ("z.toml", "bomb.yaml"):
        code, output = run("policy", "check", str(tmp_path / name))
        assert code != 0 and output.count("\n") <= 2, output


# -- one line and an exit code for bad input ----------------------------------------------------


def test_an_audit_key_file_that_is_missing_a_folder_or_a_fifo_is_one_line(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    db = f"sqlite:///{tmp_path / 'none.db'}"
    for key_file, says in (
        ("/nonexistent", "No such file"),
        (str(tmp_path), "is a folder"),
        (str(tmp_path / "fifo"), "is a FIFO"),
    ):
        code, output = run("audit", "verify", "--db", db, "--key-file", key_file)
        assert code == 2 and says in output, output


def test_an_audit_key_that_is_no_utf8_is_its_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade._config_file import audit_key

    raw = os.fsdecode(b"\xff\xfe" * 8)
    code, output = run("audit", "verify", "--db", str(tmp_path / "none.db"), env={"STOCKADE_AUDIT_KEY": raw})
    assert code == 2, output
    monkeypatch.setenv("STOCKADE_AUDIT_KEY", raw)
    assert audit_key() == b"\xff\xfe" * 8


def test_a_kill_target_that_is_no_url_or_no_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="Invalid IPv6 URL"):
        kill_source_for("redis://[::1")
    with pytest.raises(InvalidArgument, match="is not a folder"):
        FileKillSource("/dev/null")
    with pytest.raises(InvalidArgument, match="no Redis URL"):  # before an agent makes anything
        AgentConfig(model="scripted:none.json", kill_target="redis://[::1")
    code, output = run("kill", "x", "--target", "redis://[::1")
    assert code == 2 and "Invalid IPv6 URL" in output, output
    code, output = run("kill", "--all", "--target", "/dev/null")
    assert code == 2 and "is not a folder" in output, output


def test_an_agent_with_a_bad_kill_target_makes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "turns.json").write_text('["done"]')
    args = ("agent", "-w", str(tmp_path), "-m", f"scripted:{tmp_path / 'turns.json'}", "hi")
    code, output = run(*args, env={"STOCKADE_KILL_TARGET": "redis://[::1"})
    assert code == 2 and "Invalid IPv6 URL" in output, output
    assert not (tmp_path / ".stockade").exists()


def test_an_agent_says_when_its_kill_target_cannot_be_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "turns.json").write_text('["done"]')
    # the process tier under the default trust is refused after the warning: no sandbox is started
    args = ("agent", "-w", str(tmp_path), "-m", f"scripted:{tmp_path / 'turns.json'}", "-t", "process", "hi")
    _, output = run(*args, env={"STOCKADE_KILL_TARGET": "redis://127.0.0.1:1/0"})
    assert "the kill target cannot be reached" in output, output


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_snapshot_cap_is_one_line_naming_the_variable(value: str, tmp_path: Path) -> None:
    for command in (("snapshots", "list"), ("gc",)):
        code, output = run(
            *command, env={"STOCKADE_SNAPSHOT_MAX_MB": value, "STOCKADE_SNAPSHOT_DIR": str(tmp_path)}
        )
        assert code == 2 and "STOCKADE_SNAPSHOT_MAX_MB" in output and output.count("\n") <= 2, output


def test_a_run_id_that_is_no_utf8_names_no_run(tmp_path: Path) -> None:
    from stockade.runs import open_run_store

    db = f"sqlite:///{tmp_path / 'runs.db'}"
    with open_run_store(db):
        pass
    code, output = run("runs", "show", os.fsdecode(b"\xff"), "--db", db)
    assert code == 2 and "no run" in output, output


def test_an_output_the_os_cannot_write_is_one_line(tmp_path: Path) -> None:
    from stockade.audit import AuditLog, EventKind, SQLiteStore

    store = SQLiteStore(tmp_path / "a.db")
    with AuditLog(store) as log:
        log.record(EventKind.COMMAND, run_id="r", step=0, attributes={"argv": ["ls"]})
    store.close()
    code, output = run("audit", "export", "--db", f"sqlite:///{tmp_path / 'a.db'}", "-o", "/dev/full")
    assert code == 1 and "No space left on device" in output and output.count("\n") == 1, output


@pytest.mark.parametrize("port", ["99999", "-1", "0"])
def test_a_port_out_of_range_is_refused(port: str) -> None:
    code, output = run("ui", "--port", port)
    assert code == 2 and "--port" in output, output


# -- token new ----------------------------------------------------------------------------------


def test_a_token_for_an_unknown_tenant_is_not_appended_to_a_file_that_loads(tmp_path: Path) -> None:
    file = tmp_path / "tenants.toml"
    file.write_text("[tenants.acme]\n")
    code, output = run("token", "new", "--tenant", "nope", "--append", str(file))
    assert code == 2 and "nothing appended" in output and "nope" in output, output
    assert file.read_text() == "[tenants.acme]\n"
    code, output = run("token", "new", "--tenant", "acme", "--append", str(file))
    assert code == 0 and output.strip().splitlines()[-1].startswith("stk_"), output
    from stockade.server.tenants import Tenants

    assert [t.tenant for t in Tenants.load(file).tokens.values()] == ["acme"]


def test_a_token_goes_into_a_file_that_did_not_load_before_either_said(tmp_path: Path) -> None:
    file = tmp_path / "tenants.toml"  # missing: being written
    code, output = run("token", "new", "--tenant", "acme", "--append", str(file))
    assert code == 0 and "did not load before" in output, output
    assert 'tenant = "acme"' in file.read_text()


def test_a_role_that_is_no_utf8_or_a_file_that_is_no_utf8_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "tenants.toml"
    file.write_text("[tenants.acme]\n")
    code, output = run(
        "token", "new", "--tenant", "acme", "--role", os.fsdecode(b"\xff"), "--append", str(file)
    )
    assert code == 2 and "role" in output, output
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[tenants.acme]\n\xff")
    code, output = run("token", "new", "--tenant", "acme", "--append", str(bad))
    assert code == 2 and "not UTF-8" in output, output
    assert bad.read_bytes() == b"[tenants.acme]\n\xff"


def test_a_role_is_written_as_one_toml_string(tmp_path: Path) -> None:
    import tomllib

    from stockade.server.tenants import Tenants, new_token

    with pytest.raises(InvalidArgument, match="role"):  # a newline would start another key
        new_token("acme", 'dev"\nadmin = true\n#')
    _, record = new_token("acme", 'dev" # \\ é')
    (token,) = tomllib.loads(Tenants(tenants={}, tokens={}).toml_lines(record))["tokens"]
    assert token["role"] == 'dev" # \\ é'
