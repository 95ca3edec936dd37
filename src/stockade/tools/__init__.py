"""What the model may call. Schemas come from signatures and docstrings (see ``base``).

Extension points other layers code against:

- ``@tool(idempotent=..., risk=..., timeout_s=...)`` declares a tool from a function;
- ``Toolset.filtered(pred)`` / ``.including(*tools)`` / ``.wrapped(wrapper)`` compose toolsets;
  a ``ToolWrapper`` is ``async (ctx, tool, args, call_next) -> result`` around every call;
- ``bound(ctx, text)`` is how observations are kept short (the full text goes to the workspace).
"""

from stockade.tools.base import (
    CallNext,
    Observable,
    Outcome,
    Risk,
    Tool,
    ToolContext,
    Toolset,
    ToolWrapper,
    idempotency_key,
    render,
    reported_failure,
    tool,
)
from stockade.tools.builtin import (
    apply_patch,
    default_toolset,
    git_diff,
    list_files,
    read_file,
    run_code,
    run_tests,
    shell,
    write_file,
)
from stockade.tools.observations import OUTPUT_DIR, Bounded, bound
from stockade.tools.testreport import TestFailure, TestReport

__all__ = [
    "OUTPUT_DIR",
    "Bounded",
    "CallNext",
    "Observable",
    "Outcome",
    "Risk",
    "TestFailure",
    "TestReport",
    "Tool",
    "ToolContext",
    "ToolWrapper",
    "Toolset",
    "apply_patch",
    "bound",
    "default_toolset",
    "git_diff",
    "idempotency_key",
    "list_files",
    "read_file",
    "render",
    "reported_failure",
    "run_code",
    "run_tests",
    "shell",
    "tool",
    "write_file",
]
