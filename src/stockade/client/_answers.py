"""What the clients read back from the service: its JSON turned into the SDK's values
(``CommandResult``, ``Execution``, ``EntryInfo``, ``Listing``, ``Enforcement``, ``Snapshot``),
a streamed command's lines, and how large a result may be. Apart from the requests: both
clients, sync and asyncio, read the same answers, and a field the service left out or sent
of another type is ``ServiceError`` here, whichever client asked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from stockade import exceptions as exc
from stockade.client._http import ANSWER_MAX_BYTES, error_from
from stockade.sandbox.ops import LISTING_TRUNCATED_HEADER, ReadFile
from stockade.types import (
    CommandResult,
    Enforcement,
    EntryInfo,
    EntryType,
    ExecRecord,
    Execution,
    ExecutionError,
    HostShare,
    Limits,
    Listing,
    Logs,
    Mechanism,
    Result,
    Snapshot,
    SnapshotKind,
)

__all__ = [
    "TextCallback", "command_result", "ended_without_result", "enforcement", "entry", "execution", "listing",
    "result_max_bytes", "snapshot_value", "streamed_line",
]  # fmt: skip

TextCallback = Callable[[str], object]
_T = TypeVar("_T")


def _decoder(function: Callable[[Any], _T]) -> Callable[[Any], _T]:
    """``function`` turning a field the service left out or sent of another type (a hostile or
    broken service: KeyError, TypeError, ValueError) into ``ServiceError``: the same request
    gets the same answer, so retrying cannot help."""

    @functools.wraps(function)
    def decode(data: Any) -> _T:
        try:
            return function(data)
        except exc.StockadeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise exc.ServiceError(
                f"the service sent an answer the client cannot use ({function.__name__}): {error!r}"
            ) from None

    return decode


def _execs(data: Mapping[str, Any]) -> dict[str, Any]:
    """A result's ``execs`` as ``ExecRecord``s (JSON gives dicts and lists) and its count of
    those left out."""
    names = {f.name for f in dataclasses.fields(ExecRecord)}
    records: list[ExecRecord] = []
    for record in data.get("execs") or ():
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in names
        }
        records.append(ExecRecord(**fields))
    return {"execs": tuple(records), "execs_omitted": int(data.get("execs_omitted", 0))}


@_decoder
def command_result(data: Mapping[str, Any]) -> CommandResult:
    fields = {f.name for f in dataclasses.fields(CommandResult)} - {"execs", "execs_omitted"}
    return CommandResult(**{k: v for k, v in data.items() if k in fields}, **_execs(data))


@_decoder
def execution(data: Mapping[str, Any]) -> Execution:
    error = data.get("error")
    return Execution(
        results=tuple(Result(data=dict(r["data"])) for r in data.get("results", ())),
        logs=Logs(**data.get("logs", {})),
        error=ExecutionError(**error) if error else None,
        duration_s=float(data.get("duration_s", 0.0)),
        timed_out=bool(data.get("timed_out", False)),
        truncated=bool(data.get("truncated", False)),
        **_execs(data),
    )


@_decoder
def entry(data: Mapping[str, Any]) -> EntryInfo:
    return EntryInfo(
        path=data["path"], name=data["name"], type=EntryType(data["type"]), size=int(data["size"]),
        mode=int(data["mode"]), mtime=float(data["mtime"]), ctime_ns=int(data.get("ctime_ns", 0)),
        inode=int(data.get("inode", 0)), lossy=data.get("lossy") is True,
    )  # fmt: skip


def listing(data: Sequence[Mapping[str, Any]], headers: Mapping[str, str]) -> Listing:
    """A listing from the service: its entries, cut where the service's header says so."""
    return Listing((entry(e) for e in data), truncated=headers.get(LISTING_TRUNCATED_HEADER) == "true")


@_decoder
def enforcement(data: Mapping[str, Any]) -> Enforcement:
    host = data.get("host")
    names = ("memory", "cpus", "pids", "disk", "network", "timeout", "files", "ptys")
    return Enforcement(
        **{name: Mechanism(data[name]) for name in names if name in data},
        host=HostShare(**host) if host else None,
        weakened=tuple(data.get("weakened", ())),
        timeout_margin_s=float(data.get("timeout_margin_s", Enforcement.timeout_margin_s)),
    )


def snapshot_value(data: Mapping[str, Any], url: str) -> Snapshot:
    """A snapshot the service keeps (``store`` is the service's URL: it never leaves it)."""
    return Snapshot(
        id=str(data["id"]), kind=SnapshotKind(data["kind"]), tier=str(data["tier"]),
        source=str(data.get("source", "")), taken_at=float(data.get("taken_at", 0.0)),
        size_bytes=int(data.get("size_bytes", 0)), store=url,
    )  # fmt: skip


def streamed_line(
    line: str, on_stdout: TextCallback | None, on_stderr: TextCallback | None
) -> dict[str, Any] | None:
    """One NDJSON line of a streamed command: output to its callback (None), the result (the
    result), or the problem that ended it (raised as the SDK's error)."""
    if not line:
        return None
    try:
        item = json.loads(line)
    except ValueError:
        item = None
    if not isinstance(item, dict):
        raise exc.ServiceError("the service sent a line of a stream that is no JSON object")
    kind = item.get("type")
    if kind in ("stdout", "stderr"):
        callback = on_stdout if kind == "stdout" else on_stderr
        if callback is not None and isinstance(item.get("data"), str):
            callback(item["data"])
        return None
    if kind == "result" and isinstance(item.get("result"), dict):
        result: dict[str, Any] = item["result"]
        return result
    if kind == "error" and isinstance(item.get("problem"), dict):
        problem = item["problem"]
        status = problem.get("status")
        raise error_from(problem, status if isinstance(status, int) and not isinstance(status, bool) else 500)
    if kind in ("result", "error"):
        raise exc.ServiceError(f"the service sent a {kind} line without its {kind}")
    return None


def result_max_bytes(info: Mapping[str, Any]) -> int:
    """What a command's or a ``run_code``'s result may take as JSON: its stdout, its stderr
    and a ``run_code``'s results, each up to the sandbox's ``output_bytes`` (as the service
    said it), each byte up to six escaped (``\\u0000``); at most a file read's cap."""
    limits = info.get("limits")
    output = limits.get("output_bytes") if isinstance(limits, Mapping) else None
    if isinstance(output, bool) or not isinstance(output, int) or output < 1:
        output = Limits().output_bytes
    return min(ReadFile.max_bytes, ANSWER_MAX_BYTES + 3 * 6 * output)


def ended_without_result() -> exc.ServiceUnavailable:
    return exc.ServiceUnavailable("the service ended the stream without a result")
