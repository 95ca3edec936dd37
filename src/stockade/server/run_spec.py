"""What a run's spec makes of its agent's parts: its model (a provider's, or the turns a
request scripts), its budgets and its tools. Apart from the runner because a submission asks
the same of a spec before it queues the run (``server/runs.py``), so that no run is queued
only to fail at its start, and it needs none of the runner's state.
"""

from __future__ import annotations

import importlib

from pydantic import TypeAdapter, ValidationError

from stockade import exceptions as exc
from stockade.agent import RunLimits
from stockade.models.base import Model, resolve_model
from stockade.models.messages import ModelResponse, ToolCall
from stockade.models.scripted import ScriptedModel
from stockade.server.schemas import RunSubmit
from stockade.tools.base import Toolset
from stockade.tools.builtin import default_toolset

__all__ = ["build_model", "load_toolset", "run_limits", "scripted_model"]

_TURNS: TypeAdapter[list[str | ToolCall | list[ToolCall] | ModelResponse]] = TypeAdapter(
    list[str | ToolCall | list[ToolCall] | ModelResponse]
)


def scripted_model(turns: list[object]) -> ScriptedModel:
    """A scripted model from the turns a request carries (never a file of the server's)."""
    try:
        parsed = _TURNS.validate_python(turns)
    except ValidationError as error:
        first = error.errors()[0]
        raise exc.InvalidArgument(
            f"scripted turn {'.'.join(str(p) for p in first['loc'])}: {first['msg']}",
            argument="scripted",
            fix='give a list of turns: "answer", {"name": TOOL, "args": {...}}, or a list of those',
        ) from None
    return ScriptedModel(parsed, name="scripted")


def run_limits(spec: RunSubmit) -> RunLimits:
    """The run's budgets (``InvalidArgument`` for one ``RunLimits`` refuses): asked at
    submission too, so that no run is queued only to fail at its start."""
    limits = spec.limits
    return RunLimits(
        max_steps=limits.max_steps, max_wall_s=limits.max_wall_s,
        max_tokens=limits.max_tokens, max_cost_usd=limits.max_cost_usd,
        max_pending_approvals=limits.max_pending_approvals,
    )  # fmt: skip


def build_model(spec: RunSubmit) -> Model:
    if spec.scripted is not None:
        return scripted_model(list(spec.scripted))
    if spec.model is None:
        raise exc.InvalidArgument("no model", argument="model", fix="give model (PROVIDER:NAME) or scripted")
    if spec.model.startswith("scripted:"):
        raise exc.InvalidArgument(
            "scripted:FILE names a file of the server's",
            argument="model",
            fix="send the turns themselves in `scripted`",
        )
    return resolve_model(spec.model)


def load_toolset(reference: str | None) -> Toolset:
    """The default tools, or the ``Toolset`` at ``module:attribute`` (a worker's own tools)."""
    if reference is None:
        return default_toolset()
    module, _, attribute = reference.partition(":")
    try:
        found = getattr(importlib.import_module(module), attribute or "toolset")
    except (ImportError, AttributeError) as error:
        raise exc.ConfigurationError(f"cannot load the tools {reference!r}: {error}") from None
    toolset = found() if callable(found) and not isinstance(found, Toolset) else found
    if not isinstance(toolset, Toolset):
        raise exc.ConfigurationError(f"{reference!r} is not a Toolset")
    return toolset
