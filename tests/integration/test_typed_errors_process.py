"""On a real process-tier sandbox, a wrong value never reaches the supervisor: it used to be
``str()``-ed on the way (``mode="644"`` made 0o204, ``["echo", 1]`` ran), or fail inside the
wire format as a ``TypeError``, or come back as a ``ProtocolError`` blaming the sandbox."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stockade import InvalidArgument, Sandbox
from tests.conftest import require_tier


@pytest.fixture(scope="module")
def sbx() -> Iterator[Sandbox]:
    require_tier("process")
    with Sandbox.create("process") as sandbox:
        yield sandbox


CASES: dict[str, tuple[Callable[[Sandbox], object], str]] = {
    "argv of bytes": (lambda s: s.commands.run([b"echo"]), "cmd"),  # type: ignore[list-item]
    "argv of a number": (lambda s: s.commands.run(["echo", 1]), "cmd"),  # type: ignore[list-item]
    "cwd of a Path": (lambda s: s.commands.run("pwd", cwd=Path("/tmp")), "cwd"),  # type: ignore[arg-type]
    "cwd of a number": (lambda s: s.commands.run("pwd", cwd=5), "cwd"),  # type: ignore[arg-type]
    "stdin of a number": (lambda s: s.commands.run("cat", stdin=5), "stdin"),  # type: ignore[arg-type]
    "data of None": (lambda s: s.files.write("f", None), "data"),  # type: ignore[arg-type]
    "mode of None": (lambda s: s.files.write("f", "x", mode=None), "mode"),  # type: ignore[arg-type]
    "mode of text": (lambda s: s.files.write("f", "x", mode="644"), "mode"),  # type: ignore[arg-type]
    "mode of -1": (lambda s: s.files.write("f", "x", mode=-1), "mode"),
    "depth of None": (lambda s: s.files.list("", depth=None), "depth"),  # type: ignore[arg-type]
    "a lone surrogate in code": (lambda s: s.run_code("echo \udc80", "bash"), "code"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrong_value_is_refused_before_the_supervisor_and_the_sandbox_goes_on(
    sbx: Sandbox, case: str
) -> None:
    call, argument = CASES[case]
    with pytest.raises(InvalidArgument) as caught:
        call(sbx)
    assert caught.value.argument == argument
    assert sbx.alive and not sbx.files.exists("f")


def test_the_values_the_calls_take_still_do_what_they_say(sbx: Sandbox) -> None:
    assert sbx.commands.run(["echo", "hi"], cwd="/tmp", stdin=b"").stdout == "hi\n"
    assert sbx.files.write("g", "x", mode=0o600).mode & 0o777 == 0o600
    assert [e.name for e in sbx.files.list("", depth=1)] == ["g"]
    sbx.files.remove("g")
