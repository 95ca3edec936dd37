"""The values the service's tables hand out (runs, sandboxes, API processes, placements), the
run statuses the service knows, and the conversions of a column's value every table shares.

Apart from the tables that read them, so that a module that only looks at a run (its status,
its row) needs none of the SQL.
"""

from __future__ import annotations

from dataclasses import dataclass

# The service's view of a run, before the run store has it and after it ended.
QUEUED = "queued"
# Runs that wait for something (a worker, an approval, a person): a kill-all ends them where
# they are, or a worker would start them right after.
WAITING = ("queued", "paused", "interrupted", "broken")
# where a worker may take a run up: a paused or broken one (``HELD``) waits for a person, who
# queues it (the approvals decided, POST /resume) before it is sent on
STARTABLE = ("queued", "interrupted", "running")
HELD = frozenset({"paused", "broken"})
TERMINAL = frozenset({"success", "check_failed", "max_steps", "budget", "killed", "denied", "error"})
ACTIVE = "('queued', 'running', 'interrupted')"  # what a tenant's runs quota counts (SQL)
ENDED = f"({', '.join(repr(status) for status in sorted(TERMINAL))})"  # TERMINAL (SQL)


@dataclass(frozen=True, kw_only=True)
class RunRow:
    run_id: str
    tenant: str
    role: str | None
    spec: dict[str, object]
    status: str
    error: str | None
    labels: dict[str, str]
    submitted_ns: int
    started_ns: int | None
    finished_ns: int | None
    attempts: int
    worker: str | None


@dataclass(frozen=True, kw_only=True)
class SandboxRow:
    sandbox_id: str
    tenant: str
    owner: str
    tier: str
    cpus: float
    memory_mb: int


@dataclass(frozen=True, kw_only=True)
class Node:
    """An API process: where its peers reach it, the key that marks their requests, and when
    it last said it was alive."""

    owner: str
    url: str
    hop_key: str
    beat_ns: int


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a sandbox is: its tenant, the process that holds it (``node`` None when that
    process has no row: it never registered, or was found dead), and ``ended`` when it was
    killed ("killed") or lost with its process ("lost")."""

    sandbox_id: str
    tenant: str
    owner: str
    node: Node | None
    ended: str | None = None


def as_int(value: object) -> int:
    return int(str(value))


def as_bytes(value: object) -> bytes:
    return bytes(value) if isinstance(value, bytes | bytearray | memoryview) else b""


def role_key(role: str | None) -> str:
    """A role as the workspaces table keys it ('': a token without one)."""
    return role or ""
