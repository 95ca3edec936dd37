"""The API's request and response bodies. Requests forbid unknown fields: a misspelt field is
a 422 naming it, never silently ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from stockade._checks import MAX_COST_USD, MAX_TIMEOUT_S
from stockade.types import Limits, NetworkPolicy, Trust

__all__ = [
    "ApprovalDecision",
    "CodeRequest",
    "CommandRequest",
    "KillAllOut",
    "KillAllRequest",
    "KillRequest",
    "KilledRun",
    "LimitsIn",
    "NetworkIn",
    "RunLimitsIn",
    "RunOut",
    "RunSubmit",
    "SandboxCreate",
    "SandboxOut",
    "SnapshotOut",
    "SnapshotRequest",
    "WorkspaceOut",
]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsIn(_In):
    """``stockade.Limits``; a field left out keeps its default."""

    memory_mb: int | None = None
    cpus: float | None = None
    pids: int | None = None
    timeout_s: float | None = None
    disk_mb: int | None = None
    inodes: int | None = None
    tmp_mb: int | None = None
    output_bytes: int | None = None
    open_files: int | None = None
    ptys: int | None = None

    def build(self) -> Limits:
        return Limits(**self.model_dump(exclude_none=True))  # InvalidArgument names the field


class NetworkIn(_In):
    enabled: bool = False
    allow_hosts: tuple[str, ...] = ()

    def build(self) -> NetworkPolicy:
        return NetworkPolicy(enabled=self.enabled, allow_hosts=self.allow_hosts)


Labels = dict[str, str]


class SandboxCreate(_In):
    tier: str | None = Field(default=None, description="process, docker, gvisor or microvm; none: by trust")
    trust: Trust | None = Field(default=None, description="tightens the tenant policy's trust, never loosens")
    prefer: Literal["cheapest", "strongest"] | None = None
    limits: LimitsIn | None = None
    network: NetworkIn | None = None
    envs: dict[str, str] = {}
    allow_weaker: bool = False
    labels: Labels = Field(default_factory=dict, max_length=32)
    idle_timeout_s: float | None = Field(default=None, gt=0, description="closed after this long unused")
    snapshot: str | None = Field(
        default=None, pattern=r"^snap-[0-9a-f]{32}$",
        description="start from this snapshot of yours (its tier and settings unless others are given)",
    )  # fmt: skip


class SnapshotRequest(_In):
    memory: bool | None = Field(
        default=None,
        description="true: keep the processes' memory (422 on a tier that cannot); false: files only; "
        "null: memory where the tier can",
    )


class SnapshotOut(BaseModel):
    id: str
    kind: Literal["files", "memory"]
    tier: str
    source: str = Field(description="the sandbox it was taken from")
    taken_at: float
    size_bytes: int
    paused: str | None = Field(default=None, description="the paused sandbox it keeps: resume it by this id")


class SandboxOut(BaseModel):
    id: str
    tier: str
    tier_reason: str
    # paused: kept in the tenant's snapshot store until resumed (POST .../resume), no process
    # runs it; its enforcement is the one it had when a memory snapshot keeps it, else empty
    state: Literal["running", "killed", "paused"]
    limits: dict[str, JsonValue]
    enforcement: dict[str, JsonValue]
    # what it started from where its tier makes something ahead (the microVM: "ready image",
    # "boot image", "cold boot", "memory snapshot"); "" on other tiers and when paused
    started_from: str = ""
    labels: Labels
    idle_timeout_s: float
    created_at: float
    last_used_at: float


class CommandRequest(_In):
    cmd: str | list[str] = Field(description="a shell line (run by /bin/sh -c), or an argv list")
    cwd: str | None = None
    envs: dict[str, str] = {}
    timeout_s: float | None = Field(default=None, gt=0)
    stdin: str | None = None
    stream: bool = Field(default=False, description="stream the output as NDJSON lines while it runs")


class CodeRequest(_In):
    code: str
    language: str = "python"
    timeout_s: float | None = Field(default=None, gt=0)
    stream: bool = False


class WorkspaceOut(BaseModel):
    id: str = Field(description="the workspace's digest: give it as a run's `workspace`")
    bytes: int
    files: int


class WorkspaceInfo(BaseModel):
    id: str
    bytes: int
    uploaded_at: float


class RunLimitsIn(_In):
    max_steps: int = Field(default=30, ge=1, le=10_000)
    max_wall_s: float = Field(default=900.0, gt=0, le=7 * 86400)
    max_tokens: int = Field(default=1_000_000, ge=1, le=2**62)
    max_cost_usd: float | None = Field(default=None, gt=0, le=MAX_COST_USD)


class RunSubmit(_In):
    task: str = Field(min_length=1, max_length=100_000)
    model: str | None = Field(
        None, description="PROVIDER:NAME (openai:..., anthropic:...); `scripted` turns instead for tests"
    )
    scripted: list[JsonValue] | None = Field(
        None,
        description="a scripted model's turns (as in a scripted:FILE), instead of `model`",
        max_length=10_000,
    )
    workspace: str | None = Field(
        default=None, description="an uploaded workspace's id (POST /v1/workspaces)"
    )
    idempotency_key: str | None = Field(
        None, min_length=1, max_length=200,
        description="submitting again with the same key returns the run it made (a different spec: 409)",
    )  # fmt: skip
    tier: str | None = None
    trust: Trust | None = None
    limits: RunLimitsIn = RunLimitsIn()
    sandbox_limits: LimitsIn | None = None
    check: str | None = Field(default=None, description="the acceptance check: a command that must pass")
    check_timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)  # as the run would check it
    labels: Labels = Field(default_factory=dict, max_length=32)


class RunOut(BaseModel):
    run_id: str
    status: str
    task: str
    model: str
    labels: Labels
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    worker: str | None
    steps: int = 0
    tokens: int = 0
    cost_usd: float = 0.0
    answer: str | None = None
    error: str | None = None
    pending_approvals: list[dict[str, str]] = []


class ApprovalDecision(_In):
    decision: Literal["approve", "deny"]


class KillRequest(_In):
    reason: str = Field(default="killed through the API", max_length=500)


class KillAllRequest(_In):
    """Every live run of the caller's tenant; an admin token may name another ``tenant``, or
    ask for ``all_tenants``."""

    reason: str = Field(default="killed through the API (kill-all)", max_length=500)
    tenant: str | None = Field(default=None, description="another tenant's runs (an admin token only)")
    all_tenants: bool = Field(default=False, description="every tenant's runs (an admin token only)")


class KilledRun(BaseModel):
    run_id: str
    tenant: str | None
    where: str = Field(
        description="where the live run ran (its host and process), or what the run was waiting as "
        "(queued, paused, interrupted, broken): such a run ends at once"
    )


class KillAllOut(BaseModel):
    killed: list[KilledRun]
