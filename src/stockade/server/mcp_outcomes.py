"""What a call of an MCP session is and what it comes to: values, apart from the session.

The protocol's handlers (``mcp_face``) and the approvals they ask (``mcp_approvals``) read
these outcomes without running a session; ``ClientCall`` is a call as its session holds it,
queued and then in flight, which the session's tools (``mcp_tools``) read too.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import JsonValue

from stockade.models.messages import ToolCall
from stockade.policy.approval_book import ApprovalRequest

__all__ = ["CallResult", "ClientCall", "Ended", "Outcome", "Paused", "PendingApproval"]


@dataclass(frozen=True, kw_only=True)
class CallResult:
    """What the tool call returned (its observation, as the model of a run would see it)."""

    text: str
    is_error: bool


@dataclass(frozen=True, kw_only=True)
class PendingApproval:
    run_id: str
    request_id: str
    action: str
    rule: str
    reason: str

    def request(self) -> ApprovalRequest:
        return ApprovalRequest.kept(
            {"run_id": self.run_id, "id": self.request_id, "action": self.action, "rule": self.rule,
             "reason": self.reason}
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Paused:
    """The call waits for a human decision on ``approvals``; then ``McpSession.resume``."""

    approvals: tuple[PendingApproval, ...]
    call: ToolCall | None = None  # the call that waits, as its client sent it

    def holds(self, name: str, args: Mapping[str, JsonValue]) -> bool:
        """Whether a call of ``name`` with ``args`` is the one that waits (a client's retry)."""
        return self.call is not None and self.call.name == name and self.call.args == dict(args)


@dataclass(frozen=True, kw_only=True)
class Ended:
    """The session's run ended (killed, denied too often, out of budget, ...): no more calls."""

    status: str
    error: str | None


Outcome = CallResult | Paused | Ended


@dataclass
class ClientCall:
    call: ToolCall
    future: concurrent.futures.Future[Outcome] = field(default_factory=concurrent.futures.Future)
    # A resource read: a call of its matching tool, whose result is the content itself
    # (``mcp_tools``), not the tool's numbered lines or listing
    resource: bool = False
    content: str | None = None
    # Its client gave it up (``notifications/cancelled``): queued, it never runs; running, its
    # sandbox work is cut, nothing more of it runs, and its result is ``CallCancelled``
    cancelled: bool = False
    size: int = 0  # of its arguments, counted against the server's queued bytes while queued
    queued: bool = True  # still in its session's inbox, counted against its caps
