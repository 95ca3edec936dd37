"""What an ``Agent`` is made of: its model, tools, prompt, limits, guards, observers,
checkpointer, acceptance check and keeper, each checked when the agent is built.

``AgentSettings`` is the part of ``Agent`` a run reads while it runs; it is apart from
``Agent`` (``loop``), which starts and resumes runs, so that the run's own modules (``run``
and the parts below it) depend on the settings, not on what starts them. ``Guard`` and
``GuardContext`` are here too: a guard is one of the settings, and the policy and runtime
layers write guards without the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stockade._checks import check_acceptance, check_instance, check_text, check_timeout
from stockade.agent.checkpoint import Checkpointer, DurableCheckpointer, SandboxKeeper
from stockade.agent.events import Observer
from stockade.agent.limits import RunLimits
from stockade.agent.state import RunState
from stockade.exceptions import InvalidArgument
from stockade.models.base import Model, resolve_model
from stockade.models.messages import ToolCall
from stockade.models.pricing import DEFAULT_PRICES, Price
from stockade.sandbox.facade import Sandbox
from stockade.tools.base import Tool, Toolset
from stockade.tools.builtin import default_toolset

__all__ = ["DEFAULT_SYSTEM_PROMPT", "AgentSettings", "Guard", "GuardContext"]

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful software engineer working in a sandboxed workspace. Use the tools to "
    "inspect the code, change it and run its tests. Prefer small, precise edits (apply_patch with a "
    "unified diff). When the task is done, reply with a short summary and no tool call."
)


def _callables(value: object, *, argument: str) -> tuple[Callable[..., Any], ...]:
    """A list or tuple of functions (guards, observers), each checked now, not at its first call."""
    if not isinstance(value, list | tuple) or not all(callable(item) for item in value):
        raise InvalidArgument(
            f"{argument} must be a list of callables, got {type(value).__name__}",
            argument=argument,
            fix=f"give a list of functions, e.g. {argument}=[my_{argument[:-1]}]",
        )
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class GuardContext:
    """What a guard sees besides the call: the run, the step, the tool and the sandbox."""

    run_id: str
    step: int
    tool: Tool
    sandbox: Sandbox
    state: RunState  # read it, never change it


Guard = Callable[[GuardContext, ToolCall], ToolCall]


class AgentSettings:
    """An agent's settings, checked: what a run reads of its agent (``Agent`` adds running)."""

    def __init__(
        self,
        model: str | Model,
        *,
        tools: Toolset | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        limits: RunLimits | None = None,
        guards: Sequence[Guard] = (),
        observers: Sequence[Observer] = (),
        checkpointer: Checkpointer | None = None,
        prices: Mapping[str, Price] = DEFAULT_PRICES,
        clock: Callable[[], float] = time.monotonic,
        check: str | None = None,
        check_timeout_s: float | None = None,
        keeper: SandboxKeeper | None = None,
        hands_back: Callable[[str], bool] | None = None,
    ) -> None:
        self.check = check_acceptance(check) if check is not None else None
        self.hands_back = hands_back  # which changed paths the run's diff may show the host
        self.check_timeout_s = check_timeout(check_timeout_s, argument="check_timeout_s")
        self.model = resolve_model(model)
        if tools is not None:
            check_instance(tools, Toolset, argument="tools", fix="give Toolset([...]) or leave it out")
        if limits is not None:
            check_instance(limits, RunLimits, argument="limits", fix="give RunLimits(max_steps=...)")
        self.tools = tools if tools is not None else default_toolset()
        self.system_prompt = check_text(system_prompt, argument="system_prompt", nul=True)
        self.limits = limits or RunLimits()
        self.guards = _callables(guards, argument="guards")
        self.observers = _callables(observers, argument="observers")
        self.checkpointer = checkpointer
        self.prices = prices
        self.clock = clock
        self.keeper = keeper
        self._definitions = self.tools.definitions()

    @property
    def _durable(self) -> DurableCheckpointer | None:
        return self.checkpointer if isinstance(self.checkpointer, DurableCheckpointer) else None
