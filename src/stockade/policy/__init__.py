"""Policy as data: a validated file of rules, a decision engine over it, guards that enforce
it, and human approval. ``stockade.policy.agent`` plugs it into an agent run."""

from stockade.policy.approval import Approvals, cli_approver
from stockade.policy.approval_book import ApprovalBook, ApprovalRequest, Choice
from stockade.policy.approval_store import ApprovalStore
from stockade.policy.engine import Decision, PolicyEngine
from stockade.policy.guards import GuardedBackend, GuardedInstance, OpContext, op_policy_guard, pipeline
from stockade.policy.load import load_policy, parse_policy
from stockade.policy.schema import Policy, Verdict

__all__ = [
    "ApprovalBook",
    "ApprovalRequest",
    "ApprovalStore",
    "Approvals",
    "Choice",
    "Decision",
    "GuardedBackend",
    "GuardedInstance",
    "OpContext",
    "Policy",
    "PolicyEngine",
    "Verdict",
    "cli_approver",
    "load_policy",
    "op_policy_guard",
    "parse_policy",
    "pipeline",
]
