"""The event each sandbox operation makes: its kind and attributes (``describe``; reads make
none), what its ``op_start`` keeps of it while it runs (``starting``), and what its end adds
(``outcome``) or its failure (``failure``). Values from values, no log: the wrappers of
``sandbox.py`` record them, in the order the operation goes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stockade import exceptions as exc
from stockade.audit.events import EventKind
from stockade.audit.redact import CodeText, Redactor
from stockade.audit.sandbox_texts import (
    capping,
    cut_word,
    digest,
    kept_text,
    program_text,
    text_attributes,
    words_attributes,
)
from stockade.sandbox.base import OpResult
from stockade.sandbox.ops import (
    MakeDir,
    Op,
    Pause,
    PutArchive,
    Remove,
    Reset,
    RunCode,
    RunCommand,
    TakeSnapshot,
    WriteFile,
    as_inline,
)
from stockade.types import CommandResult, Execution, Snapshot

__all__ = ["describe", "failure", "outcome", "starting"]


def describe(op: Op[Any], redactor: Redactor) -> tuple[EventKind, dict[str, object]] | None:
    """The event kind and attributes of an operation, or ``None`` for reads (not recorded)."""
    _cap = capping(redactor)
    match op:
        case RunCommand():
            attributes: dict[str, object] = {
                **words_attributes("argv", op.argv, redactor, argv=True),
                **({"cwd": None} if op.cwd is None else text_attributes("cwd", op.cwd, redactor)),
                **words_attributes("env_names", sorted(op.envs), redactor),
                "timeout_s": op.timeout_s,
                "stdin_bytes": None if op.stdin is None else len(op.stdin),
            }
            inline = as_inline(op)
            if op.stdin is not None and inline != tuple(op.argv):  # run_code's program, on stdin
                attributes.update(
                    program=_cap(program_text(inline[0], inline[-1])),
                    program_digest=digest(op.stdin),
                    language=inline[0],
                )
            return EventKind.COMMAND, attributes
        case RunCode():
            code = op.code.encode()
            return EventKind.RUN_CODE, {
                "code": _cap(CodeText(op.code)),
                "code_bytes": len(code),
                "code_digest": digest(code),
                "timeout_s": op.timeout_s,
            }
        case WriteFile():
            return EventKind.FILE_WRITE, {
                "op": "write",
                **text_attributes("path", op.path, redactor),
                "bytes": len(op.data),
                "digest": digest(op.data),
                "mode": oct(op.mode),
            }
        case PutArchive() if op.folder is not None:  # made as it is sent: no bytes to digest before
            return EventKind.FILE_WRITE, {
                "op": "put_archive",
                **text_attributes("path", op.path, redactor),
                **text_attributes("source", str(op.folder.source), redactor),
                **words_attributes("hide", op.folder.hide, redactor),
                **words_attributes("read", op.folder.read, redactor),
            }
        case PutArchive():
            return EventKind.FILE_WRITE, {
                "op": "put_archive",
                **text_attributes("path", op.path, redactor),
                "bytes": len(op.data),
                "digest": digest(op.data),
            }
        case MakeDir():
            return EventKind.FILE_WRITE, {"op": "make_dir", **text_attributes("path", op.path, redactor)}
        case Remove():
            return EventKind.FILE_REMOVE, {
                **text_attributes("path", op.path, redactor),
                "recursive": op.recursive,
            }
        case Reset():
            return EventKind.SANDBOX_RESET, {}
        case TakeSnapshot() | Pause():
            op_name = "pause" if isinstance(op, Pause) else "snapshot"
            return EventKind.SNAPSHOT_TAKE, {"op": op_name, "memory": op.memory, "store": op.store.label}
    return None


# What an op_start keeps of a command's argv (its words cut here, the first ones only): what
# was in flight, named. Of code, only its size and digest: the log redacts every text it
# records, at about half a microsecond a character, and describe's text is redacted already.
START_CAP = 256
START_WORDS = 16


def starting(kind: EventKind, attributes: Mapping[str, object]) -> dict[str, object] | None:
    """The ``op_start`` attributes of a command or ``run_code`` (from ``describe``'s); ``None``
    for the other ops, quick ones whose single event comes at their end."""
    if kind is EventKind.RUN_CODE:
        keep: tuple[str, ...] = ("code_bytes", "code_digest", "timeout_s")
    elif kind is EventKind.COMMAND:
        keep = ("cwd", "timeout_s", "language", "program_digest", "argv_digest")
    else:
        return None
    out: dict[str, object] = {"op": kind.value, **{k: attributes[k] for k in keep if k in attributes}}
    argv = attributes.get("argv")
    if isinstance(argv, list):
        argc = attributes.get("argv_count", len(argv))
        out.update(
            argv=[
                cut_word(word if isinstance(word, str) else str(word), START_CAP)
                for word in argv[:START_WORDS]
            ],
            argc=argc,
        )
    return out


def outcome(result: OpResult) -> dict[str, object]:
    if isinstance(result, Snapshot):
        return {"snapshot_id": result.id, "kind": result.kind.value, "size_bytes": result.size_bytes}
    if isinstance(result, CommandResult):
        return {
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "oom_killed": result.oom_killed,
            "locks_killed": result.locks_killed,
            "truncated": result.truncated,
            "stdout_bytes": result.stdout_bytes,
            "stderr_bytes": result.stderr_bytes,
            "signal": result.signal,
        }
    if isinstance(result, Execution):
        return {
            "error": None if result.error is None else result.error.name,
            "timed_out": result.timed_out,
            "truncated": result.truncated,
            "results": len(result.results),
            "stdout_bytes": len(result.logs.stdout.encode()),
            "stderr_bytes": len(result.logs.stderr.encode()),
        }
    return {}


def failure(error: BaseException, redactor: Redactor) -> dict[str, object]:
    """What failed, as an event keeps it: the message cut like any text (it may repeat what
    the caller gave: a path of a million characters, twice in the event before)."""
    retryable = isinstance(error, exc.StockadeError) and error.retryable
    return {
        "error": type(error).__name__,
        "error_message": kept_text(redactor, str(error)),
        "retryable": retryable,
    }
