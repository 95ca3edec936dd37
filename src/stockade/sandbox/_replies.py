"""What the supervisor answers, decoded: every field is data from inside the sandbox.

``SupervisedInstance`` sends the requests and waits; this module turns its replies into the
values callers get (``CommandResult``, ``Execution``, ``EntryInfo``, the ``WorkspaceError``
a refusal names), trusting no field: a wrong type reads as zero or empty, and the output
kept is what the host counted, never more than its cap.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _rules_execs
from stockade.sandbox.ops import Area
from stockade.sandbox.supervisor.protocol import MAX_NAME, MAX_TEXT, MAX_VALUE
from stockade.types import (
    CommandResult,
    EntryInfo,
    EntryType,
    Execution,
    ExecutionError,
    JudgedExecs,
    Logs,
    Result,
)

__all__ = [
    "WORKSPACE_ERRORS",
    "OutputCollector",
    "area_args",
    "command_result",
    "entry_info",
    "execution",
    "int_field",
    "timed_out_command",
    "timed_out_execution",
    "truncation_marker",
]

# What a refusal of a file operation raises, by the kind the supervisor names.
WORKSPACE_ERRORS: dict[str, type[exc.WorkspaceError]] = {
    "escape": exc.PathEscapeError,
    "missing": exc.SandboxFileNotFound,
    "type": exc.FileTypeError,
    "too_large": exc.FileTooLarge,
    "listing": exc.ListingTooLarge,
    "deep": exc.TreeTooDeep,
    "long_path": exc.PathTooLong,
    "full": exc.WorkspaceFull,
}

# Whether the memory limit killed something since the call began (``settle``: wait for a
# counter that lags the kill it counts).
OomCheck = Callable[[bool], bool]
# A result's text as the interpreter sends it: MAX_TEXT characters and an ellipsis, then its
# notes of MIME values dropped (their names are the code's: room for a few dozen).
_RESULT_TEXT = MAX_TEXT + (64 << 10)


def truncation_marker(shown: int, total: int) -> str:
    return f"\n[stockade: output truncated: showing {shown} of {total} bytes]\n"


class OutputCollector:
    """Accumulates one stream of output up to the cap, decoding for callbacks as it comes."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()

    def add(self, chunk: bytes) -> bytes:
        room = self.cap - len(self.data)
        part = chunk[: max(room, 0)]
        self.data += part
        return part

    def text(self, total: int) -> tuple[str, bool]:
        out = self.data.decode("utf-8", "replace")
        if total > len(self.data):
            return out + truncation_marker(len(self.data), total), True
        return out, False


def area_args(area: Area) -> dict[str, str]:
    """The protocol's ``root`` for an area (the workspace is the default: no key)."""
    return {} if area == "workspace" else {"root": area}


def int_field(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def float_field(value: Any) -> float:
    """A number the supervisor sent, or 0.0 for anything else (a word, a list, NaN)."""
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**1000:  # fits a float
        return float(value)
    return 0.0


def entry_info(raw: Any) -> EntryInfo:
    if not isinstance(raw, dict):
        raise exc.ProtocolError(f"malformed entry {raw!r}")
    try:
        kind = EntryType(str(raw.get("type")))
    except ValueError:
        kind = EntryType.OTHER
    return EntryInfo(
        path=str(raw.get("path", "")),
        name=str(raw.get("name", "")),
        type=kind,
        size=int_field(raw.get("size")),
        mode=int_field(raw.get("mode")),
        mtime=float_field(raw.get("mtime")),
        ctime_ns=max(int_field(raw.get("ctime_ns")), 0),
        inode=max(int_field(raw.get("inode")), 0),
        lossy=raw.get("lossy") is True,
    )


def judged_execs(final: dict[str, Any], between: dict[str, Any] | None) -> JudgedExecs:
    """The execs a call's report lists: first those judged while no call ran, which the
    supervisor handed over in a frame of their own just before it (``between``), then the
    call's own; the count of those past what each frame keeps."""
    before = JudgedExecs() if between is None else judged_between(between)
    own = _rules_execs.exec_records(final)
    omitted = max(0, int_field(final.get("exec_count")) - len(own))
    return JudgedExecs(execs=before.execs + own, execs_omitted=before.execs_omitted + omitted)


def judged_between(h: dict[str, Any]) -> JudgedExecs:
    """The execs judged while no call ran, as a ``between`` frame or a ``TakeExecs`` answer
    hands them over."""
    execs = _rules_execs.exec_records(h, between=True)
    return JudgedExecs(execs=execs, execs_omitted=max(0, int_field(h.get("exec_count")) - len(execs)))


def command_result(
    h: dict[str, Any],
    streams: dict[int, OutputCollector],
    oom_since: OomCheck,
    between: dict[str, Any] | None = None,
    *,
    locks_killed: bool = False,
) -> CommandResult:
    """A command's report (``exit``), with the output the host collected (and ``between``:
    the execs judged while no call ran, handed over before it); ``locks_killed``: the host
    killed a process of it for its file locks (a SIGKILL that is no memory limit's)."""
    out_total = max(int_field(h.get("stdout_bytes")), len(streams[1].data))
    err_total = max(int_field(h.get("stderr_bytes")), len(streams[2].data))
    out, out_cut = streams[1].text(out_total)
    err, err_cut = streams[2].text(err_total)
    sig = h.get("signal")
    killed = (sig == 9 or int_field(h.get("exit_code")) == 137) and not h.get("timed_out")
    # The counters are the whole sandbox's: a kill during the call is this call's only if the
    # command itself died of a SIGKILL we did not send (a concurrent command's hog once had
    # a sleeping `echo` that exited 0 reported oom_killed). A sandbox with a kernel of its own
    # (the microVM) counts its OOM kills itself.
    oom = killed and (int_field(h.get("oom_kills")) > 0 or oom_since(not locks_killed))
    return CommandResult(
        exit_code=int_field(h.get("exit_code")),
        stdout=out,
        stderr=err,
        duration_s=float_field(h.get("duration")),
        timed_out=bool(h.get("timed_out")),
        oom_killed=oom,
        locks_killed=locks_killed,
        truncated=out_cut or err_cut,
        stdout_bytes=out_total,
        stderr_bytes=err_total,
        signal=sig if isinstance(sig, int) else None,
        execs=(judged := judged_execs(h, between)).execs,
        execs_omitted=judged.execs_omitted,
    )


def timed_out_command(streams: dict[int, OutputCollector], duration_s: float) -> CommandResult:
    """A command whose sandbox was killed when the supervisor missed its deadline."""
    out, out_cut = streams[1].text(len(streams[1].data))
    err, _ = streams[2].text(len(streams[2].data))
    return CommandResult(
        exit_code=137,
        stdout=out,
        stderr=err,
        duration_s=duration_s,
        timed_out=True,
        truncated=out_cut,
        signal=9,
        stdout_bytes=len(streams[1].data),
        stderr_bytes=len(streams[2].data),
    )


def execution(
    h: dict[str, Any],
    payload: Any,
    streams: dict[int, OutputCollector],
    oom_since: OomCheck,
    between: dict[str, Any] | None = None,
    *,
    locks_killed: bool = False,
) -> Execution:
    """A ``run_code`` report (``result``: its header and its JSON payload, already bounded;
    ``between`` and ``locks_killed`` as for ``command_result``)."""
    out, out_cut = streams[1].text(max(int_field(h.get("stdout_bytes")), len(streams[1].data)))
    err, err_cut = streams[2].text(max(int_field(h.get("stderr_bytes")), len(streams[2].data)))
    if not isinstance(payload, dict):
        raise exc.ProtocolError("malformed run_code report")
    raw_results = payload.get("results") or []
    if not isinstance(raw_results, list):
        raise exc.ProtocolError("malformed run_code report: its results are no list")
    results, cut = _results(raw_results)
    cut = cut or payload.get("truncated") is True  # the interpreter cut it to output_bytes
    error = None
    raw_err = payload.get("error")
    if isinstance(raw_err, dict):
        name, name_cut = _capped(str(raw_err.get("name", "Error")), MAX_NAME)
        value, value_cut = _capped(str(raw_err.get("value", "")), MAX_TEXT)
        traceback, tb_cut = _capped(str(raw_err.get("traceback", "")), MAX_TEXT, end=True)
        cut = cut or name_cut or value_cut or tb_cut
        # Whether the interpreter died is the supervisor's word, in the header it writes; the
        # error's name is the code's exception's (``class KernelDied(Exception)`` raised after
        # a child's OOM kill read as MemoryLimitExceeded, "its state is lost", state intact).
        died = h.get("verdict") == "KernelDied"
        guest_oom = int_field(h.get("oom_kills")) > 0
        if died and locks_killed:
            value = "the interpreter was killed for holding more file locks than a sandbox may (4,096)"
            name = "FileLockLimitExceeded"
        elif died and (guest_oom or oom_since(True)):
            value = "the interpreter was killed by the sandbox's memory limit; its state is lost"
            name = "MemoryLimitExceeded"
        error = ExecutionError(name=name, value=value, traceback=traceback)
    return Execution(
        results=tuple(results),
        logs=Logs(stdout=out, stderr=err),
        error=error,
        duration_s=float_field(h.get("duration")),
        timed_out=bool(h.get("timed_out")),
        truncated=out_cut or err_cut or cut,
        execs=(judged := judged_execs(h, between)).execs,
        execs_omitted=judged.execs_omitted,
    )


def _results(raw_results: list[Any]) -> tuple[list[Result], bool]:
    """The results of a report, held to the interpreter's caps whatever the report says (code
    can write one of its own: it carried 96 MiB of text): a text past MAX_TEXT cut, a MIME value
    past MAX_VALUE dropped with a note, as the interpreter does. Whether any was cut."""
    results, cut = [], False
    for raw in raw_results:
        if not isinstance(raw, dict):
            continue
        bundle = {str(k): str(v) for k, v in raw.items()}
        for mime in [m for m, v in bundle.items() if len(v) > MAX_VALUE and m != "text/plain"]:
            size = len(bundle.pop(mime))
            note = f"\n[stockade: {mime} dropped: {size} characters, over the cap]"
            bundle["text/plain"] = bundle.get("text/plain", "") + note
            cut = True
        if len(bundle.get("text/plain", "")) > _RESULT_TEXT:
            bundle["text/plain"], _ = _capped(bundle["text/plain"], MAX_TEXT)
            cut = True
        results.append(Result(bundle))
    return results, cut


def _capped(text: str, cap: int, *, end: bool = False) -> tuple[str, bool]:
    """``text`` up to ``cap`` characters and the interpreter's ellipsis (its head, or with
    ``end`` its end), and whether it was longer."""
    if len(text) <= cap + 1:
        return text, False
    return ("…" + text[-cap:] if end else text[:cap] + "…"), True


def timed_out_execution(streams: dict[int, OutputCollector], duration_s: float) -> Execution:
    """A ``run_code`` whose sandbox was killed when the supervisor missed its deadline."""
    return Execution(
        logs=Logs(
            stdout=streams[1].text(len(streams[1].data))[0],
            stderr=streams[2].text(len(streams[2].data))[0],
        ),
        error=ExecutionError(
            name="TimeoutError", value="the sandbox stopped answering and was killed", traceback=""
        ),
        duration_s=duration_s,
        timed_out=True,
    )
