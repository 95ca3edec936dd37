"""The run store: every agent run's steps, tool calls, retries, approvals and usage, so that
a run can be inspected (``stockade runs``), resumed after a crash, and replayed
(``stockade replay``). See ``store`` for the API, ``checkpoints`` for how checkpoints stay
cheap, ``recorder`` for what is written between them and ``replay`` for running a stored run
again."""

from stockade.runs.recorder import RecordedApprovals, RunRecorder
from stockade.runs.store import ApprovalEntry, RetryEntry, RunStore, RunSummary, RunTrace, open_run_store

__all__ = [
    "ApprovalEntry",
    "RecordedApprovals",
    "RetryEntry",
    "RunRecorder",
    "RunStore",
    "RunSummary",
    "RunTrace",
    "open_run_store",
]
