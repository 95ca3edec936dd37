"""Commands and run_code in a supervised sandbox: a request sent, its output passed on as it
comes, an exec that waits for a human answered, and the deadlines past which the host takes
the sandbox down.

A part of ``SupervisedInstance`` (``_supervised``): a call's deadlines and its approvals are
what a command's time and its caller's patience rest on; the tiers state their margin
(``TIMEOUT_MARGIN_S``) from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

from stockade import exceptions as exc
from stockade._display import visible
from stockade.sandbox import _rules_execs
from stockade.sandbox._approver import ANSWER_BY, answered, cut_requested
from stockade.sandbox._replies import (
    OutputCollector,
    command_result,
    execution,
    int_field,
    timed_out_command,
    timed_out_execution,
)
from stockade.sandbox._supervised_life import SupervisedLife
from stockade.sandbox._transfers import FILE_OP_TIMEOUT_S
from stockade.sandbox.base import OutputSink
from stockade.sandbox.ops import RunCode, RunCommand
from stockade.sandbox.supervisor.protocol import MAX_BUNDLE_ENTRIES, MAX_RESULT_COUNT, MAX_RESULT_ENTRIES
from stockade.types import CommandResult, Enforcement, Execution

# Past its own deadline the supervisor has this long to report before the host kills the
# whole sandbox: the supervisor shares the sandbox with the code and may be starved or dead.
GRACE_S = 5.0
# How long the host waits for the supervisor to end a call nobody waits for any more.
CANCEL_S = 10.0
# A call past its timeout_s has stopped within this much more, however busy the host: the
# supervisor kills it at the deadline (it runs at a higher priority than the code). Each
# sandbox states its own (``Enforcement.timeout_margin_s``): this where its kernel honours
# that priority (the host's, a KVM guest's), ...
TIMEOUT_MARGIN_S = Enforcement.timeout_margin_s  # 1 s
# ... and this where it cannot: gVisor's kernel schedules every task alike, and a guest
# emulated under TCG runs its clock and its kills at a fraction of the host's speed, so on a
# busy host the kill waits its turn behind the code's processes for the host's cores.
# Measured with four processes spinning outside, a 3 s call of 17 spinning processes: on
# gVisor 0.1-0.35 s late on an idle 2-core host, 1.1 s on a slower shared one; under TCG 1.6 s.
UNPRIORITIZED_TIMEOUT_MARGIN_S = 2.5
# What the JSON of a report may make: a list and an object per result, four values per MIME
# entry (key, value, their separators), the error and the cap's notes. Parsed, the worst
# report of this size is a few MiB of objects (a 30 MB report of empty results was 2.5 GB).
MAX_CODE_VALUES = 2 * MAX_RESULT_COUNT + 4 * (MAX_RESULT_ENTRIES + MAX_BUNDLE_ENTRIES) + 64

__all__ = [
    "CANCEL_S",
    "GRACE_S",
    "MAX_CODE_VALUES",
    "TIMEOUT_MARGIN_S",
    "UNPRIORITIZED_TIMEOUT_MARGIN_S",
    "SupervisedCalls",
]

log = logging.getLogger(__name__)


class SupervisedCalls(SupervisedLife):
    """The commands and run_code of a sandbox (see ``SupervisedInstance``)."""

    # -- commands -----------------------------------------------------------------------

    def _timeout(self, value: float | None) -> float:
        return self.spec.limits.timeout_s if value is None else value

    def _stream(
        self, header: dict[str, Any], body: bytes, timeout: float, sink: OutputSink | None
    ) -> tuple[tuple[dict[str, Any], bytes] | None, dict[int, OutputCollector], dict[str, Any] | None]:
        """Send a request, pass output to ``sink`` as it comes, return the final frame (and
        the ``between`` frame before it: the execs judged while no call ran).

        None means the supervisor missed its own deadline by ``GRACE_S``: the sandbox is
        then taken down whole, and the output seen so far is returned.
        """
        cap = self.spec.limits.output_bytes
        streams = {1: OutputCollector(cap), 2: OutputCollector(cap)}
        between: dict[str, Any] | None = None
        deadline = time.monotonic() + timeout + GRACE_S  # the send of a large stdin included
        hold_cap = self.spec.limits.approval_wait_s
        header = {**header, "approval_wait": hold_cap}
        first_asked: float | None = None
        credited = 0.0
        try:
            call = self.channel.call(header, body, deadline)
        except TimeoutError:
            self.close()
            return None, streams, between
        try:
            for h, chunk in call.frames(deadline):
                ev = h.get("ev")
                if ev == "out":
                    fd = 1 if h.get("fd") == 1 else 2
                    part = streams[fd].add(chunk)
                    if sink is not None and part:
                        sink(fd, part)
                elif ev == "approve":
                    # The time a human takes is not the command's: the supervisor holds the
                    # job's deadline back while an exec waits, up to approval_wait_s of the
                    # call (``jobs.Job.hold``). The host's follows by no less: the whole span
                    # from the first ask to the last answer, within the same cap.
                    first_asked = time.monotonic() if first_asked is None else first_asked
                    self._approve(h, first_asked + hold_cap)
                    span = min(time.monotonic() - first_asked, hold_cap)
                    call.extend(span - credited)
                    credited = span
                elif ev == "between" and between is None:  # one per call: a second is not ours
                    between = h
                elif ev in ("exit", "result"):
                    return (h, chunk), streams, between
                elif ev == "error":
                    raise exc.ProtocolError(f"supervisor refused {header['op']}: {h.get('message')}")
        except TimeoutError:
            self.close()
            return None, streams, between
        except exc.SandboxCrashed as err:  # what the call printed explains the death
            if not (err.stdout or err.stderr):
                err.stdout = streams[1].text(len(streams[1].data))[0]
                err.stderr = streams[2].text(len(streams[2].data))[0]
            raise
        except BaseException:  # a Ctrl-C, a cancelled task, a sink that raised: nobody waits for it
            self._cancel(call.rid)
            raise
        raise exc.ProtocolError(f"{header['op']} ended without a report")  # pragma: no cover

    def _cancel(self, rid: int) -> None:
        """Have the supervisor end the command or run ``rid`` now (kill it, or take it from the
        queue), not at its timeout: the next call finds the sandbox idle. A supervisor of an
        older snapshot that knows no cancel lets it run to its timeout, as before."""
        if not self.channel.open:
            return
        with contextlib.suppress(exc.StockadeError, TimeoutError):
            self.channel.call({"op": "cancel", "req": rid}).result(time.monotonic() + CANCEL_S)

    def _approve(self, h: dict[str, Any], answer_by: float) -> None:
        """An exec inside waits for a human: ask the sandbox's approver, answer the supervisor.
        Past ``answer_by`` (the call's approval_wait_s spent) an async approver is given up."""
        (record,) = _rules_execs.exec_records({"execs": [h]})
        record = dataclasses.replace(record, own_code=h.get("own") is True)
        approver = self.spec.approver
        waiting = ANSWER_BY.set(answer_by)
        try:
            allow, why = answered(approver(record)) if approver is not None else (False, "")
        except Exception as error:  # an approver that fails says no
            allow, why = False, f"the approver raised {type(error).__name__}: {visible(str(error))[:200]}"
        finally:
            ANSWER_BY.reset(waiting)
        if allow and cut_requested():  # the caller gave up while the approver thought
            allow, why = False, "the call was cancelled while the approver was asked"
        if why:
            log.warning("sandbox %s: exec %s refused: %s", self.id, record.argv[:8], why)
        verdict: dict[str, Any] = {"op": "verdict", "req": int_field(h.get("req")), "allow": allow}
        if why:  # the supervisor shows it with the rule (the record, the program's stderr)
            verdict["why"] = why
        call = self.channel.call(verdict)
        with contextlib.suppress(TimeoutError):
            call.result(time.monotonic() + FILE_OP_TIMEOUT_S)

    def _run_command(self, op: RunCommand, sink: OutputSink | None) -> CommandResult:
        if not op.argv:
            raise exc.ConfigurationError("empty command")
        timeout = self._timeout(op.timeout_s)
        header = {
            "op": "exec",
            "argv": list(op.argv),
            "cwd": op.cwd,
            "env": dict(op.envs),
            "timeout": timeout,
            "stdin": op.stdin is not None,
        }
        oom_before, locks_before = self.boundary.oom_kills(), self.boundary.lock_kills()
        started = time.monotonic()
        final, streams, between = self._stream(header, op.stdin or b"", timeout, sink)
        if final is not None:
            return command_result(
                final[0], streams, lambda settle: self._oom_since(oom_before, settle=settle), between,
                locks_killed=self.boundary.lock_kills() > locks_before,
            )  # fmt: skip
        return timed_out_command(streams, time.monotonic() - started)

    def _oom_since(self, before: int | None, *, settle: bool) -> bool:
        """Whether the memory limit killed something since ``before``.

        Some counters lag the kill they count (a remote engine's events): when a process
        died of SIGKILL we did not send, give the counter a moment before saying no.
        """
        if before is None:
            return False
        for wait in (0.0, 0.05, 0.1, 0.2, 0.4) if settle else (0.0,):
            if wait:  # (a sleep of 0 still waits for the timer: ~90 us, every command)
                time.sleep(wait)
            after = self.boundary.oom_kills()
            if after is None:
                return False
            if after > before:
                return True
        return False

    # -- run_code -----------------------------------------------------------------------

    def _run_code(self, op: RunCode, sink: OutputSink | None) -> Execution:
        timeout = self._timeout(op.timeout_s)
        oom_before, locks_before = self.boundary.oom_kills(), self.boundary.lock_kills()
        started = time.monotonic()
        header = {"op": "code", "timeout": timeout}
        final, streams, between = self._stream(
            header, op.code.encode("utf-8", "surrogatepass"), timeout, sink
        )
        if final is not None:
            h, body = final
            payload = self.files.json_body(body, max_values=MAX_CODE_VALUES, what="run_code report")
            return execution(
                h, payload, streams, lambda settle: self._oom_since(oom_before, settle=settle), between,
                locks_killed=self.boundary.lock_kills() > locks_before,
            )  # fmt: skip
        return timed_out_execution(streams, time.monotonic() - started)
