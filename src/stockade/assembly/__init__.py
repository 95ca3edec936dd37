"""One call from a policy file to a guarded, limited, audited agent.

    agent = build_agent(AgentConfig(
        model="openai:gpt-4.1", policy="policy.toml", audit="sqlite:///.stockade/audit.db",
        limits=RunLimits(max_steps=20, max_cost_usd=2.0), rate_per_minute=60,
        dollars_per_hour=5.0, approver=cli_approver,
    ))
    with agent:
        result = agent.run_sync("make the tests pass", workspace="project/")

or, to keep one sandbox across a pause for approval and its resumption:

    with agent.session(workspace="project/") as session:
        result = session.run_sync("make the tests pass")      # status "paused": someone decides
        result = session.resume_sync()                        # then it goes on where it stopped

The tier comes from trust: the stricter of ``AgentConfig.trust`` and the policy's
``[trust] level`` (a caller can tighten the policy, never loosen it) gives the tiers allowed
(the README's trust table); an explicit ``tier`` outside them, or none available on this host, fails
closed with ``TierUnavailable`` before any code runs.

The wrappers, outermost first, and why in this order:

    tool call   runtime guard       a killed run, or one whose breaker tripped, goes no further
                policy guard        deny (told to the model) or ask a human (the run pauses), before
                                    anything runs or is counted: a denied call costs no rate budget
                output filter       the policy sees the final output the model would get
                runtime controls    kill switch check, action rate limits (per run, per tenant: wait
                                    for the window, or stop the run), the tool's breaker (the
                                    run's own: caller errors such as a missing file count not)
                the tool
    sandbox op  policy guard again  every op, whatever tool issued it (defence in depth); an op of a
                                    call a human already approved is not asked about twice
                kill switch         the run's processes die the moment it is pulled
                audit               each op that reaches the tier, once, whatever retries did below
                backend breaker     counts an op as failed only after its retries
                retry               transient failures only (starts and reads; never commands)
                the tier
    model       registry check (ApprovedModel) -> spend limit ($/hour: stop, or wait) -> breaker ->
                retry -> adapter
    observers   audit first (a run refused at its start is still recorded), the prompt filter,
                the runtime controls (the kill switch between steps), then yours

Every decision lands in the audit trail: model calls, tool calls, denials at either level,
approvals (asked, granted, refused), retries, breaker changes, rate and spend refusals,
anomalies, kills, sandbox start and stop, commands and file writes.

One module per concern: ``config`` (``AgentConfig``); ``trust`` (the policy at the caller's
trust, the tier it allows); ``approvals`` (approvals in the trail, the tool call they are asked
under) and ``guards`` (denials in the trail); ``agent`` (``GuardedAgent``, what an agent's runs
share, and ``build_agent``); ``session`` (``AgentSession``, one run). This package names the
public ones.
"""

from stockade.assembly.agent import GuardedAgent, build_agent
from stockade.assembly.config import AgentConfig
from stockade.assembly.session import AgentSession
from stockade.assembly.trust import effective_trust

__all__ = ["AgentConfig", "AgentSession", "GuardedAgent", "build_agent", "effective_trust"]
