"""Tools: plain functions with a JSON schema derived from their signature and docstring.

A tool is declared with ``@tool``; its first parameter may be a ``ToolContext`` (the sandbox,
the run and the call it serves), which is not part of the schema. The attributes
``idempotent``, ``risk`` and ``timeout_s`` are for the runtime controls (retry only what is
idempotent, ask for approval on high risk, bound the call). ``timeout_s`` is enforced: a call
running past it is cancelled and reported as ``ToolTimeout``, and the sandbox it was given
bounds its commands by the same deadline and refuses anything after it. The run's own wall time
bounds every call the same way (``ToolContext.deadline``): a call's deadline is the earlier of
its tool's ``timeout_s`` and the end of the run's ``max_wall_s``, whatever timeout the model asks
a command for.

    @tool(idempotent=True, risk=Risk.LOW)
    def count_lines(ctx: ToolContext, path: str) -> str:
        '''Count the lines of a file.

        Args:
            path: the file, relative to the workspace.
        '''
        return str(len(ctx.sandbox.files.read(path).splitlines()))

A ``Toolset`` is what the agent offers the model. It composes by wrapping, never by flags:
``toolset.filtered(pred)`` keeps some tools, ``toolset.wrapped(wrapper)`` puts a
``ToolWrapper`` around every call (approval, breakers, audit, output filters):

    async def wrapper(ctx, tool, args, call_next):   # args: the validated pydantic model
        ...                                          # may raise, rewrite args, or change the result
        return await call_next(ctx, tool, args)

The first wrapper added is the outermost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import inspect
import json
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, get_type_hints, overload, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, create_model

from stockade.exceptions import ConfigurationError, InvalidArgument, InvalidToolCall, ToolTimeout
from stockade.models.messages import ToolDefinition
from stockade.sandbox.facade import Sandbox
from stockade.tools.deadline import DeadlineInstance, stopping

__all__ = [
    "CallNext",
    "Observable",
    "Outcome",
    "Risk",
    "Tool",
    "ToolContext",
    "ToolWrapper",
    "Toolset",
    "idempotency_key",
    "render",
    "reported_failure",
    "tool",
]


class Risk(enum.StrEnum):
    """How much harm a tool can do; the runtime controls decide what each level needs."""

    LOW = "low"  # reads
    MEDIUM = "medium"  # writes inside the workspace, runs code in the sandbox
    HIGH = "high"  # arbitrary shell


@dataclass(frozen=True, kw_only=True)
class ToolContext:
    """What a tool call may use: the sandbox, and which run, step and call it serves.

    ``bookkeeping`` is the run's own view of the same sandbox, for the records a tool keeps
    for the run (saved outputs, test reports, the baseline of the workspace diff): the
    model's path rules do not apply to it, the sandbox still confines it to the workspace.
    None: ``sandbox`` serves both.
    """

    sandbox: Sandbox
    run_id: str = "adhoc"
    step: int = 0
    call_id: str = "call"
    call_index: int = 0  # the call's place in its model response (the first is 0)
    max_observation_chars: int = 12_000
    bookkeeping: Sandbox | None = None
    # When the run's wall time ends (a ``time.monotonic()`` reading); None: no run bound. The call
    # and its sandbox work are bounded by it as by a tool's ``timeout_s`` (``Tool.invoke``).
    deadline: float | None = None
    # what identifies the run's diff baseline (``workspace_diff.record_baseline``); None: unchecked
    baseline: str | None = None

    @property
    def idempotency_key(self) -> str:
        """Names this call's effect: the same on every attempt of the call (a resumed run that
        runs an idempotent call again passes the same key), so a tool that acts outside the
        sandbox (a payment, a push, an email) can send it along and let the other side
        deduplicate. The run store's ledger is keyed by it too."""
        return idempotency_key(self.run_id, self.step, self.call_index, self.call_id)

    @property
    def records(self) -> Sandbox:
        """The sandbox for the run's own records (see ``bookkeeping``)."""
        return self.bookkeeping if self.bookkeeping is not None else self.sandbox


def idempotency_key(run_id: str, step: int, index: int, call_id: str) -> str:
    """The key of the ``index``-th call (from 0) of step ``step``'s model response in run ``run_id``.

    A SHA-256 of the parts as a JSON list, so that no two calls share one: run ids and call ids
    (the model's choice) may hold any character, a model may give two calls of one response the
    same id, and the run store keys its ledger by this across all runs. Its length is fixed, for
    services that bound theirs. Keys of earlier versions (``run_id:step:call_id``) always hold a
    ':' and these never do, so the two never meet in one store."""
    parts = json.dumps([run_id, step, index, call_id], separators=(",", ":"))
    return hashlib.sha256(parts.encode()).hexdigest()


@runtime_checkable
class Observable(Protocol):
    """A tool result that knows how to show itself to the model."""

    def observation(self) -> str: ...


@runtime_checkable
class Outcome(Protocol):
    """A tool result that says whether the action did what it was asked: a command that exited
    0 (``Ran``, ``CommandResult``), code that did not raise (``CodeRan``), a test run that passed
    (``TestReport``). The runtime controls count ``ok`` False as a failure, as an error."""

    @property
    def ok(self) -> bool: ...


def reported_failure(value: object) -> bool:
    """Whether a tool's result reports that its action failed (``Outcome.ok`` is False)."""
    return isinstance(value, Outcome) and value.ok is False


def render(value: object) -> str:
    """The text the model sees for a tool's return value."""
    if isinstance(value, str):
        return value
    if isinstance(value, Observable):
        return value.observation()
    if isinstance(value, BaseModel):
        return value.model_dump_json(indent=2)
    if value is None:
        return "ok"
    return str(value)


_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into the description and per-argument text."""
    text = inspect.cleandoc(doc)
    head, _, rest = text.partition("\nArgs:\n")
    params: dict[str, str] = {}
    current = ""
    for line in rest.splitlines():
        if line and not line[0].isspace():
            break  # the next section (Returns:, Raises:, ...)
        match = _ARG_LINE.match(line)
        if match and (len(line) - len(line.lstrip())) <= 4:
            current = match.group(1)
            params[current] = match.group(2).strip()
        elif current and line.strip():
            params[current] += " " + line.strip()
    return head.strip(), params


def _strip_titles(schema: dict[str, Any]) -> dict[str, Any]:
    """pydantic's ``title`` keys are noise in a prompt; drop them everywhere."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if isinstance(value, dict):
            if key == "properties":
                out[key] = {k: _strip_titles(v) for k, v in value.items()}
            else:
                out[key] = _strip_titles(value)
        elif isinstance(value, list):
            out[key] = [_strip_titles(v) if isinstance(v, dict) else v for v in value]
        else:
            out[key] = value
    return out


class _ArgsBase(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True, kw_only=True)
class Tool:
    """One callable tool. Build it with ``@tool`` (or ``Tool.from_function``)."""

    name: str
    description: str
    function: Callable[..., object]
    args_model: type[BaseModel]
    takes_context: bool
    idempotent: bool = False
    risk: Risk = Risk.MEDIUM
    timeout_s: float | None = None
    parameters: dict[str, JsonValue] = field(default_factory=dict)

    @classmethod
    def from_function(
        cls,
        function: Callable[..., object],
        *,
        name: str | None = None,
        idempotent: bool = False,
        risk: Risk = Risk.MEDIUM,
        timeout_s: float | None = None,
    ) -> Tool:
        description, arg_docs = _parse_docstring(function.__doc__ or "")
        hints = get_type_hints(function)
        fields: dict[str, Any] = {}
        takes_context = False
        for index, param in enumerate(inspect.signature(function).parameters.values()):
            annotation = hints.get(param.name, Any)
            if index == 0 and annotation is ToolContext:
                takes_context = True
                continue
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ConfigurationError(f"tool {function.__name__}: *args/**kwargs cannot have a schema")
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (annotation, Field(default, description=arg_docs.get(param.name)))
        tool_name = name or function.__name__
        model = create_model(f"{tool_name}_args", __base__=_ArgsBase, **fields)
        return cls(
            name=tool_name,
            description=description or tool_name,
            function=function,
            args_model=model,
            takes_context=takes_context,
            idempotent=idempotent,
            risk=risk,
            timeout_s=timeout_s,
            parameters=_strip_titles(model.model_json_schema()),
        )

    def definition(self) -> ToolDefinition:
        return ToolDefinition(name=self.name, description=self.description, parameters=self.parameters)

    def validate(self, args: Mapping[str, JsonValue]) -> BaseModel:
        """Check the model's arguments against the schema; ``InvalidToolCall`` says what is wrong."""
        try:
            return self.args_model.model_validate(dict(args))
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}" for e in err.errors()
            )
            raise InvalidToolCall(f"invalid arguments for {self.name}: {problems}") from None

    async def invoke(self, ctx: ToolContext, args: BaseModel) -> object:
        """Run the function: coroutines on the loop, blocking functions in a worker thread.

        With ``timeout_s``, or a run deadline in ``ctx.deadline``, the call is cancelled when it
        runs past the earlier of the two (``ToolTimeout``), and its sandbox work is bounded by
        the same deadline (``DeadlineInstance``): each command gets at most the time left."""
        now = time.monotonic()
        own = None if self.timeout_s is None else now + self.timeout_s
        if own is None and ctx.deadline is None:
            return await self._run(ctx, args, None, "")
        by_run = ctx.deadline is not None and (own is None or ctx.deadline < own)
        deadline = ctx.deadline if by_run and ctx.deadline is not None else own
        assert deadline is not None
        timeout = max(0.0, deadline - now)
        limit = "the run's wall time (max_wall_s)" if by_run else f"its {timeout:g} s timeout"

        def bounded(sandbox: Sandbox) -> Sandbox:
            return Sandbox(
                DeadlineInstance(
                    sandbox.instance, deadline=deadline, tool=self.name, timeout_s=timeout, limit=limit
                )
            )

        call_ctx = dataclasses.replace(
            ctx,
            sandbox=bounded(ctx.sandbox),
            bookkeeping=bounded(ctx.bookkeeping) if ctx.bookkeeping is not None else None,
        )
        try:
            async with asyncio.timeout(timeout) as scope:
                return await self._run(call_ctx, args, deadline, limit)
        except TimeoutError:
            if not scope.expired():
                raise  # the tool's own TimeoutError, not ours
            raise ToolTimeout(
                f"{self.name} did not finish within {limit} and was stopped; "
                "its sandbox commands were bounded by the same deadline",
                tool=self.name,
                timeout_s=timeout,
            ) from None

    async def _run(self, ctx: ToolContext, args: BaseModel, deadline: float | None, limit: str) -> object:
        values = {name: getattr(args, name) for name in type(args).model_fields}
        prefix = (ctx,) if self.takes_context else ()
        if inspect.iscoroutinefunction(self.function):
            return await self.function(*prefix, **values)
        # The worker thread cannot be stopped from here: once this stops waiting for it (the
        # deadline, a cancel), its ``checkpoint()`` calls raise, and it ends at the next one.
        given_up = threading.Event()

        def check() -> None:
            late = deadline is not None and time.monotonic() >= deadline
            if late or given_up.is_set():
                why = f"it ran past {limit}" if late else "its call was given up"
                raise ToolTimeout(
                    f"{self.name} was stopped on the host: {why}",
                    tool=self.name,
                    timeout_s=self.timeout_s or 0.0,
                )

        with stopping(check):
            try:
                return await asyncio.to_thread(self.function, *prefix, **values)
            finally:
                given_up.set()


@overload
def tool(function: Callable[..., object], /) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    idempotent: bool = False,
    risk: Risk = Risk.MEDIUM,
    timeout_s: float | None = None,
) -> Callable[[Callable[..., object]], Tool]: ...


def tool(
    function: Callable[..., object] | None = None,
    /,
    *,
    name: str | None = None,
    idempotent: bool = False,
    risk: Risk = Risk.MEDIUM,
    timeout_s: float | None = None,
) -> Tool | Callable[[Callable[..., object]], Tool]:
    """Declare a tool: ``@tool`` or ``@tool(idempotent=True, risk=Risk.LOW, timeout_s=10)``."""

    def build(fn: Callable[..., object]) -> Tool:
        return Tool.from_function(fn, name=name, idempotent=idempotent, risk=risk, timeout_s=timeout_s)

    return build(function) if function is not None else build


CallNext = Callable[[ToolContext, Tool, BaseModel], Awaitable[object]]
ToolWrapper = Callable[[ToolContext, Tool, BaseModel, CallNext], Awaitable[object]]


async def _invoke(ctx: ToolContext, tool: Tool, args: BaseModel) -> object:
    return await tool.invoke(ctx, args)


class Toolset:
    """An immutable set of tools plus the wrappers every call goes through."""

    def __init__(self, tools: Iterable[Tool], *, wrappers: tuple[ToolWrapper, ...] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Iterable):
            raise InvalidArgument(
                f"tools must be an iterable of Tool, got {type(tools).__name__}",
                argument="tools",
                fix="give a list of tools (the @tool decorator makes one of a function)",
            )
        for t in tools:
            if not isinstance(t, Tool):
                raise InvalidArgument(
                    f"tools holds {type(t).__name__}, which is no Tool",
                    argument="tools",
                    fix="make one of a function with the @tool decorator or Tool.from_function",
                )
            if t.name in self._tools:
                raise ConfigurationError(f"two tools are named {t.name!r}")
            self._tools[t.name] = t
        if not isinstance(wrappers, tuple) or not all(callable(w) for w in wrappers):
            raise InvalidArgument(
                f"wrappers must be a tuple of callables, got {type(wrappers).__name__}",
                argument="wrappers",
                fix="give wrappers=(my_wrapper,) or leave it out",
            )
        self._wrappers = wrappers

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def definitions(self) -> tuple[ToolDefinition, ...]:
        return tuple(t.definition() for t in self._tools.values())

    def filtered(self, keep: Callable[[Tool], bool]) -> Toolset:
        return Toolset([t for t in self._tools.values() if keep(t)], wrappers=self._wrappers)

    def including(self, *tools: Tool) -> Toolset:
        return Toolset([*self._tools.values(), *tools], wrappers=self._wrappers)

    def wrapped(self, wrapper: ToolWrapper) -> Toolset:
        return Toolset(self._tools.values(), wrappers=(*self._wrappers, wrapper))

    async def call(self, ctx: ToolContext, tool: Tool, args: BaseModel) -> object:
        """Call ``tool`` through every wrapper, the first added outermost."""
        call_next: CallNext = _invoke
        for wrapper in reversed(self._wrappers):
            call_next = _bind(wrapper, call_next)
        return await call_next(ctx, tool, args)


def _bind(wrapper: ToolWrapper, inner: CallNext) -> CallNext:
    async def call(ctx: ToolContext, tool: Tool, args: BaseModel) -> object:
        return await wrapper(ctx, tool, args, inner)

    return call
