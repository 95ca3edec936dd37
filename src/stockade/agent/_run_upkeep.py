"""What every node of a run does besides its work: count the budgets, tell the observers,
keep checkpoints, and mark the run finished.

The base of ``AgentRun`` (``run``): the tool calls (``_tool_calls``) and the run's other
nodes (``run``) both use it, so it sits below both.
"""

from __future__ import annotations

import time

from stockade.agent.checkpoint import DurableCheckpointer
from stockade.agent.events import AgentEvent
from stockade.agent.nodes import RunResult
from stockade.agent.settings import AgentSettings
from stockade.agent.state import NodeKind, RunState, RunStatus
from stockade.sandbox.facade import Sandbox
from stockade.tools.observations import clip


class RunUpkeep:
    """A run's live state and the upkeep every node shares (see ``AgentRun``)."""

    def __init__(
        self, agent: AgentSettings, state: RunState, sandbox: Sandbox, *, bookkeeping: Sandbox | None = None
    ) -> None:
        self.agent = agent
        self.state = state
        self.sandbox = sandbox
        self.bookkeeping = bookkeeping if bookkeeping is not None else sandbox
        self.result: RunResult | None = None
        self._node_started = 0.0  # the clock when the running node started (its time is not in elapsed_s yet)

    # -- budgets ------------------------------------------------------------------------

    def _over_budget(self, *, running: bool = False) -> tuple[RunStatus, str] | None:
        """The budget the run has used up, if any; ``running``: within a node, whose time so far
        counts (steps do not: they count model requests, checked before each)."""
        limits, state = self.agent.limits, self.state
        if not running and len(state.steps) >= limits.max_steps:
            return RunStatus.MAX_STEPS, f"the run reached max_steps={limits.max_steps}"
        elapsed = state.elapsed_s + (self.agent.clock() - self._node_started if running else 0.0)
        if elapsed >= limits.max_wall_s:
            return RunStatus.BUDGET, f"the run used its wall time ({limits.max_wall_s:g} s)"
        if state.usage.total_tokens >= limits.max_tokens:
            return RunStatus.BUDGET, f"the run used its tokens ({limits.max_tokens})"
        if limits.max_cost_usd is not None and state.cost_usd >= limits.max_cost_usd:
            return RunStatus.BUDGET, f"the run spent its budget (${limits.max_cost_usd:g})"
        return None

    def _wall_left(self) -> float:
        """The seconds left of the run's wall time, this node's so far counted."""
        spent = self.state.elapsed_s + self.agent.clock() - self._node_started
        return max(0.0, self.agent.limits.max_wall_s - spent)

    def _wall_deadline(self) -> float:
        """When the run's wall time ends, as a ``time.monotonic()`` reading: a tool call in
        flight is bounded by it (the model chooses a command's own timeout, up to days)."""
        return time.monotonic() + self._wall_left()

    # -- ending -------------------------------------------------------------------------

    def _finish(self, status: RunStatus, *, error: str | None = None) -> None:
        self.state.status = status
        # bounded as an observation is: it may quote what the model sent (a name, a path)
        self.state.error = (
            None if error is None else clip(error, self.agent.limits.max_observation_chars).text
        )
        self.state.next = NodeKind.END

    # -- plumbing -----------------------------------------------------------------------

    def _emit(self, event: AgentEvent) -> None:
        for observer in self.agent.observers:
            observer(event)

    @property
    def _durable(self) -> DurableCheckpointer | None:
        return self.agent._durable

    def _checkpoint(self, *, mid_node: bool = False) -> None:
        """``mid_node``: between the calls of a response; the time the node has taken so far is
        counted in what is kept (added to ``elapsed_s`` only when the node ends, it was lost
        with a process killed in it, and repeated kills ran past ``max_wall_s``)."""
        if self.agent.checkpointer is None:
            return
        if self.state.status.finished and self.result is None:
            # The node ended the run, and ``_end`` has not kept what it keeps yet (the diff, the
            # trail's last batch). A checkpoint saying "ended" now would outlive a crash before
            # them, and a run that ended is never resumed: its trail never reconciled. The last
            # checkpoint stays "running"; ``_end`` writes the one that says it ended.
            return
        state = self.state
        if mid_node:
            spent = state.elapsed_s + self.agent.clock() - self._node_started
            state = state.model_copy(update={"elapsed_s": spent})
        self.agent.checkpointer.save(state)
