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

The wrappers are here; the event each operation makes is ``_op_events.py``'s, and what an
event keeps of a text or list the caller gave (``TEXT_CAP``, ``exec_word``, ``program_text``,
``script_at``) is ``sandbox_texts.py``'s, named here too.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from stockade import exceptions as exc
from stockade._cuts import plain
from stockade.audit._op_events import describe, failure, outcome, starting
from stockade.audit.events import EventKind
from stockade.audit.log import AuditLog
from stockade.audit.redact import Redactor
from stockade.audit.sandbox_texts import TEXT_CAP, exec_word, program_text, script_at, words_attributes
from stockade.sandbox.base import (
    Backend,
    Instance,
    OpResult,
    OutputSink,
    SandboxSpec,
    WrapperBackend,
    WrapperInstance,
)
from stockade.sandbox.ops import Op, Reset, TakeExecs
from stockade.sandbox.supervisor.protocol import MAX_EXEC_RECORDS, MAX_EXEC_REPORT
from stockade.types import CommandResult, EgressRecord, ExecRecord, Execution, HostRule, JudgedExecs

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


def _spell(rule: HostRule) -> str:
    text = rule.host + ("" if rule.ports == (80, 443) else ":" + ",".join(map(str, rule.ports)))
    return text + (" " + ",".join(rule.methods) if rule.methods else "")


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
                **words_attributes(
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
                **words_attributes("allow", [_spell(r) for r in spec.network.host_rules], self.log.redactor),
                # never values
                **words_attributes(
                    "credential_names", [c.name for c in spec.network.credentials], self.log.redactor
                ),
            },
            **words_attributes("env_names", sorted(spec.envs), self.log.redactor),
            # a sandbox's labels as a list of name=value past the cap, like any list
            **(
                {"labels": dict(spec.labels)}
                if sum(len(k) + len(v) for k, v in spec.labels.items()) <= TEXT_CAP
                else words_attributes(
                    "labels", [f"{k}={v}" for k, v in spec.labels.items()], self.log.redactor
                )
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
