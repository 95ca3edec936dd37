"""How an MCP session's held actions are decided: asked of the client's user (an
elicitation form on the handshake versions; on 2026-07-28 an ``InputRequiredResult`` whose
answer comes with the client's retry), else waited for from ``stockade approve``, and denied
when nobody decided by the pause's deadline.

Apart from the protocol's handlers (``mcp_face``), which drive a call through its pauses:
this is what a pause asks, of whom, and how the answer is recorded in the trail.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from typing import Any

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from stockade import exceptions as exc
from stockade._display import visible
from stockade.policy import approval
from stockade.policy.approval import CLIENT_ACTOR, NOT_A_DECISION
from stockade.policy.approval_book import Choice
from stockade.server.mcp_outcomes import Paused, PendingApproval
from stockade.server.mcp_session import McpAgent, McpSession

__all__ = ["AskingApprovals", "asks_by_retry", "input_required"]

_APPROVE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "approve": {
            "type": "boolean",
            "title": "Approve",
            "description": "Let the action run (false: deny it; the model is told)",
        }
    },
    "required": ["approve"],
}


class AskingApprovals:
    """How a paused call's approvals are asked and recorded: a base class of ``McpFace``."""

    agent: McpAgent

    @property
    def _client_decides(self) -> bool:
        """Whether the MCP client is asked to decide its session's held actions: not under a role
        that cannot approve (``can_approve = false``), whose client approved its own ``rm -r src``
        through elicitation. There the call waits for ``stockade approve``, as without one."""
        return self.agent.agent.engine.role.can_approve

    async def _answered(self, session: McpSession, held: Paused, responses: Any) -> bool:
        """Record the decisions the client's retry carries; whether every request has one."""
        for pending in held.approvals:
            answer = responses.get(pending.request_id)
            if not isinstance(answer, types.ElicitResult):
                return False
            choice, by = _client_choice(session, answer)
            with contextlib.suppress(exc.ApprovalDecided):  # decided elsewhere first: that stands
                await anyio.to_thread.run_sync(functools.partial(session.decide, pending, choice, by=by))
        return True

    async def _ask(
        self, ctx: ServerRequestContext[Any, Any], session: McpSession, pending: PendingApproval, *,
        deadline: float, wait_s: float,
    ) -> None:  # fmt: skip
        """Get a decision: from the client's user (elicitation), else from whoever runs
        ``stockade approve``, by ``deadline`` (the pause's: ``wait_s`` after it began, within
        ``approval_wait_s`` and the session's wall time left); nobody: denied, and the reason
        kept. An elicitation is waited for no longer than that: a client that never answered
        held its call, its sandbox and (over HTTP) its session's slot for good, past
        ``--approval-wait`` and ``--max-session-s``. Past the deadline nobody is asked."""
        if anyio.current_time() >= deadline:
            await self._deny(session, pending, approval.unanswered(f"the pause's {wait_s:g} s had run out"))
            return
        caps = ctx.session.client_capabilities
        if (
            self._client_decides
            and caps is not None
            and caps.elicitation is not None
            and ctx.session.can_send_request
        ):
            answer: types.ElicitResult | None = None
            with anyio.move_on_after(deadline - anyio.current_time()):
                answer = await ctx.session.elicit_form(
                    message=_message(pending),
                    requested_schema=_APPROVE_SCHEMA,
                    related_request_id=ctx.request_id,
                )
            if answer is None:
                unanswered = approval.unanswered(f"the MCP client answered nothing within {wait_s:g} s")
                await self._deny(session, pending, unanswered)
                return
            choice, by = _client_choice(session, answer)
            with contextlib.suppress(exc.ApprovalDecided):  # decided elsewhere meanwhile: that stands
                await anyio.to_thread.run_sync(lambda: session.decide(pending, choice, by=by))
            return
        print(
            f"stockade mcp: {visible(pending.action)} waits for approval: "
            f"stockade approve {pending.run_id} {pending.request_id} (or deny); "
            f"{round(deadline - anyio.current_time(), 1):g} s",
            file=sys.stderr,
            flush=True,
        )
        while anyio.current_time() < deadline:
            if await anyio.to_thread.run_sync(lambda: session.decision(pending)) is not None:
                return
            await anyio.sleep(min(0.25, max(0.0, deadline - anyio.current_time())))
        await self._deny(session, pending, approval.unanswered(f"nobody answered within {wait_s:g} s"))

    @staticmethod
    async def _deny(session: McpSession, pending: PendingApproval, by: str) -> None:
        """Deny what nobody decided in time; the trail records the no as ``by``'s."""
        with contextlib.suppress(exc.ApprovalDecided):  # decided at the last moment: that stands
            await anyio.to_thread.run_sync(lambda: session.decide(pending, Choice.DENIED, by=by))


def _client_choice(session: McpSession, answer: types.ElicitResult) -> tuple[Choice, str]:
    """What the client's elicitation answer decides, and who decided: the client (its name as
    it gave it, quoted and escaped), not a person the server knows; the trail records it as
    such. An "accept" without ``approve`` true or false (``"true"``) decides nothing: denied,
    and said so (``NOT_A_DECISION``), in the trail and to the model alike."""
    said = (answer.content or {}).get("approve")
    by = f"{CLIENT_ACTOR}{json.dumps(session.client)} (elicitation: {json.dumps(answer.action)}"
    if answer.action == "accept" and said is True:
        return Choice.APPROVED, by + ")"
    if answer.action == "accept" and said is not False:
        return Choice.DENIED, f"{by}, {NOT_A_DECISION})"
    return Choice.DENIED, by + ")"


def _message(pending: PendingApproval) -> str:
    # shown to a person, who decides on it: code chose the action's words, not how they show
    action, reason = visible(pending.action), visible(pending.reason)
    return f"stockade: {action} needs your approval ({reason}; rule {pending.rule})"


def asks_by_retry(ctx: ServerRequestContext[Any, Any]) -> bool:
    """A 2026-07-28 client that can ask its user: no server-to-client request exists there."""
    caps = ctx.session.client_capabilities
    return (
        ctx.session.protocol_version in MODERN_PROTOCOL_VERSIONS
        and caps is not None
        and caps.elicitation is not None
    )


def input_required(paused: Paused) -> types.InputRequiredResult:
    return types.InputRequiredResult(
        input_requests={
            p.request_id: types.ElicitRequest(
                params=types.ElicitRequestFormParams(message=_message(p), requested_schema=_APPROVE_SCHEMA)
            )
            for p in paused.approvals
        },
        request_state=paused.approvals[0].run_id if paused.approvals else "paused",
    )
