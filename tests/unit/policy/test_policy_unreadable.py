"""A policy file that cannot be read as one is a ``PolicyFileError`` (or ``InvalidArgument`` for
a call that passed no text), never a parser's own exception: the service reads its tenants'
policies with the same loader, and ``stockade policy check`` says what is wrong without a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade import exceptions as exc
from stockade.cli.main import app
from stockade.policy.load import load_policy, parse_policy

# As many levels as the interpreter's recursion limit: the parsers recurse at least a frame a
# level, so they overflow it. No more: PyYAML's scanner takes time quadratic in the open
# brackets (11 s at 2,000 on a busy CI host).
DEPTH = sys.getrecursionlimit()
UNREADABLE = {
    "not-utf8.toml": (b'version = 1\n[commands]\ndeny = ["\xff"]\n', "is not UTF-8"),
    "deep.toml": (b"x = " + b"[" * DEPTH + b"]" * DEPTH, "too deeply"),
    "deep.yaml": (b"a: " + b"[" * DEPTH, "too deeply"),
}


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_a_file_no_parser_can_read_is_a_policy_error(tmp_path: Path, name: str) -> None:
    content, says = UNREADABLE[name]
    (tmp_path / name).write_bytes(content)
    with pytest.raises(exc.PolicyFileError, match=says) as caught:
        load_policy(tmp_path / name)
    assert caught.value.problems and name in caught.value.problems[0]

    checked = CliRunner().invoke(app, ["policy", "check", str(tmp_path / name)])
    assert checked.exit_code != 0 and not isinstance(checked.exception, AssertionError)
    assert "Traceback" not in checked.output and says in checked.output


@pytest.mark.parametrize("text", [b"", None, 5])
def test_a_policy_given_as_anything_but_text_is_refused(text: object) -> None:
    with pytest.raises(exc.InvalidArgument) as caught:
        parse_policy(text)  # type: ignore[arg-type]
    assert caught.value.argument == "text" and "decode" in caught.value.fix


@pytest.mark.parametrize("path", ["a\x00.toml", 5, b"policy.toml"])
def test_a_path_that_names_no_file_is_refused(path: object) -> None:
    with pytest.raises(exc.InvalidArgument) as caught:
        load_policy(path)  # type: ignore[arg-type]
    assert caught.value.argument == "path"
