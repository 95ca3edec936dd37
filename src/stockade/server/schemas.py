"""The API's request and response bodies. Requests forbid unknown fields: a misspelt field is
a 422 naming it, never silently ignored.

Every list, map and string a request takes is bounded by what the layer below would accept
anyway, and refused with a 422 before any work: a command past what the kernel executes (its
arguments and environment 2 MiB at most, one argument 128 KiB) used to be copied through the
policy, audit and channel layers, ~20 times its body's size, before the sandbox's channel
refused it. pydantic-core checks a list's or a map's length before validating its items, so a
long one costs nothing to refuse.

Nor may a request make the server build more than a few errors: pydantic makes one per item
that fails, and ``{"cmd": [1, 1, ...]}`` of 233,000 items (466 KB, within every bound) made as
many, ~3 s of the event loop and a 27 MB answer, while another tenant's GET waited. A list of
a request stops at its first bad item (``fail_fast``), ``Envs`` at its first value not a string,
and a body of more than ``MAX_UNKNOWN_FIELDS`` unknown fields is one error."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    JsonValue,
    StringConstraints,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from stockade._checks import MAX_COST_USD, MAX_TIMEOUT_S, check_acceptance
from stockade.exceptions import InvalidArgument
from stockade.policy.approval import MAX_PENDING
from stockade.types import Limits, NetworkPolicy, Trust, limits_from_fields

__all__ = [
    "MAX_ARGS",
    "MAX_ARGS_BYTES",
    "MAX_ARG_CHARS",
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


# The kernel's bounds on what one exec takes (fs/exec.c): each argument or NAME=value at most
# MAX_ARG_STRLEN (128 KiB, its NUL included), all of them with a pointer each at most 2 MiB
# (a quarter of the usual 8 MiB stack). A command past them never runs; the channel to the
# sandbox takes a request of at most 1 MiB anyway (the local SDK's InvalidArgument past it).
MAX_ARG_CHARS = 128 * 1024 - 1  # bytes, so characters too: each is at least one byte
MAX_ARGS_BYTES = 2 * 1024 * 1024
MAX_ARGS = MAX_ARGS_BYTES // 9  # an argument costs its pointer and its NUL at least: 233,016
MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_LABEL_NAME = 256
MAX_LABEL_VALUE = 4096
MAX_HOSTS = 1000
MAX_NAME_CHARS = 256  # a tier, a language, a model's name, a workspace's id

# past it, a body's unknown fields are one error, not one each
MAX_UNKNOWN_FIELDS = 20


def _string_values(value: Any) -> Any:
    """A map's first value that is not a string, as the one error of the map (pydantic has no
    ``fail_fast`` for a dict); its keys are strings in JSON."""
    if isinstance(value, dict):
        bad = next((k for k, v in value.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise PydanticCustomError(
                "string_type", "every value must be a string, and {name}'s is not",
                {"name": str(bad)[:100]},
            )  # fmt: skip
    return value


Arg = Annotated[str, StringConstraints(max_length=MAX_ARG_CHARS)]
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ARG_CHARS)]
Envs = Annotated[dict[EnvName, Arg], Field(max_length=MAX_ARGS), BeforeValidator(_string_values)]
Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
Labels = dict[str, str]
LabelsIn = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=MAX_LABEL_NAME)],
        Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE)],
    ],
    Field(max_length=32),
]


def _check_exec(argv: list[str], envs: dict[str, str]) -> None:
    """What the kernel counts of an exec's arguments and environment: each string's UTF-8
    (a character may take four bytes), its NUL, and a pointer to it."""
    words = [*argv, *(f"{k}={v}" for k, v in envs.items())]
    sizes = [len(w) if w.isascii() else len(w.encode(errors="replace")) for w in words]
    if max(sizes, default=0) > MAX_ARG_CHARS:
        raise ValueError(
            f"an argument or NAME=value takes {max(sizes):,} bytes, over the {MAX_ARG_CHARS:,} the kernel "
            "takes: pass large input through stdin or a file"
        )
    total = sum(sizes) + 9 * len(sizes)
    if total > MAX_ARGS_BYTES:
        raise ValueError(
            f"the command's arguments and environment take {total:,} bytes, over the {MAX_ARGS_BYTES:,} "
            "the kernel runs a command with: pass large input through stdin or a file"
        )


def _acceptance(value: str) -> str:
    """The SDK's rule for an acceptance check (no NUL, not blank), as a 422: a check that cannot
    run used to be queued and take a worker's slot, failing only when the run ended."""
    try:
        return check_acceptance(value)
    except InvalidArgument as bad:
        raise PydanticCustomError("acceptance_check", "{why}", {"why": str(bad)}) from None


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) > len(cls.model_fields) + MAX_UNKNOWN_FIELDS:
            unknown = [str(k)[:100] for k in data if k not in cls.model_fields]
            if len(unknown) > MAX_UNKNOWN_FIELDS:
                raise PydanticCustomError(
                    "extra_forbidden", "{count} unknown fields, the first: {first}",
                    {"count": f"{len(unknown):,}", "first": ", ".join(unknown[:5])},
                )  # fmt: skip
        return data


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
    approval_wait_s: float | None = None

    def build(self) -> Limits:
        # an older client sends its default inodes=65536 outright, meaning today's default
        return limits_from_fields(self.model_dump(exclude_none=True))  # InvalidArgument names the field


class NetworkIn(_In):
    enabled: bool = False
    allow_hosts: tuple[Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS + 8)], ...] = Field(
        default=(), max_length=MAX_HOSTS, fail_fast=True
    )  # a DNS name is at most 253 characters, then a port

    def build(self) -> NetworkPolicy:
        return NetworkPolicy(enabled=self.enabled, allow_hosts=self.allow_hosts)


class SandboxCreate(_In):
    tier: Name | None = Field(default=None, description="process, docker, gvisor or microvm; none: by trust")
    trust: Trust | None = Field(default=None, description="tightens the tenant policy's trust, never loosens")
    prefer: Literal["cheapest", "strongest"] | None = None
    limits: LimitsIn | None = None
    network: NetworkIn | None = None
    envs: Envs = {}
    allow_weaker: bool = False
    labels: LabelsIn = Field(default_factory=dict)
    idle_timeout_s: float | None = Field(default=None, gt=0, description="closed after this long unused")
    snapshot: str | None = Field(
        default=None, pattern=r"^snap-[0-9a-f]{32}$",
        description="start from this snapshot of yours (its tier and settings unless others are given)",
    )  # fmt: skip

    @model_validator(mode="after")
    def _fits_an_exec(self) -> SandboxCreate:
        _check_exec([], self.envs)  # each command of the sandbox is given them
        return self


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
    cmd: Annotated[
        Annotated[Arg, Tag("line")]
        | Annotated[list[Arg], Tag("argv"), Field(min_length=1, max_length=MAX_ARGS, fail_fast=True)],
        Discriminator(lambda v: "line" if isinstance(v, str) else "argv"),  # one branch's errors, not both
    ] = Field(
        description="a shell line (run by /bin/sh -c), or an argv list; with envs, what the kernel "
        "executes: each argument at most 128 KiB, all of them at most 2 MiB"
    )
    cwd: Annotated[str, StringConstraints(max_length=MAX_PATH_CHARS)] | None = None
    envs: Envs = {}
    timeout_s: float | None = Field(default=None, gt=0)
    stdin: str | None = None
    stream: bool = Field(default=False, description="stream the output as NDJSON lines while it runs")

    @model_validator(mode="after")
    def _fits_an_exec(self) -> CommandRequest:
        _check_exec(["/bin/sh", "-c", self.cmd] if isinstance(self.cmd, str) else self.cmd, self.envs)
        return self


class CodeRequest(_In):
    code: str  # on standard input (or the interpreter's), never an argument: the body's cap bounds it
    language: Name = "python"
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
    max_pending_approvals: int = Field(
        default=MAX_PENDING, ge=0, le=10_000,
        description="approval requests the run keeps pending at once; one more is refused, not kept",
    )  # fmt: skip


class RunSubmit(_In):
    task: str = Field(min_length=1, max_length=100_000)
    model: Name | None = Field(
        None, description="PROVIDER:NAME (openai:..., anthropic:...); `scripted` turns instead for tests"
    )
    scripted: list[JsonValue] | None = Field(
        None,
        description="a scripted model's turns (as in a scripted:FILE), instead of `model`",
        max_length=10_000,
        fail_fast=True,
    )
    workspace: Name | None = Field(
        default=None, description="an uploaded workspace's id (POST /v1/workspaces)"
    )
    idempotency_key: str | None = Field(
        None, min_length=1, max_length=200,
        description="submitting again with the same key returns the run it made (a different spec: 409); "
        "each role's keys are its own",
    )  # fmt: skip
    tier: Name | None = None
    trust: Trust | None = None
    limits: RunLimitsIn = RunLimitsIn()
    sandbox_limits: LimitsIn | None = None
    check: Annotated[Arg, AfterValidator(_acceptance)] | None = Field(
        default=None, description="the acceptance check: a shell line that must pass (no NUL, not blank)"
    )
    check_timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)  # as the run would check it
    labels: LabelsIn = Field(default_factory=dict)


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
    # the latest PENDING_SHOWN of them (the one a paused run waits on first), and how many wait
    pending_approvals: list[dict[str, str]] = []
    pending_count: int = 0


class ApprovalDecision(_In):
    decision: Literal["approve", "deny"]


class KillRequest(_In):
    reason: str = Field(default="killed through the API", max_length=500)


class KillAllRequest(_In):
    """Every live run of the caller's tenant; an admin token may name another ``tenant``, or
    ask for ``all_tenants``."""

    reason: str = Field(default="killed through the API (kill-all)", max_length=500)
    tenant: Name | None = Field(default=None, description="another tenant's runs (an admin token only)")
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
