"""Replay a recorded run: the same model responses, a fresh sandbox, and what came out different.

    state = store.load(run_id)
    with Sandbox.create(workspace="project/") as sbx:        # the run's starting workspace
        report = await replay(state, sandbox=sbx)
    for d in report.differences: print(d.step, d.tool, d.recorded, d.replayed)

The model is a ``ScriptedModel`` playing the recorded responses in order, so every tool call
is the one the original run made; only the observations can differ. A difference means the
environment answered differently: a flaky test, a time-dependent command, a workspace that
was not the same. Durations and memory addresses are masked before comparing (``normalise``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from stockade.agent.loop import Agent, RunLimits
from stockade.agent.state import RunState, RunStatus, StepRecord, ToolCallRecord
from stockade.models.scripted import ScriptedModel
from stockade.sandbox.facade import Sandbox
from stockade.tools.base import Toolset
from stockade.tools.builtin import default_toolset, shell

__all__ = ["Difference", "ReplayReport", "normalise", "recorded_model", "replay"]

_NOISE = (
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms|µs|us|ns|sec|seconds)\b"), "<duration>"),
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "<address>"),
)


def normalise(text: str) -> str:
    """Mask what differs between two honest runs of the same thing (timings, addresses)."""
    for pattern, mask in _NOISE:
        text = pattern.sub(mask, text)
    return text


@dataclass(frozen=True, kw_only=True)
class Difference:
    """One tool call whose outcome changed. ``what``: observation, error, missing or extra."""

    step: int
    call_id: str
    tool: str
    what: str
    recorded: str
    replayed: str


@dataclass(frozen=True, kw_only=True)
class ReplayReport:
    run_id: str
    recorded_status: RunStatus
    replayed_status: RunStatus
    compared: int  # tool calls compared
    differences: tuple[Difference, ...]
    replayed: RunState

    @property
    def ok(self) -> bool:
        return not self.differences


def _steps(state: RunState) -> list[StepRecord]:
    return [*state.steps, *([state.current] if state.current is not None else [])]


def recorded_model(state: RunState) -> ScriptedModel:
    """A model that gives the recorded responses, in order."""
    return ScriptedModel([step.response for step in _steps(state)], name=state.model_name)


def _tools_for(state: RunState) -> Toolset:
    tools = default_toolset()
    used = {r.call.name for step in _steps(state) for r in step.tool_calls}
    return tools.including(shell) if "shell" in used and "shell" not in tools else tools


def _compare(
    step: int, old: ToolCallRecord | None, new: ToolCallRecord | None, clean: Callable[[str], str]
) -> Difference | None:
    if old is None and new is None:
        return None
    if old is None or new is None:
        present = old or new
        assert present is not None
        return Difference(
            step=step,
            call_id=present.call.id,
            tool=present.call.name,
            what="extra" if old is None else "missing",
            recorded="" if old is None else old.observation,
            replayed="" if new is None else new.observation,
        )
    if old.is_error != new.is_error or old.error_type != new.error_type:
        what = "error"
    elif clean(old.observation) != clean(new.observation):
        what = "observation"
    else:
        return None
    return Difference(
        step=step,
        call_id=old.call.id,
        tool=old.call.name,
        what=what,
        recorded=old.observation,
        replayed=new.observation,
    )


async def replay(
    state: RunState,
    *,
    sandbox: Sandbox,
    tools: Toolset | None = None,
    clean: Callable[[str], str] = normalise,
) -> ReplayReport:
    """Run the recorded responses of ``state`` again in ``sandbox`` and compare observations.

    ``tools`` defaults to the built-in tools (with ``shell`` if the run used it); a run that
    used tools of its own needs them passed here.
    """
    recorded = _steps(state)
    agent = Agent(
        recorded_model(state),
        tools=tools if tools is not None else _tools_for(state),
        system_prompt=state.system,
        limits=RunLimits(max_steps=max(1, len(recorded))),
    )
    result = await agent.run(state.task, sandbox=sandbox, run_id=f"{state.run_id}-replay")
    replayed = _steps(result.state)
    differences = []
    compared = 0
    for index in range(max(len(recorded), len(replayed))):
        old_calls = recorded[index].tool_calls if index < len(recorded) else ()
        new_calls = replayed[index].tool_calls if index < len(replayed) else ()
        for k in range(max(len(old_calls), len(new_calls))):
            old = old_calls[k] if k < len(old_calls) else None
            new = new_calls[k] if k < len(new_calls) else None
            compared += 1
            difference = _compare(index + 1, old, new, clean)
            if difference is not None:
                differences.append(difference)
    return ReplayReport(
        run_id=state.run_id,
        recorded_status=state.status,
        replayed_status=result.status,
        compared=compared,
        differences=tuple(differences),
        replayed=result.state,
    )
