"""A job as the supervisor makes it from the host's request, and the answer a ``run_code``
gets when no interpreter runs it (cancelled while queued, or none could start)."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit.sandbox.conftest import SUPERVISOR


@pytest.fixture(scope="module")
def modules() -> Iterator[SimpleNamespace]:
    sys.path.insert(0, str(SUPERVISOR))  # the supervisor's modules import each other by name
    try:
        jobs, runcode = importlib.import_module("jobs"), importlib.import_module("runcode")
        yield SimpleNamespace(jobs=jobs, runcode=runcode)
    finally:
        sys.path.remove(str(SUPERVISOR))


class _Supervisor:
    """What a job asks of its supervisor: the OOM kills so far, and where a run's answer goes."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, dict[str, Any]]] = []
        self.interpreter: Any = None
        self.rules = None

    def oom_kills(self) -> int:
        return 0

    def finish_code(self, job: Any, payload: bytes) -> None:
        self.answers.append((job.rid, json.loads(payload)))

    def answer_code(self, job: Any, name: str, value: str) -> None:
        """The supervisor's own verdict, which the host tells from a payload by its mark."""
        self.answers.append((job.rid, {"verdict": name, "value": value}))


def test_a_job_stops_its_clock_for_approvals_as_long_as_its_request_says(modules: SimpleNamespace) -> None:
    sup = _Supervisor()
    assert modules.jobs.Job(sup, 1, {"approval_wait": 30}).hold_cap == 30.0
    assert modules.jobs.CommandJob(sup, 2, {"approval_wait": 0}).hold_cap == 0.0
    assert modules.jobs.Job(sup, 3, {}).hold_cap == modules.jobs.HOLD_CAP_S  # an older host says nothing


def test_a_queued_run_cancelled_by_the_host_is_answered_kernel_died(modules: SimpleNamespace) -> None:
    sup = _Supervisor()
    waiting = modules.jobs.Job(sup, 7, {})
    sup.interpreter = SimpleNamespace(queue=[(waiting, b"print(1)")], job=None)
    modules.runcode.cancel_code(sup, 7)
    verdict = {"verdict": "KernelDied", "value": "cancelled by the host"}
    assert sup.answers == [(7, verdict)] and sup.interpreter.queue == []
