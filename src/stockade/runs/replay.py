"""Replay a recorded run: the same model responses, under the same policy, in a fresh sandbox,
and what came out different.

    state, setup = store.load(run_id), store.setup(run_id)    # setup: what the run ran under
    config = replay_config(state, setup, audit="sqlite:///.stockade/audit.db")
    with build_agent(config) as agent:
        report = await replay(state, agent=agent, workspace=seed)  # the run's starting workspace
    for d in report.differences: print(d.step, d.tool, d.recorded, d.replayed)

The model is a ``ScriptedModel`` playing the recorded responses in order, so every tool call
is the one the original run made; only the observations can differ. A difference means the
environment answered differently: a flaky test, a time-dependent command, a workspace that
was not the same. Durations and memory addresses are masked before comparing (``normalise``).
The run's acceptance check runs again too (kept with its setup) and each of its runs is
compared as a call is (``Difference.tool`` "check"); and a replay that ends otherwise than the
run did (success against check_failed, say) is not ``ok`` either, whatever its observations.
A run kept without its check (by an older stockade) is replayed with the command its record
shows it ran, under the sandbox's default timeout (``check_unkept`` says so).

The recorded calls are the model's, so they are judged as the original's were: the replay is
a guarded agent (``build_agent``) under the run's own policy and role (``RunSetup``, kept by
the run store), on a tier no weaker than the run's (and than its trust allows), with its own
run id in the audit trail. An action that needs approval goes to ``approver``; by default
nobody approves it (a replay has no one to wait for, so it never pauses).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from stockade.agent.limits import RunLimits
from stockade.agent.state import CheckRecord, RunState, RunStatus, StepRecord, ToolCallRecord
from stockade.assembly import AgentConfig, GuardedAgent
from stockade.audit.log import AuditLog
from stockade.exceptions import TierUnavailable
from stockade.models.scripted import ScriptedModel
from stockade.policy.approval import Approver
from stockade.policy.approval_book import ApprovalRequest, Choice
from stockade.policy.load import policy_digest
from stockade.policy.schema import ModelRegistry
from stockade.runs.records import RunSetup
from stockade.sandbox import _registry
from stockade.sandbox.base import Backend
from stockade.tools.base import Toolset
from stockade.tools.builtin import default_toolset, shell
from stockade.types import Trust

__all__ = [
    "Difference",
    "ReplayReport",
    "check_unkept",
    "nobody_approves",
    "normalise",
    "policy_file_changed",
    "recorded_model",
    "replay",
    "replay_config",
]

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
    """One tool call, or run of the acceptance check (``tool`` and ``call_id`` "check"), whose
    outcome changed. ``what``: observation, error (for the check: passed or not, its exit
    code), missing or extra."""

    step: int
    call_id: str
    tool: str
    what: str
    recorded: str
    replayed: str


@dataclass(frozen=True, kw_only=True)
class ReplayReport:
    run_id: str
    replay_id: str  # the replay's own run id (its events in the audit trail)
    tier: str  # the tier it ran on
    recorded_status: RunStatus
    replayed_status: RunStatus
    compared: int  # tool calls and runs of the acceptance check compared
    differences: tuple[Difference, ...]
    replayed: RunState

    @property
    def status_differs(self) -> bool:
        """The replay ended otherwise than the run did. A run stopped from outside (killed,
        interrupted) or waiting (paused, running) ended by no decision a replay can repeat."""
        if self.recorded_status in _STOPPED_FROM_OUTSIDE or not self.recorded_status.finished:
            return False
        return self.recorded_status != self.replayed_status

    @property
    def ok(self) -> bool:
        return not self.differences and not self.status_differs


_STOPPED_FROM_OUTSIDE = frozenset({RunStatus.KILLED, RunStatus.INTERRUPTED})


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
    present = old or new
    if present is None:
        return None
    outcomes = [(r.is_error, r.error_type) for r in (old, new) if r is not None]
    return _difference(
        Difference(step=step, call_id=present.call.id, tool=present.call.name, what="",
                   recorded=old.observation if old else "", replayed=new.observation if new else ""),
        old is not None, new is not None, len(set(outcomes)) > 1, clean,
    )  # fmt: skip


def _compare_check(
    old: CheckRecord | None, new: CheckRecord | None, clean: Callable[[str], str]
) -> Difference | None:
    present = old or new
    if present is None:
        return None
    outcomes = [(r.passed, r.exit_code, r.timed_out) for r in (old, new) if r is not None]
    return _difference(
        Difference(step=present.step, call_id="check", tool="check", what="",
                   recorded=old.observation if old else "", replayed=new.observation if new else ""),
        old is not None, new is not None, len(set(outcomes)) > 1, clean,
    )  # fmt: skip


def _difference(
    both: Difference, was: bool, is_: bool, erred: bool, clean: Callable[[str], str]
) -> Difference | None:
    """``both`` with what differs between the recorded (``was`` there) and the replayed
    (``is_`` there) observation: ``erred``, their outcomes differ; None when nothing does."""
    if not (was and is_):
        what = "extra" if is_ else "missing"
    elif erred:
        what = "error"
    elif clean(both.recorded) != clean(both.replayed):
        what = "observation"
    else:
        return None
    return replace(both, what=what)


def _steps_of(state: RunState, limits: RunLimits) -> int:
    """The replay's max_steps: those the run recorded, and the turn after them it asked its
    model for (its model failing there ended the run "error": the replay's, out of recorded
    responses, does too), unless steps were what ended it (or would have)."""
    recorded = len(_steps(state))
    if state.status is RunStatus.MAX_STEPS:
        return max(1, recorded)
    return max(1, min(limits.max_steps, recorded + 1))


def _check_of(state: RunState, setup: RunSetup) -> tuple[str | None, float | None]:
    """The acceptance check a replay runs: the run's, else (a run kept without it) the command
    its record shows it ran."""
    if setup.check_kept:
        return setup.check, setup.check_timeout_s
    return (state.checks[-1].command if state.checks else None), None


def check_unkept(state: RunState, setup: RunSetup) -> str | None:
    """In words, what a replay of a run kept without its acceptance check does about it
    (``None``: the check was kept, and runs as the run had it)."""
    if setup.check_kept:
        return None
    if state.checks:
        return (
            f"the run store kept no acceptance check for run {state.run_id} (recorded before runs kept "
            f"theirs): the replay runs the one its record shows, `{state.checks[-1].command}`, under the "
            "sandbox's default timeout"
        )
    return (
        f"the run store kept no acceptance check for run {state.run_id} (recorded before runs kept "
        "theirs) and its record shows none ran: the replay runs none"
    )


def nobody_approves(request: ApprovalRequest) -> Choice:
    """A replay's approver when no one is there to ask: what needs approval is refused."""
    return Choice.DENIED


def policy_file_changed(setup: RunSetup) -> str | None:
    """In words, how the policy file the run's policy was read from differs now (``None``: it
    does not, or the policy came from no file). The replay runs under the kept policy either way."""
    if setup.policy_file is None or setup.policy_digest is None:
        return None
    now = policy_digest(setup.policy_file)
    if now == setup.policy_digest:
        return None
    how = "is gone or unreadable" if now is None else "has changed"
    return (
        f"the policy file {setup.policy_file} {how} since the run; the replay runs under the "
        "policy as the run had it"
    )


def _tier(setup: RunSetup, asked: str | None) -> str | None:
    """The replay's tier: the run's unless a stronger one is asked; a weaker one is refused."""
    if asked is None or setup.tier is None:
        return asked or setup.tier
    strength = _registry.STRENGTH
    if asked in strength and setup.tier in strength and strength.index(asked) < strength.index(setup.tier):
        raise TierUnavailable(
            f"the run ran on the {setup.tier} tier; a replay on the {asked} tier would run its calls "
            f"with less isolation: replay it on {setup.tier} or a stronger tier "
            f"({', '.join(strength[strength.index(setup.tier) :])})"
        )
    return asked


def replay_config(
    state: RunState,
    setup: RunSetup,
    *,
    tier: str | None = None,
    trust: Trust | None = None,
    backend: Backend | None = None,
    tools: Toolset | None = None,
    audit: str | AuditLog = "memory:",
    audit_key: bytes | None = None,
    approver: Approver = nobody_approves,
    approval_dir: str | Path | None = None,
    kill_target: str | None = None,
) -> AgentConfig:
    """The guarded agent that replays ``state`` under ``setup`` (``RunStore.setup``: the run's
    policy, role, tier, budgets and acceptance check): its recorded responses as the model, the
    run's tier unless a stronger one is asked (``tier``, or a ``backend`` of a tier), a weaker one refused
    (``TierUnavailable``, as is one its trust does not allow). ``tools`` defaults to the
    built-in tools (with ``shell`` if the run used it); a run that used tools of its own needs
    them here. Nothing is recorded in a run store; the audit trail (``audit``) has the replay
    under its own run id."""
    asked = _tier(setup, backend.tier if backend is not None else tier)
    check, check_timeout_s = _check_of(state, setup)
    limits = setup.limits or RunLimits()
    return AgentConfig(
        model=recorded_model(state),
        # the registry chose the model the run invoked; a replay invokes none, it plays its answers
        policy=setup.policy.model_copy(update={"models": ModelRegistry()}),
        role=setup.role,
        trust=trust,  # tightens the run's, never loosens it
        tier=None if backend is not None else asked,
        backend=backend,
        tools=tools if tools is not None else _tools_for(state),
        system_prompt=state.system,
        check=check,  # a run that failed its check must not replay as a success
        check_timeout_s=check_timeout_s,
        # the run's own budgets where it kept them (a replay takes no more wall time, tokens or
        # dollars than the run could), its steps those it recorded and the turn after them
        limits=replace(limits, max_steps=_steps_of(state, limits)),
        audit=audit,
        audit_key=audit_key,
        approver=approver,
        approval_dir=approval_dir,
        kill_target=kill_target,
        record_runs=False,
        keep_sandbox=False,
        # the recorded responses stop where the run stopped; a breaker the run may not have had
        # would stop the replay elsewhere
        max_consecutive_failures=None,
    )


async def replay(
    state: RunState,
    *,
    agent: GuardedAgent,
    workspace: str | Path | None = None,
    clean: Callable[[str], str] = normalise,
) -> ReplayReport:
    """Run the recorded responses of ``state`` again with ``agent`` (``build_agent(replay_config(
    ...))``) in a sandbox seeded with ``workspace``, and compare the observations."""
    recorded = _steps(state)
    replay_id = f"{state.run_id}-replay-{uuid.uuid4().hex[:8]}"
    with agent.session(workspace=workspace, run_id=replay_id) as session:
        result = await session.run(state.task)
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
    old_checks, new_checks = state.checks, result.state.checks
    for k in range(max(len(old_checks), len(new_checks))):
        compared += 1
        difference = _compare_check(
            old_checks[k] if k < len(old_checks) else None,
            new_checks[k] if k < len(new_checks) else None,
            clean,
        )
        if difference is not None:
            differences.append(difference)
    return ReplayReport(
        run_id=state.run_id,
        replay_id=replay_id,
        tier=agent.tier,
        recorded_status=state.status,
        replayed_status=result.status,
        compared=compared,
        differences=tuple(differences),
        replayed=result.state,
    )
