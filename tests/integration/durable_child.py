"""A process that runs (or resumes) one durable agent run for ``test_runs_durable``, and may be
SIGKILLed on the way: by itself at a named point, or by the test at any moment.

    python durable_child.py start|resume STORE_URL NAMESPACE RUN_ID WORK_DIR KILL_POINT

``KILL_POINT`` is ``none`` or ``WHAT:N`` (the N-th time, in this process): ``model`` (inside a
model request), ``step`` (after a step's checkpoint), ``returned`` (right after a tool call
returned), ``before`` / ``after`` (inside a slow tool, before or after its effect), ``end`` (as
the run ends: after its final answer and its diff, before the audit trail's last batch is
written, the window a kill at exit can hit), ``ended`` (after the end's last batch is written,
before the checkpoint that says the run ended), ``rejected`` (after a call rejected as invalid
is written to the trail, before the checkpoint that puts it in the ledger). The test may
also kill the process at a random moment (it waits for ``WORK_DIR/started``).

The run: six steps over three kinds of tools.

- ``pay`` (not idempotent) and ``notify`` (idempotent) act outside the sandbox: each appends a
  line to a host file in ``WORK_DIR``, the side effect whose count the test checks;
- ``append_journal`` (not idempotent) appends a line to ``journal.txt`` in the sandbox, and
  ``write_file`` (idempotent) writes a file: the changes the final diff must hold once each.
- once, the model misspells a tool (``append_jornal``): a call rejected as invalid, which it
  takes as answered (it asks for the right tool in the same step).

The model is a function of the conversation, as a careful model would behave: it does the
plan's calls in order, and when told a call's outcome is unknown it checks before doing it
again (``payment_status`` for a payment; the workspace is as the last finished call left it,
so a sandbox change is simply redone).

Exit codes: 0 the run ended (a JSON report on stdout), 3 RunLeased (another process runs it),
4 RunConflict (it ended, or the id is taken), 5 no checkpoint yet (start it again).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from stockade import Sandbox
from stockade.agent import Agent, AgentEvent, RunFinished, StepFinished, ToolRejected, ToolReturned
from stockade.audit import AuditLog, open_store
from stockade.audit.agent import AuditObserver
from stockade.exceptions import ConfigurationError, RunConflict, RunLeased
from stockade.models.messages import (
    AssistantMessage,
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolResultMessage,
)
from stockade.models.scripted import FunctionModel
from stockade.runs import RunRecorder, open_run_store
from stockade.tools import ToolContext, default_toolset, tool

mode, url, namespace, run_id, work, kill_point = sys.argv[1:7]
WORK = Path(work)
WHAT, _, NTH = kill_point.partition(":")
counts: dict[str, int] = {}


def maybe_die(what: str) -> None:
    counts[what] = counts.get(what, 0) + 1
    if what == WHAT and counts[what] == int(NTH or 0):
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush, no checkpoint


def slow_effect(effect: Callable[[], object]) -> None:
    time.sleep(0.02)
    maybe_die("before")
    effect()
    maybe_die("after")
    time.sleep(0.02)


def _append_host(name: str, line: str) -> None:
    with (WORK / name).open("a", encoding="utf-8") as log:
        log.write(line + "\n")
        log.flush()
        os.fsync(log.fileno())


@tool
def pay(ctx: ToolContext, invoice: str) -> str:
    """Pay an invoice (a side effect outside the sandbox; not idempotent).

    Args:
        invoice: the invoice number.
    """
    slow_effect(lambda: _append_host("payments.log", f"{invoice} {ctx.idempotency_key}"))
    return f"paid {invoice}"


@tool(idempotent=True)
def notify(ctx: ToolContext, message: str) -> str:
    """Send a notice (outside the sandbox; idempotent: the receiver deduplicates by key).

    Args:
        message: the text.
    """
    slow_effect(lambda: _append_host("notices.log", f"{message} {ctx.idempotency_key}"))
    return "sent"


@tool(idempotent=True)
def payment_status(ctx: ToolContext, invoice: str) -> str:
    """Whether an invoice was paid.

    Args:
        invoice: the invoice number.
    """
    paid = WORK / "payments.log"
    lines = paid.read_text().splitlines() if paid.exists() else []
    return "paid" if any(line.split()[0] == invoice for line in lines) else "not paid"


@tool
def append_journal(ctx: ToolContext, line: str) -> str:
    """Append a line to journal.txt in the workspace (not idempotent).

    Args:
        line: the line.
    """
    files = ctx.sandbox.files
    old = files.read("journal.txt") if files.exists("journal.txt") else ""
    slow_effect(lambda: files.write("journal.txt", old + line + "\n"))
    return f"appended {line!r}"


PLAN: list[list[tuple[str, dict[str, str]]]] = [
    [("write_file", {"path": "steps/1.txt", "content": "one\n"}), ("append_journal", {"line": "1"})],
    [("pay", {"invoice": "inv-1"})],
    [("notify", {"message": "paid-inv-1"}), ("append_journal", {"line": "2"})],
    [("write_file", {"path": "steps/4.txt", "content": "four\n"}), ("pay", {"invoice": "inv-2"})],
    [("append_jornal", {"line": "3"}), ("append_journal", {"line": "3"})],  # the first: no such tool
    [("notify", {"message": "all-paid"})],
]


def _key(name: str, args: dict[str, object]) -> str:
    return name + json.dumps(args, sort_keys=True)


async def careful_model(request: ModelRequest) -> ModelResponse:
    maybe_die("model")
    await asyncio.sleep(0.01)
    calls: dict[str, ToolCall] = {}
    done: set[str] = set()
    unknown: dict[str, ToolCall] = {}  # payments whose outcome is unknown and not yet checked
    turns = 0
    for message in request.messages:
        if isinstance(message, AssistantMessage):
            turns += 1
            calls.update({c.id: c for c in message.tool_calls})
        elif isinstance(message, ToolResultMessage):
            call = calls[message.call_id]
            key = _key(call.name, dict(call.args))
            if call.name == "payment_status":
                pay_key = _key("pay", dict(call.args))
                unknown.pop(pay_key, None)
                if message.content == "paid":
                    done.add(pay_key)
            elif not message.is_error or "there is no tool" in message.content:
                done.add(key)  # a misspelt tool is asked for once: the same step has the right one
            elif "OutcomeUnknown" in message.content and call.name == "pay":
                unknown[key] = call
    if unknown:  # check before paying again
        ask = [
            ToolCall(id=f"t{turns}_{k}", name="payment_status", args=dict(c.args))
            for k, c in enumerate(unknown.values())
        ]
        return ModelResponse(tool_calls=tuple(ask), finish_reason="tool_calls")
    for turn in PLAN:
        todo = [(name, args) for name, args in turn if _key(name, dict(args)) not in done]
        if todo:
            ask = [ToolCall(id=f"t{turns}_{k}", name=n, args=dict(a)) for k, (n, a) in enumerate(todo)]
            return ModelResponse(tool_calls=tuple(ask), finish_reason="tool_calls")
    return ModelResponse(text="all done", finish_reason="stop")


def ending(event: AgentEvent) -> None:
    """Before the audit observer: a kill here loses the events it has not written yet."""
    if isinstance(event, RunFinished):
        maybe_die("end")


def written(log: AuditLog) -> Callable[[AgentEvent], None]:
    """After the audit observer: a kill here finds the trail ahead of the run's checkpoints."""

    def observe(event: AgentEvent) -> None:
        if isinstance(event, ToolRejected):
            log.flush()  # the interval's batch, come early: the rejection is in the trail
            maybe_die("rejected")
        elif isinstance(event, RunFinished):
            maybe_die("ended")  # the audit observer flushed the end's batch

    return observe


def observe(event: AgentEvent) -> None:
    if isinstance(event, StepFinished):
        maybe_die("step")
    elif isinstance(event, ToolReturned):
        maybe_die("returned")


def main() -> int:
    store = open_run_store(url, namespace=namespace)
    audit_store = open_store(url, namespace=f"{namespace}_audit")
    log = AuditLog(audit_store)
    agent = Agent(
        FunctionModel(careful_model),
        tools=default_toolset().including(pay, notify, payment_status, append_journal),
        checkpointer=store,
        observers=[ending, AuditObserver(log), RunRecorder(store), written(log), observe],
    )
    started = time.perf_counter()
    with Sandbox.create("process", workspace=WORK / "seed") as sandbox:
        (WORK / "started").touch()
        try:
            if mode == "start":
                result = agent.run_sync("pay the invoices", sandbox=sandbox, run_id=run_id)
            else:
                result = agent.run_sync(resume=run_id, sandbox=sandbox)
        except RunLeased as error:
            print(f"leased: {error}", file=sys.stderr)
            return 3
        except RunConflict as error:
            print(f"conflict: {error}", file=sys.stderr)
            return 4
        except ConfigurationError as error:
            print(f"no checkpoint: {error}", file=sys.stderr)
            return 5
        finally:
            log.close()
    print(
        json.dumps(
            {
                "status": result.status.value,
                "diff": result.diff,
                "error": result.error,
                "seconds": time.perf_counter() - started,
            }
        )
    )
    store.close()
    audit_store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
