"""A run's budgets: ``RunLimits``, and the size a tool call's arguments may take.

Apart from the loop: the run store keeps a run's limits (and signs them), the service and
replay read them back, and none of them needs the loop to do so.
"""

from __future__ import annotations

from dataclasses import dataclass

from stockade._checks import MAX_COST_USD, check_number
from stockade.exceptions import ConfigurationError
from stockade.types import MAX_PENDING_APPROVALS

__all__ = ["MAX_CALL_ARGS_BYTES", "RunLimits"]

# The most a tool call's arguments may take (as JSON): a larger call is refused before it is
# validated, and its arguments are dropped before anything keeps them (the run's state, its
# checkpoints and ledger, the audit trail each kept a copy: 5 calls of 4 MB made a 126 MB
# trail). What it asked for stays provable: its size and SHA-256 are in the refusal.
MAX_CALL_ARGS_BYTES = 256 * 1024


@dataclass(frozen=True, kw_only=True)
class RunLimits:
    """Per-run budgets. Steps count model requests; wall time accumulates across resumes."""

    max_steps: int = 30
    max_wall_s: float = 900.0
    max_tokens: int = 1_000_000
    max_cost_usd: float | None = None
    max_malformed: int = 3  # corrective observations for malformed or unknown tool calls
    max_denials: int = 3  # policy denials in a row before the run ends as "denied"
    max_check_failures: int = 3  # failed acceptance checks before the run ends as "check_failed"
    max_observation_chars: int = 12_000
    max_call_args_bytes: int = MAX_CALL_ARGS_BYTES  # a larger call is refused, as a malformed one
    # requests kept pending at once; an action asked past them is refused, not kept (ApprovalsFull)
    max_pending_approvals: int = MAX_PENDING_APPROVALS

    def __post_init__(self) -> None:
        for name in (
            "max_steps",
            "max_tokens",
            "max_malformed",
            "max_denials",
            "max_check_failures",
            "max_observation_chars",
            "max_call_args_bytes",
            "max_pending_approvals",
        ):
            value = getattr(self, name)
            check_number(value, argument=f"RunLimits.{name}", integer=True, low=0, high=2**62)
        check_number(
            self.max_wall_s, argument="RunLimits.max_wall_s", integer=False, low=0, high=1e9, unit="seconds"
        )
        if self.max_cost_usd is not None:
            check_number(
                self.max_cost_usd, argument="RunLimits.max_cost_usd", integer=False, low=0, high=MAX_COST_USD
            )
        if (
            self.max_steps < 1
            or self.max_wall_s <= 0
            or self.max_tokens < 1
            or self.max_check_failures < 1
            or self.max_call_args_bytes < 1
        ):
            raise ConfigurationError(
                "RunLimits: max_steps, max_wall_s, max_tokens, max_check_failures and "
                "max_call_args_bytes must be positive"
            )
