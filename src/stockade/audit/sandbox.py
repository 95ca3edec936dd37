"""Audited sandboxes: a wrapper around any tier, not a flag on it.

``AuditedBackend(backend, log, run_id=...)`` records ``sandbox_start`` for each sandbox it
starts (and ``snapshot_restore`` when it started from a snapshot) and returns
``AuditedInstance``s, which record what changes or runs in the sandbox (snapshots taken too):
commands (argv and env *names*, never values, each capped as a whole with its digest; exit
code, duration, output sizes; a program run from standard input, as ``run_code`` runs bash or
node, capped, with its digest), ``run_code`` (the code, capped, and its digest), file writes
and removals, resets and ``sandbox_stop``; and, after a command or ``run_code``, each exec the
sandbox's rules judged inside (``exec``: its argv, capped the same way, the verdict and the
rule), in the order they happened; those what a call left running started while no call ran
come first with the next call's result, or are taken before a reset and at close
(``between``, of the call they followed). A command or ``run_code`` is also recorded as it
starts (``op_start``: the argv, cut; the code's size and digest), so a process killed while
one runs leaves in the trail what was in flight; the execs judged inside it are reported with
its result, and die with the process.
Reads are not recorded: they change nothing. A failed operation is recorded with its error
class and whether it was retryable, then re-raised.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from stockade import exceptions as exc
from stockade._cuts import plain
from stockade.audit.events import EventKind
from stockade.audit.log import AuditLog
from stockade.audit.redact import CodeText, Redactor, ShellText, flag_value
from stockade.sandbox.base import (
    Backend,
    Instance,
    OpResult,
    OutputSink,
    SandboxSpec,
    WrapperBackend,
    WrapperInstance,
)
from stockade.sandbox.ops import (
    MakeDir,
    Op,
    Pause,
    PutArchive,
    Remove,
    Reset,
    RunCode,
    RunCommand,
    TakeExecs,
    TakeSnapshot,
    WriteFile,
    as_inline,
)
from stockade.sandbox.supervisor.protocol import MAX_EXEC_RECORDS, MAX_EXEC_REPORT
from stockade.types import CommandResult, EgressRecord, ExecRecord, Execution, HostRule, JudgedExecs, Snapshot

__all__ = [
    "CHECK_CALL",
    "AuditedBackend",
    "AuditedInstance",
    "current_actor",
    "current_call",
    "exec_word",
    "program_text",
    "script_at",
]

# The tool call whose work runs now (set by the agent): the execs its code starts name it.
current_call: contextvars.ContextVar[str | None] = contextvars.ContextVar("stockade_call", default=None)
# the ``call_id`` of what the run's acceptance check runs (no tool call of the model's)
CHECK_CALL = "acceptance-check"
# Who makes the call that runs now, where that is not who started the sandbox (the service:
# any token of the sandbox's role may use it): its events name this actor, not the starter.
current_actor: contextvars.ContextVar[str | None] = contextvars.ContextVar("stockade_actor", default=None)

# What one event keeps of each text or list it copies from the caller (a command's argv, its
# env names, run_code's code, a program on stdin, a sandbox's hosts and names): at most this
# many characters, all its words together. Past it the event keeps the first and last
# KEPT_WORDS words, cut to a share of it, with the count, size and SHA-256 of the whole
# (``argv_count``, ``argv_bytes``, ``argv_digest``, ``argv_cut``), which prove what ran. Each
# word was once cut to it but all kept: 60,000 arguments of 14 characters made an event of 1 MB,
# for ever in the service's database and not counted in the tenant's storage_mb.
TEXT_CAP = 16 * 1024
KEPT_WORDS = 16
StepSource = Callable[[], int]

# What one call's exec events may take of the trail, its two frames together (those judged
# while no call ran, handed over with it, then its own): each frame keeps to MAX_EXEC_RECORDS
# and MAX_EXEC_REPORT, and together they made 1,299 KiB of events for a call, not the 768 KiB
# the README says. Past it counted (an ``omitted`` event). As in the sandbox's own report
# (supervisor/execrecords.py), the execs the rules let run take at most the first share, so that a
# loop of ``true`` cannot push a denied ``rm -r`` out.
EXEC_EVENTS = MAX_EXEC_RECORDS
EXEC_BYTES = MAX_EXEC_REPORT
EXEC_EVENTS_ALLOWED = EXEC_EVENTS - 100
EXEC_BYTES_ALLOWED = EXEC_BYTES - (128 << 10)


def _no_step() -> int:
    return 0


def _kept(redactor: Redactor, text: str) -> str:
    """``text`` redacted and cut to ``TEXT_CAP`` characters; a long one cut first, then
    redacted as the head of a longer text (``Redactor.head``): redacting a path of a million
    characters whole costs half a second. Every text a sandbox event copies says what was done,
    and nobody cut it: a cut mark in it is made plain (``plain``)."""
    text = plain(text)
    if len(text) <= TEXT_CAP:
        return redactor.cut(text, TEXT_CAP)
    return redactor.cut(text[:TEXT_CAP], TEXT_CAP, was_cut=True) + f"…[{len(text) - TEXT_CAP} more chars]"


def _text(name: str, text: str, redactor: Redactor) -> dict[str, object]:
    """The attributes recording one text copied from the caller under ``name`` (a path, a
    host folder): whole up to ``TEXT_CAP`` characters, past it cut, with the size and digest
    of the whole (``<name>_bytes``, ``<name>_digest``, ``<name>_cut``). A path was once kept
    whole: a files.remove of a 1,000,000-character path made an event of 3 MB."""
    if len(text) <= TEXT_CAP and len(whole := redactor.text(plain(text))) <= TEXT_CAP:
        return {name: whole}
    kept = _kept(redactor, text)
    raw = text.encode("utf-8", "surrogatepass")
    return {name: kept, f"{name}_bytes": len(raw), f"{name}_digest": _digest(raw), f"{name}_cut": True}


def _cut(redactor: Redactor) -> Callable[[str], str]:
    """Redact, then cut: a cut first can keep a credential's prefix that no pattern knows."""
    return lambda text: redactor.cut(type(text)(plain(text)), TEXT_CAP)


def program_text(runner: str, program: str) -> str:
    """A program ``runner`` runs (``bash``, ``python3``, a language of ``run_code``), as the
    redactor reads it: a shell's script word by word (``ShellText``), other code statement by
    statement (``CodeText``); as plain text, a value ran across quotes and ``;`` and hid the
    commands after it."""
    return ShellText(program) if runner.rsplit("/", 1)[-1] in _SHELLS else CodeText(program)


# How the sandbox ends a word of an exec it cut (``supervisor.execrecords.kept_argv``): its head, then this.
_WORD_CUT = re.compile(r"\[\.\.\. [0-9]+ more characters; the word is sha256 [0-9a-f]{64}\]\Z")


def exec_word(redactor: Redactor, word: str, script: bool = False) -> str:
    """A word of an exec the sandbox reported, redacted: a word it cut (to ``MAX_EXEC_WORD``
    characters, before any redactor saw it) may end with the head of a credential, which
    ``Redactor.head`` holds back; the sandbox's mark stays. ``script``: the word is a shell's
    script (``script_at``), redacted word by word (``Redactor.shell``)."""
    word = plain(word)
    mark = _WORD_CUT.search(word)
    if mark is None:
        return redactor.cut(ShellText(word) if script else word, TEXT_CAP)
    head = word[: mark.start()]
    kept = redactor.cut(ShellText(head) if script else head, TEXT_CAP, was_cut=True) + mark.group()
    return ShellText(kept) if script else kept


def _word(redactor: Redactor, word: str, script: bool = False) -> str:
    """A word of a list the caller gave, redacted (see ``exec_word``)."""
    word = plain(word)
    return redactor.text(ShellText(word) if script else word)


# The shells whose ``-c`` takes a script (``sh -c``, ``bash -lc``): what commands.run and the
# command tools run a command text with.
_SHELLS = frozenset({"sh", "bash", "dash", "ash", "ksh", "mksh", "zsh"})


def script_at(argv: Sequence[str]) -> int | None:
    """Where in ``argv`` the script of a shell's ``-c`` is (``["/bin/sh", "-c", SCRIPT]``, ``-lc``,
    ``-e -c``); ``None`` when it runs none."""
    if not argv or argv[0].rsplit("/", 1)[-1] not in _SHELLS:
        return None
    for at, word in enumerate(argv[1:], 1):
        if not word.startswith("-") or word == "--":
            return None
        if "c" in word[1:] and not word.startswith("--"):
            return at + 1 if at + 1 < len(argv) else None
    return None


def _cut_word(word: str, share: int) -> str:
    if len(word) <= share:
        return word
    kept = word[:share] + f"…[{len(word) - share} more chars]"
    return ShellText(kept) if isinstance(word, ShellText) else kept


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def words_json(words: Sequence[str]) -> bytes:
    """A list of words as the size and digest of a cut one are of: compact JSON, UTF-8."""
    return json.dumps(list(words), separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


def _words(
    name: str,
    words: Sequence[str],
    redactor: Redactor,
    redact: Callable[[str, bool], str] | None = None,
    *,
    argv: bool = False,
) -> dict[str, object]:
    """The attributes recording a list of words under ``name``: whole up to ``TEXT_CAP``
    characters (once redacted), past it its head and tail words, the longest cut first and
    alike, and the count, size and digest of the whole. Only the words kept are redacted (a
    word redacted whole, then cut: a cut first can keep a credential's prefix); ``redact``
    instead of ``redactor.text`` for words someone cut before (an exec's, ``exec_word``).
    ``argv``: the words are a command's, where a credential's flag may be one word and its
    value the next (``flag_value``), or a shell's script (``script_at``)."""
    redact = redact or partial(_word, redactor)
    script = script_at(words) if argv else None

    def one(at: int) -> str:
        hidden = flag_value(words, at) if argv and at else None
        return redact(words[at] if hidden is None else hidden, at == script)

    if sum(map(len, words)) <= TEXT_CAP:
        whole = [one(at) for at in range(len(words))]
        if sum(map(len, whole)) <= TEXT_CAP:
            return {name: whole}
    head = min(len(words), KEPT_WORDS)
    tail = min(len(words) - head, KEPT_WORDS)
    chosen = [one(at) for at in (*range(head), *range(len(words) - tail, len(words)))]
    share, room = TEXT_CAP, TEXT_CAP
    for at, n in enumerate(sorted(map(len, chosen))):  # the shortest whole, the rest cut alike
        if n > room // (len(chosen) - at):
            share = room // (len(chosen) - at)
            break
        room -= n
    kept = [_cut_word(word, share) for word in chosen]
    if omitted := len(words) - head - tail:
        kept.insert(head, f"…[{omitted} more words]")
    raw = words_json(words)
    return {
        name: kept,
        f"{name}_count": len(words),
        f"{name}_bytes": len(raw),
        f"{name}_digest": _digest(raw),
        f"{name}_cut": True,
    }


def describe(op: Op[Any], redactor: Redactor) -> tuple[EventKind, dict[str, object]] | None:
    """The event kind and attributes of an operation, or ``None`` for reads (not recorded)."""
    _cap = _cut(redactor)
    match op:
        case RunCommand():
            attributes: dict[str, object] = {
                **_words("argv", op.argv, redactor, argv=True),
                **({"cwd": None} if op.cwd is None else _text("cwd", op.cwd, redactor)),
                **_words("env_names", sorted(op.envs), redactor),
                "timeout_s": op.timeout_s,
                "stdin_bytes": None if op.stdin is None else len(op.stdin),
            }
            inline = as_inline(op)
            if op.stdin is not None and inline != tuple(op.argv):  # run_code's program, on stdin
                attributes.update(
                    program=_cap(program_text(inline[0], inline[-1])),
                    program_digest=_digest(op.stdin),
                    language=inline[0],
                )
            return EventKind.COMMAND, attributes
        case RunCode():
            code = op.code.encode()
            return EventKind.RUN_CODE, {
                "code": _cap(CodeText(op.code)),
                "code_bytes": len(code),
                "code_digest": _digest(code),
                "timeout_s": op.timeout_s,
            }
        case WriteFile():
            return EventKind.FILE_WRITE, {
                "op": "write",
                **_text("path", op.path, redactor),
                "bytes": len(op.data),
                "digest": _digest(op.data),
                "mode": oct(op.mode),
            }
        case PutArchive() if op.folder is not None:  # made as it is sent: no bytes to digest before
            return EventKind.FILE_WRITE, {
                "op": "put_archive",
                **_text("path", op.path, redactor),
                **_text("source", str(op.folder.source), redactor),
                **_words("hide", op.folder.hide, redactor),
                **_words("read", op.folder.read, redactor),
            }
        case PutArchive():
            return EventKind.FILE_WRITE, {
                "op": "put_archive",
                **_text("path", op.path, redactor),
                "bytes": len(op.data),
                "digest": _digest(op.data),
            }
        case MakeDir():
            return EventKind.FILE_WRITE, {"op": "make_dir", **_text("path", op.path, redactor)}
        case Remove():
            return EventKind.FILE_REMOVE, {**_text("path", op.path, redactor), "recursive": op.recursive}
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
                _cut_word(word if isinstance(word, str) else str(word), START_CAP)
                for word in argv[:START_WORDS]
            ],
            argc=argc,
        )
    return out


def _spell(rule: HostRule) -> str:
    text = rule.host + ("" if rule.ports == (80, 443) else ":" + ",".join(map(str, rule.ports)))
    return text + (" " + ",".join(rule.methods) if rule.methods else "")


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
        "error_message": _kept(redactor, str(error)),
        "retryable": retryable,
    }


def _egress_path(redactor: Redactor, path: str) -> str:
    """A request's path as the proxy reported it: one it shortened ends with "…" (a path on
    the wire is ASCII), and what is before may end with the head of a credential."""
    if path.endswith("…"):
        return redactor.head(path[:-1]) + "…"
    return path


class AuditedInstance(WrapperInstance):
    """Records every state-changing operation of ``inner`` into ``log`` under ``run_id``.

    ``step`` tells the current agent step (the agent loop passes its own counter).
    """

    def __init__(
        self,
        wrapped: Instance,
        log: AuditLog,
        *,
        run_id: str,
        step: StepSource = _no_step,
        actor: str = "sandbox",
    ) -> None:
        super().__init__(wrapped)
        self.log = log
        self.run_id = run_id
        self.step = step
        self.actor = actor
        self._started = time.perf_counter()
        self._ops = 0
        self._stopped = False
        self._last_call: str | None = None  # of the last command or run_code (``_record_execs``)

    def _record(self, kind: EventKind, duration_s: float, attributes: Mapping[str, object]) -> None:
        self.log.record(
            kind,
            run_id=self.run_id,
            step=self.step(),
            actor=current_actor.get() or self.actor,
            duration_s=duration_s,
            attributes={"sandbox_id": self.id, "tier": self.tier, **attributes},
        )

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        if isinstance(op, TakeExecs):  # each is handed over once: recorded as it is taken
            taken = self.wrapped.handle(op, sink)
            if isinstance(taken, JudgedExecs):
                self._record_execs(None, taken.execs, taken.execs_omitted)
            return taken
        ended = self._take_between() if isinstance(op, Reset) else None  # before the reset forgets them
        described = describe(op, self.log.redactor)
        if described is None:
            return self.wrapped.handle(op, sink)
        kind, attributes = described
        self.log.check()  # a trail that cannot be written: the action is not taken
        self._ops += 1
        begun = starting(kind, attributes)
        if begun is not None:  # a process killed while it runs leaves this (once the next batch is written)
            self._record(EventKind.OP_START, 0.0, {**begun, "call_id": current_call.get()})
        start = time.perf_counter()
        try:
            if ended is not None:
                raise ended
            result = self.wrapped.handle(op, sink)
        except BaseException as error:
            self._record(
                kind, time.perf_counter() - start, {**attributes, **failure(error, self.log.redactor)}
            )
            raise
        self._record(kind, time.perf_counter() - start, {**attributes, **outcome(result)})
        if isinstance(result, CommandResult | Execution):
            self._record_execs(kind, result.execs, result.execs_omitted)
            self._last_call = current_call.get()
        return result

    def _record_execs(self, kind: EventKind | None, execs: tuple[ExecRecord, ...], omitted: int) -> None:
        """What code started, as the sandbox's rules judged it: each an ``exec`` event of the
        call whose result listed it (``of`` its kind). One judged while no call ran
        (``between``) is the call's before which it came, after that of the last command or
        ``run_code`` (``call_id``: None before any)."""
        of = {"of": kind.value} if kind is not None else {}
        events = size = 0
        for judged in execs:
            attributes = {
                "sandbox_id": self.id,
                "tier": self.tier,
                **of,
                "call_id": self._last_call if judged.between or kind is None else current_call.get(),
                **({"between": True} if judged.between else {}),
                "path": self.log.redactor.cut(plain(judged.path), TEXT_CAP),
                **_words(
                    "argv", judged.argv, self.log.redactor, partial(exec_word, self.log.redactor), argv=True
                ),
                "verdict": judged.verdict,
                "rule": judged.rule,
            }
            one = len(json.dumps(attributes, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            allowed = judged.verdict == "allow"
            most_events = EXEC_EVENTS_ALLOWED if allowed else EXEC_EVENTS
            most_bytes = EXEC_BYTES_ALLOWED if allowed else EXEC_BYTES
            if events >= most_events or size + one > most_bytes:
                omitted += 1
                continue
            events, size = events + 1, size + one
            self._record(EventKind.EXEC, 0.0, attributes)
        if omitted:  # past what a report or this call's budget keeps: counted, never silently gone
            self._record(
                EventKind.EXEC,
                0.0,
                {
                    **of,
                    "call_id": current_call.get() if kind is not None else self._last_call,
                    "verdict": "omitted",
                    "count": omitted,
                },
            )

    def _take_between(self) -> exc.StockadeError | None:
        """The execs judged while no call ran that no result listed yet, into the trail:
        before a reset forgets them and at close (a sandbox that no longer answers keeps its
        own; one that judges none answers none). What ended the sandbox as they were taken
        (a broken protocol found then): the reset's own failure, recorded as its."""
        if not self.wrapped.alive:
            return None
        try:
            self.handle(TakeExecs(), None)
        except exc.StockadeError as error:
            return None if self.wrapped.alive else error
        return None

    def close(self) -> None:
        start = time.perf_counter()
        if not self._stopped:
            self._take_between()
        try:
            self.wrapped.close()
        finally:
            if not self._stopped:
                self._stopped = True
                self._record(
                    EventKind.SANDBOX_STOP,
                    time.perf_counter() - start,
                    {"lifetime_s": round(time.perf_counter() - self._started, 6), "recorded_ops": self._ops},
                )


class AuditedBackend(WrapperBackend):
    """Starts ``inner``'s sandboxes as ``AuditedInstance``s and records each start (or failure)."""

    def __init__(
        self,
        wrapped: Backend,
        log: AuditLog,
        *,
        run_id: str,
        step: StepSource = _no_step,
        actor: str = "sandbox",
    ) -> None:
        super().__init__(wrapped)
        self.log = log
        self.run_id = run_id
        self.step = step
        self.actor = actor

    def start(self, spec: SandboxSpec) -> AuditedInstance:
        limits = spec.limits
        attributes: dict[str, object] = {
            "tier": self.tier,
            "limits": {
                "memory_mb": limits.memory_mb,
                "cpus": limits.cpus,
                "pids": limits.pids,
                "timeout_s": limits.timeout_s,
                "disk_mb": limits.workspace_mb,
                "output_bytes": limits.output_bytes,
            },
            "network": {
                "enabled": spec.network.enabled,
                **_words("allow", [_spell(r) for r in spec.network.host_rules], self.log.redactor),
                # never values
                **_words("credential_names", [c.name for c in spec.network.credentials], self.log.redactor),
            },
            **_words("env_names", sorted(spec.envs), self.log.redactor),
            # a sandbox's labels as a list of name=value past the cap, like any list
            **(
                {"labels": dict(spec.labels)}
                if sum(len(k) + len(v) for k, v in spec.labels.items()) <= TEXT_CAP
                else _words("labels", [f"{k}={v}" for k, v in spec.labels.items()], self.log.redactor)
            ),
            "allow_weaker": spec.allow_weaker,
        }
        if spec.network.egress:
            spec = dataclasses.replace(spec, egress_observer=self._egress_observer(spec))
        start = time.perf_counter()
        try:
            instance = self.wrapped.start(spec)
        except BaseException as error:
            self.log.record(
                EventKind.SANDBOX_START,
                run_id=self.run_id,
                step=self.step(),
                actor=self.actor,
                duration_s=time.perf_counter() - start,
                attributes={**attributes, **failure(error, self.log.redactor)},
            )
            raise
        self.log.record(
            EventKind.SANDBOX_START,
            run_id=self.run_id,
            step=self.step(),
            actor=self.actor,
            duration_s=time.perf_counter() - start,
            attributes={
                **attributes,
                "sandbox_id": instance.id,
                "weakened": list(instance.enforcement.weakened),
            },
        )
        if spec.snapshot is not None:
            snap = spec.snapshot
            self.log.record(
                EventKind.SNAPSHOT_RESTORE,
                run_id=self.run_id,
                step=self.step(),
                actor=self.actor,
                duration_s=0.0,
                attributes={
                    "sandbox_id": instance.id,
                    "tier": self.tier,
                    "snapshot_id": snap.id,
                    "kind": snap.kind.value,
                    "source": snap.source,
                },
            )
        return AuditedInstance(instance, self.log, run_id=self.run_id, step=self.step, actor=self.actor)

    def _egress_observer(self, spec: SandboxSpec) -> Callable[[EgressRecord], None]:
        """Each request through the sandbox's proxy, as an ``egress`` event when it ends, and
        a spliced tunnel also as an ``egress_open`` as it opens (a kind of its own: ``egress``
        events stay one per request, as ``tool_call_start`` and ``tool_call`` are), on the
        proxy's thread (the log queues it); then the observer the caller gave, if any."""
        then = spec.egress_observer

        def observe(record: EgressRecord) -> None:
            self.log.record(
                EventKind.EGRESS_OPEN if record.phase == "open" else EventKind.EGRESS,
                run_id=self.run_id,
                step=self.step(),
                actor=self.actor,
                duration_s=record.duration_s,
                attributes={
                    "call_id": current_call.get(),
                    **{
                        k: v
                        for k, v in dataclasses.asdict(record).items()
                        if k not in ("duration_s", "credential", "path", "phase")
                    },
                    "path": _egress_path(self.log.redactor, record.path),
                    # its name: a key named "credential" is redacted as if it held the secret
                    "credential_name": record.credential,
                },
            )
            if then is not None:
                then(record)

        return observe
