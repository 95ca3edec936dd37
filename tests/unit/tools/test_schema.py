"""Tool schemas come from signatures and docstrings; toolsets compose by filtering and wrapping."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from stockade import Sandbox
from stockade.exceptions import InvalidToolCall
from stockade.testing import FakeBackend
from stockade.tools import (
    CallNext,
    Risk,
    Tool,
    ToolContext,
    Toolset,
    default_toolset,
    idempotency_key,
    shell,
    tool,
)


@tool(idempotent=True, risk=Risk.LOW, timeout_s=5)
def count_lines(ctx: ToolContext, path: str, skip_blank: bool = False) -> str:
    """Count the lines of a file.

    Args:
        path: the file, relative to the workspace.
        skip_blank: do not count empty lines.
    """
    lines = ctx.sandbox.files.read(path).splitlines()
    return str(len([ln for ln in lines if ln.strip()] if skip_blank else lines))


def test_the_schema_comes_from_the_signature_and_docstring() -> None:
    assert count_lines.name == "count_lines"
    assert count_lines.description == "Count the lines of a file."
    assert count_lines.parameters == {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "path": {"type": "string", "description": "the file, relative to the workspace."},
            "skip_blank": {"type": "boolean", "default": False, "description": "do not count empty lines."},
        },
        "required": ["path"],
    }
    assert (count_lines.idempotent, count_lines.risk, count_lines.timeout_s) == (True, Risk.LOW, 5)


def test_arguments_are_validated_with_a_message_the_model_can_act_on() -> None:
    with pytest.raises(InvalidToolCall, match=r"invalid arguments for count_lines: path: Field required"):
        count_lines.validate({})
    with pytest.raises(InvalidToolCall, match="colour: Extra inputs are not permitted"):
        count_lines.validate({"path": "a", "colour": "red"})


async def test_a_tool_runs_against_the_sandbox_in_its_context() -> None:
    sbx = Sandbox.create(backend=FakeBackend())
    sbx.files.write("a.txt", "one\n\nthree\n")
    ctx = ToolContext(sandbox=sbx)
    args = count_lines.validate({"path": "a.txt", "skip_blank": True})
    assert await Toolset([count_lines]).call(ctx, count_lines, args) == "2"


async def test_wrappers_see_every_call_and_the_first_added_is_outermost() -> None:
    seen: list[str] = []

    def recorder(label: str):  # type: ignore[no-untyped-def]
        async def wrapper(ctx: ToolContext, t: Tool, args: BaseModel, call_next: CallNext) -> object:
            seen.append(f"{label}:{t.name}")
            return await call_next(ctx, t, args)

        return wrapper

    toolset = Toolset([count_lines]).wrapped(recorder("outer")).wrapped(recorder("inner"))
    sbx = Sandbox.create(backend=FakeBackend())
    sbx.files.write("a.txt", "x\n")
    await toolset.call(ToolContext(sandbox=sbx), count_lines, count_lines.validate({"path": "a.txt"}))
    assert seen == ["outer:count_lines", "inner:count_lines"]


def test_the_default_toolset_is_narrow_and_shell_is_opt_in() -> None:
    tools = default_toolset()
    assert set(tools.names) == {
        "run_code",
        "run_tests",
        "read_file",
        "write_file",
        "apply_patch",
        "list_files",
        "git_diff",
    }
    assert "shell" not in tools
    assert "shell" in tools.including(shell)
    assert shell.risk == Risk.HIGH
    assert tools.filtered(lambda t: t.risk == Risk.LOW).names == ("read_file", "list_files", "git_diff")


def test_an_idempotency_key_names_one_call_of_one_run() -> None:
    """Any characters in run and call ids, and two calls of one response with one id."""
    keys = {
        idempotency_key("a:1", 1, 0, "x"),
        idempotency_key("a", 1, 0, "1:x"),
        idempotency_key("a", 1, 1, "1:x"),
        idempotency_key("a", 11, 0, "x"),
        idempotency_key("a:1", 1, 0, "x:"),
    }
    assert len(keys) == 5 and all(":" not in k for k in keys)  # never an earlier version's key
    with Sandbox.create(backend=FakeBackend()) as sbx:
        ctx = ToolContext(sandbox=sbx, run_id="a", step=1, call_id="x", call_index=2)
        assert ctx.idempotency_key == idempotency_key("a", 1, 2, "x")
