"""The tools of an MCP session's run, as the session wraps them: a call its client cancels is
cut, and the built-in read_file, list_files and git_diff serve resources.

Both find the call in flight through the session whose loop runs on this thread (``running``):
a tool is one for every session of the agent, and its context names only the call's id. Apart
from the session (``mcp_session``), which sets ``running`` and wraps its agent's tools with
these; the session is named here for its type alone, so this module never imports it back.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from stockade import exceptions as exc
from stockade.sandbox.base import Instance, OpResult, OutputSink, WrapperInstance
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.ops import Op
from stockade.server.mcp_outcomes import ClientCall
from stockade.tools import builtin
from stockade.tools.base import CallNext, Tool, ToolContext, Toolset
from stockade.tools.deadline import stopping
from stockade.tools.workspace_diff import is_ignored, snapshot, workspace_diff

if TYPE_CHECKING:
    from stockade.server.mcp_session import McpSession

__all__ = ["RESOURCE_BYTES", "cancellable", "running", "serving_resources"]

# The session whose loop runs on this thread (its asyncio.run copies the context).
running: contextvars.ContextVar[McpSession | None] = contextvars.ContextVar(
    "stockade_mcp_session", default=None
)


def _cancelled(ctx: ToolContext) -> ClientCall | None:
    """The call ``ctx`` serves, if its client cancelled it."""
    session = running.get()
    current = session._current if session is not None else None
    if current is None or current.call.id != ctx.call_id or not current.cancelled:
        return None
    return current


class _CancellableInstance(WrapperInstance):
    """A call's sandbox that runs nothing more once its client cancelled the call."""

    def __init__(self, wrapped: Instance, ctx: ToolContext) -> None:
        super().__init__(wrapped)
        self._ctx = ctx

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        _stop_if_cancelled(self._ctx)
        return self.wrapped.handle(op, sink)


def _stop_if_cancelled(ctx: ToolContext) -> None:
    if _cancelled(ctx) is not None:
        raise exc.CallCancelled(
            f"the MCP client cancelled this call ({ctx.call_id}); its sandbox work was cut"
        )


async def cancellable(ctx: ToolContext, tool: Tool, args: BaseModel, call_next: CallNext) -> object:
    """A tool call its client may cancel: its sandbox ops are refused once it is, its host work
    stops at its next checkpoint, and whatever it returned from the cut is ``CallCancelled``,
    so the run's record (and the trail) says the client cancelled it, not that it ran."""

    def within(sandbox: Sandbox) -> Sandbox:
        return Sandbox(_CancellableInstance(sandbox.instance, ctx))

    guarded = dataclasses.replace(
        ctx,
        sandbox=within(ctx.sandbox),
        bookkeeping=within(ctx.bookkeeping) if ctx.bookkeeping is not None else None,
    )
    _stop_if_cancelled(ctx)
    with stopping(functools.partial(_stop_if_cancelled, ctx)):
        value = await call_next(guarded, tool, args)
    _stop_if_cancelled(ctx)
    return value


def _serving(ctx: ToolContext) -> ClientCall | None:
    """The resource read this tool call stands for, if it is one (see ``McpSession.call``)."""
    session = running.get()
    current = session._current if session is not None else None
    if current is None or not current.resource or current.call.id != ctx.call_id:
        return None
    return current


# The most of a file a resource read serves (a model reads the rest through read_file).
RESOURCE_BYTES = 1 << 20


# The tools a resource is read through, as calls of the same names, arguments and rules: what a
# call returns is the tool's own result, or, standing for a resource read, the content itself,
# read through the call's sandbox (inside its guards and limits: an approval of the call holds).
def _read_file(ctx: ToolContext, path: str, offset: int = 0, limit: int = 400) -> str:
    served = _serving(ctx)
    if served is None:
        return str(builtin.read_file.function(ctx, path, offset, limit))
    # At most RESOURCE_BYTES of it: a whole file (up to the 256 MiB a read takes) became one
    # JSON message, and the server held ~13 times the file while it made it (1.6 GB for 128 MiB)
    data = ctx.sandbox.files.read_range(path, 0, RESOURCE_BYTES + 1)
    text = data[:RESOURCE_BYTES].decode("utf-8", errors="replace")
    if len(data) > RESOURCE_BYTES:
        text += f"\n[cut at {RESOURCE_BYTES:,} bytes: read_file reads the rest, a range of lines at a time]"
    served.content = text
    return served.content


def _list_files(ctx: ToolContext, path: str = "", depth: int = 2) -> str:
    served = _serving(ctx)
    if served is None:
        return str(builtin.list_files.function(ctx, path, depth))
    # a JSON list, not one a line: a name may hold a newline (or \r, \u2028, ...), and split it
    # made resources of files that do not exist
    # the model's view, as list_files shows it: no VCS, caches, dependencies or build output
    files = snapshot(ctx.sandbox, deadline=ctx.deadline)
    served.content = json.dumps(sorted(p for p in files if not is_ignored(p)))
    return served.content


def _git_diff(ctx: ToolContext) -> str:
    served = _serving(ctx)
    if served is None:
        return str(builtin.git_diff.function(ctx))
    session = running.get()
    assert session is not None
    keep = session.owner.agent.engine.hands_back
    served.content = workspace_diff(ctx.records, keep, baseline=ctx.baseline)
    return served.content


def serving_resources(tools: Toolset) -> Toolset:
    """``tools`` with the built-in read_file, list_files and git_diff able to serve resources."""
    serving = {"read_file": _read_file, "list_files": _list_files, "git_diff": _git_diff}
    own = {name: getattr(builtin, name) for name in serving}
    swapped = [
        dataclasses.replace(t, function=serving[t.name]) if t.name in serving and t is own[t.name] else t
        for t in tools
    ]
    return tools.filtered(lambda _: False).including(*swapped)  # in their order, wrappers kept
