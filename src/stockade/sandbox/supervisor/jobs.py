"""What the supervisor runs for the host, one object per request: a ``Job`` (a run of
``run_code``) counts and caps its output and says what its final frame reports; a
``CommandJob`` adds the shim, the pipes and the exit status of a command.

Apart from the supervisor so that its event loop reads as routing, and shared by the
interpreter's queue (``runcode.py``), which holds plain jobs.

Standard library only; runs on any Python >= 3.8 found inside the sandbox.
"""

from __future__ import annotations

import time

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Optional

    from supervisor import Supervisor


class Job:
    def __init__(self, sup: "Supervisor", rid: int) -> None:
        self.sup = sup
        self.rid = rid
        self.started = time.monotonic()
        self.deadline: Optional[float] = None
        self.counts = {1: 0, 2: 0}
        self.sent = {1: 0, 2: 0}
        self.timed_out = False
        self.oom_start = sup.oom_kills()
        self.execs: "list[dict[str, Any]]" = []  # what the rules judged (supervisor/rules.py)
        self.exec_count = 0

    def report(self) -> "dict[str, Any]":
        """What every final frame says of the job besides its own outcome."""
        out = {
            "id": self.rid,
            "timed_out": self.timed_out,
            "duration": time.monotonic() - self.started,
            "stdout_bytes": self.counts[1],
            "stderr_bytes": self.counts[2],
        }
        if self.sup.report_oom:
            out["oom_kills"] = self.sup.oom_kills() - self.oom_start
        if self.exec_count:
            out["execs"] = self.execs
            out["exec_count"] = self.exec_count
        return out

    def output(self, fd: int, data: bytes) -> None:
        self.counts[fd] += len(data)
        room = self.sup.output_cap - self.sent[fd]
        if room > 0:
            part = data[:room]
            self.sent[fd] += len(part)
            self.sup.send({"id": self.rid, "ev": "out", "fd": fd}, part)


class CommandJob(Job):
    def __init__(self, sup: "Supervisor", rid: int) -> None:
        super().__init__(sup, rid)
        self.shim = 0
        self.status: Optional[int] = None
        self.open_pipes: dict[int, int] = {}
        self.stdin_fd = -1
        self.stdin_buf = b""

    def finished(self) -> bool:
        return self.status is not None and not self.open_pipes
