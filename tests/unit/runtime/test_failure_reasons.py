"""A failure's reason is cut to one short line for the breaker's event and the run's error;
the redaction of what records it sees only the cut line, so the cut keeps no credential's head."""

from __future__ import annotations

import pytest

from stockade.agent.state import ToolCallRecord
from stockade.models.messages import ToolCall
from stockade.runtime.failures import describe_failure

TOKEN = "ghp_" + "C" * 36


def failed_with(error: str) -> ToolCallRecord:
    call = ToolCall(id="c1", name="run_code", args={})
    return ToolCallRecord(call=call, idempotency_key="k", observation=error, is_error=True,
                          error_type="ToolError", failed=True)  # fmt: skip


@pytest.mark.parametrize("before", [165, 180, 190, 196])  # the cut (199) inside the token
def test_a_reason_cut_through_a_token_keeps_none_of_it(before: int) -> None:
    reason = describe_failure(3, failed_with("x" * before + " " + TOKEN + " and more"))
    assert "ghp_" not in reason and "CCCC" not in reason, reason
    assert reason.startswith("run_code (step 3): xxx") and reason.endswith("…")


def test_a_short_reason_is_kept_whole() -> None:
    assert describe_failure(1, failed_with("exit code 2")) == "run_code (step 1): exit code 2"
