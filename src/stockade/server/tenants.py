"""Tenants, their quotas and policies, and the API tokens bound to them.

A tenants file (TOML) names each tenant, its policy file (whose roles the tokens name), its
quotas and its rate and spend limits, and lists the tokens, stored hashed:

    [tenants.acme]
    policy = "acme-policy.toml"     # relative to this file; left out: the default policy
    sandboxes = 10                   # live sandboxes at once
    cpus = 8.0                       # their CPUs, added up
    memory_mb = 8192                 # their memory, added up
    runs = 100                       # runs queued or running at once
    rate_per_minute = 600            # API calls, and tool actions of its runs, per rolling minute
    rate_period_s = 60               # that window, in seconds (a minute unless shortened)
    dollars_per_hour = 5.0           # model spend per rolling hour, over every run
    snapshot_mb = 10240              # disk of its snapshots and paused sandboxes
    output_bytes = 16777216          # most one sandbox's Limits.output_bytes may be (each call's
                                     # stdout and stderr are held in the API process, each up to it)
    running_calls = 64               # its sandbox calls (commands, code, files) running at once in
                                     # one API process: each holds one of the process's threads
    bodies_mb = 256                  # what one API process holds for its transfers at once: request
                                     # bodies, responses not yet read, uploads being unpacked
    allow_weaker = false             # true: its requests' allow_weaker may take a sandbox this host
                                     # enforces less strictly than asked (rlimits for cgroups,
                                     # ptys and inodes bounded only by the host's shared limits...)

    [[tokens]]
    id = "3f9a1c0b7d2e"
    sha256 = "…"                     # of the token's secret part
    tenant = "acme"
    role = "developer"               # a role of acme's policy (required when it has roles)
    admin = false                    # true: an operator's token, which may kill other tenants' runs

A token is ``stk_<id>_<secret>``: the id finds its record (it is not secret), and the
secret's SHA-256 is compared with the stored one in constant time. An unknown id is
compared against a dummy digest, so that a wrong token costs the same whatever is wrong
with it. ``new_token`` makes one (``stockade token new``).

A running service follows its file (``TenantsFile``): it looks at the file's identity at most
once a second, on the way of a request, and loads it again when it changed, so a token taken
out is refused from then on and a changed quota or policy holds for the work that starts
after. A file that no longer loads is logged and the last table that did stays.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from stockade import exceptions as exc
from stockade._config_file import read_config_text
from stockade.policy.load import load_policy
from stockade.policy.schema import Policy
from stockade.types import Limits, MiB

__all__ = [
    "Principal",
    "Quotas",
    "Tenant",
    "Tenants",
    "TenantsFile",
    "TokenRecord",
    "check_output_bytes",
    "check_share",
    "check_weaker",
    "new_token",
    "parse_token",
]

TENANT_ID = re.compile(r"^[a-z][a-z0-9_]{0,23}$")  # also a table-name prefix (audit namespaces)
_TOKEN = re.compile(r"^stk_([0-9a-f]{12})_([A-Za-z0-9_-]{20,128})$")
_DUMMY = hashlib.sha256(b"stockade: no such token").hexdigest()
CHECK_S = 1.0  # how often a service looks whether its tenants file changed

log = logging.getLogger("stockade.server")


@dataclass(frozen=True, kw_only=True)
class Quotas:
    """What one tenant may hold at once."""

    sandboxes: int = 10
    cpus: float = 8.0
    memory_mb: int = 8192
    runs: int = 100
    # the disk its snapshots and paused sandboxes take (a paused sandbox holds no live share)
    snapshot_mb: int = 10240
    # the service database's space its uploaded workspaces, its runs (their specs, their rows
    # in the run store) and their kept artifacts take
    storage_mb: int = 2048
    # not a sum: the most one sandbox's ``Limits.output_bytes`` may be. A call's stdout and
    # stderr are held in the API process (each up to it) until its result is sent.
    output_bytes: int = 16 * MiB
    # its sandbox calls running at once in one API process (commands, code, file ops, ...):
    # each holds one of the process's threads (app.THREADS) while it runs, so a tenant's share
    # must leave the rest to the other tenants; one more is refused at once, never queued
    running_calls: int = 64
    # what one API process holds for its transfers at once (server/held.py): request bodies
    # to the end of their request, responses until their client has read them, uploads'
    # files while they are unpacked
    bodies_mb: int = 256


@dataclass(frozen=True, kw_only=True)
class Tenant:
    id: str
    policy: Policy = field(default_factory=Policy)
    quotas: Quotas = field(default_factory=Quotas)
    rate_per_minute: int | None = None
    rate_period_s: float = 60.0
    dollars_per_hour: float | None = None
    # its runs that ended longer ago are erased by the service (None: ServiceConfig's, whose
    # None keeps them until the tenant deletes them)
    keep_runs_days: float | None = None
    # The operator's consent to weaker enforcement, which a request's allow_weaker only asks
    # for: what a sandbox's host holds less strictly (rlimits for cgroups, ptys and inodes
    # bounded by the host's shared limits, a remote engine's missing walls) is shared with
    # the service and the other tenants, so it is not the tenant's alone to accept.
    allow_weaker: bool = False

    @property
    def audit_namespace(self) -> str:
        """The tables of this tenant's audit trail: a chain of its own."""
        return f"audit_t_{self.id}"


def check_output_bytes(tenant: Tenant, asked: int, *, what: str) -> None:
    """``QuotaExceeded`` when a sandbox asks for more output than the tenant's ceiling."""
    ceiling = tenant.quotas.output_bytes
    if asked > ceiling:
        raise exc.QuotaExceeded(
            f"{what} asks for output_bytes={asked}, more than tenant {tenant.id!r}'s ceiling ({ceiling}): "
            "ask for less (a command's output past it is cut, and its true size reported)",
            quota="output_bytes", limit=float(ceiling), used=0.0,
        )  # fmt: skip


def check_share(tenant: Tenant, share: Limits, *, what: str) -> None:
    """``QuotaExceeded`` when a run's sandbox (``share``, its limits) asks for more than the
    tenant's ceilings: more CPUs, memory or sandboxes than its whole quota (it would wait queued
    for ever), or more output than its ``output_bytes``."""
    quotas = tenant.quotas
    for quota, needs, limit in (("sandboxes", 1, quotas.sandboxes), ("cpus", share.cpus, quotas.cpus),
                                ("memory_mb", share.memory_mb, quotas.memory_mb)):  # fmt: skip
        if needs > limit:
            raise exc.QuotaExceeded(
                f"{what} needs {needs:g} {quota}, more than tenant {tenant.id!r}'s whole quota "
                f"({limit:g}): ask for smaller sandbox_limits",
                quota=quota, limit=float(limit), used=0.0,
            )  # fmt: skip
    check_output_bytes(tenant, share.output_bytes, what=what)


def check_weaker(tenant: Tenant, weakened: tuple[str, ...], *, what: str) -> None:
    """``PolicyDenied`` (403) when a sandbox is held less strictly than asked (``weakened``, its
    ``Enforcement.weakened``) and the operator has not let the tenant accept that: a request's
    ``allow_weaker`` is consent where nothing is weaker, and alone never enough where something is."""
    if not weakened or tenant.allow_weaker:
        return
    setting = f"tenants.{tenant.id}.allow_weaker"
    raise exc.PolicyDenied(
        f"{what} would be enforced less strictly than asked on this host ({'; '.join(weakened)}), "
        f"and tenant {tenant.id!r} may not accept that: what is weaker is shared with the service "
        f"host and the other tenants, so only the operator can allow it, with allow_weaker = true "
        f"under [tenants.{tenant.id}] in the tenants file ({setting})",
        rule=setting,
        action="accept weaker enforcement",
    )


@dataclass(frozen=True, kw_only=True)
class TokenRecord:
    id: str
    sha256: str
    tenant: str
    role: str | None = None
    admin: bool = False


@dataclass(frozen=True, kw_only=True)
class Principal:
    """Who a request is from: a tenant, under one role of its policy. ``admin``: an operator's
    token (the tenants file says so, never a tenant's policy), which may act on every tenant's
    runs where a route allows it (a kill-all)."""

    tenant: Tenant
    role: str | None
    token_id: str
    admin: bool = False

    def stands_as(self, earlier: Principal) -> bool:
        """Whether this principal (its token looked up again) still grants what ``earlier``
        did: the same token of the same tenant, under the same role, admin or not. A role
        changed in the tenants file reaches other sandboxes, runs and data classes: what was
        opened under the old one must not go on reading."""
        return (
            self.token_id == earlier.token_id
            and self.tenant.id == earlier.tenant.id
            and self.role == earlier.role
            and self.admin == earlier.admin
        )


class _TenantEntry(BaseModel):
    # inf passed gt/ge bounds: a tenant with rate_period_s = inf got 500s (OverflowError) for 429s
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    policy: str | None = None
    sandboxes: int = Field(default=10, ge=0)
    cpus: float = Field(default=8.0, ge=0)
    memory_mb: int = Field(default=8192, ge=0)
    runs: int = Field(default=100, ge=0)
    snapshot_mb: int = Field(default=10240, ge=0)
    storage_mb: int = Field(default=2048, ge=0)
    output_bytes: int = Field(default=16 * MiB, ge=1)
    running_calls: int = Field(default=64, ge=0)
    bodies_mb: int = Field(default=256, ge=1)
    rate_per_minute: int | None = Field(default=None, gt=0)
    # Redis windows count whole seconds; at most a year
    rate_period_s: float = Field(default=60.0, ge=1, le=366 * 86400)
    dollars_per_hour: float | None = Field(default=None, gt=0, le=1e9)
    keep_runs_days: float | None = Field(default=None, gt=0, le=1_000_000)
    allow_weaker: StrictBool = False  # strict: "no" is not taken for a yes


class _TokenEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[0-9a-f]{12}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str
    role: str | None = None
    admin: bool = False


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: dict[str, _TenantEntry] = {}
    tokens: list[_TokenEntry] = []


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_token(token: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a well-formed token, else None."""
    match = _TOKEN.match(token)
    return (match.group(1), match.group(2)) if match else None


def _is_text(name: str) -> bool:
    """Printable text that UTF-8 can write: a byte that is no UTF-8 (a lone surrogate, from
    ``$'\\xff'`` in a shell) or a control character would make a file that does not load."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return bool(name) and name.isprintable()


def new_token(tenant: str, role: str | None = None, *, admin: bool = False) -> tuple[str, TokenRecord]:
    """A fresh token (shown once) and the record to keep (its secret hashed)."""
    if role is not None and not _is_text(role):
        raise exc.InvalidArgument(
            f"role {role!r} is not a role's name", argument="role", fix="give a role of the tenant's policy"
        )
    token_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    return f"stk_{token_id}_{secret}", TokenRecord(
        id=token_id, sha256=_digest(secret), tenant=tenant, role=role, admin=admin
    )


@dataclass(frozen=True, kw_only=True)
class Tenants:
    tenants: Mapping[str, Tenant]
    tokens: Mapping[str, TokenRecord]

    def __post_init__(self) -> None:
        for tenant_id in self.tenants:
            if not TENANT_ID.match(tenant_id):
                raise exc.InvalidArgument(
                    f"tenant id {tenant_id!r} is not valid",
                    argument="tenants",
                    fix=f"use lowercase letters, digits and _ ({TENANT_ID.pattern})",
                )
        for record in self.tokens.values():
            tenant = self.tenants.get(record.tenant)
            if tenant is None:
                raise exc.InvalidArgument(
                    f"token {record.id} names tenant {record.tenant!r}, which is not defined",
                    argument="tokens.tenant",
                    fix=f"define [tenants.{record.tenant}] or use one of {', '.join(self.tenants) or 'none'}",
                )
            roles = tenant.policy.roles
            if roles and record.role not in roles:
                raise exc.InvalidArgument(
                    f"token {record.id} has role {record.role!r}, which tenant {record.tenant!r}'s policy "
                    "does not define",
                    argument="tokens.role",
                    fix=f"give one of {', '.join(roles)}",
                )

    @classmethod
    def load(cls, path: str | Path) -> Tenants:
        path = Path(path)
        return cls.parse(read_config_text(path, what="the tenants file"), path=path)

    @classmethod
    def parse(cls, text: str, *, path: Path) -> Tenants:
        """The table of a tenants file's ``text``; ``path`` names it, and its policy files are
        found next to it."""
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise exc.ConfigurationError(f"{path}: not valid TOML: {error}") from None
        except RecursionError:  # tomllib parses nested arrays by recursion
            raise exc.ConfigurationError(f"{path}: its TOML nests too deeply") from None
        try:
            parsed = _File.model_validate(raw)
        except ValidationError as error:
            problems = tuple(
                f"{path}: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
            )
            raise exc.PolicyFileError(f"{path} is not a valid tenants file", problems=problems) from None
        tenants = {}
        for tenant_id, entry in parsed.tenants.items():
            policy = load_policy(path.parent / entry.policy) if entry.policy else Policy()
            tenants[tenant_id] = Tenant(
                id=tenant_id,
                policy=policy,
                quotas=Quotas(
                    sandboxes=entry.sandboxes,
                    cpus=entry.cpus,
                    memory_mb=entry.memory_mb,
                    runs=entry.runs,
                    snapshot_mb=entry.snapshot_mb,
                    storage_mb=entry.storage_mb,
                    output_bytes=entry.output_bytes,
                    running_calls=entry.running_calls,
                    bodies_mb=entry.bodies_mb,
                ),
                rate_per_minute=entry.rate_per_minute,
                rate_period_s=entry.rate_period_s,
                dollars_per_hour=entry.dollars_per_hour,
                keep_runs_days=entry.keep_runs_days,
                allow_weaker=entry.allow_weaker,
            )
        tokens = {
            t.id: TokenRecord(id=t.id, sha256=t.sha256, tenant=t.tenant, role=t.role, admin=t.admin)
            for t in parsed.tokens
        }
        return cls(tenants=tenants, tokens=tokens)

    def current(self) -> Tenants:
        """The table now: a table of its own is always itself (``TenantsFile`` follows a file)."""
        return self

    def authenticate(self, token: str) -> Principal:
        """The principal of ``token``; ``AuthenticationError`` for any token it is not."""
        parsed = parse_token(token)
        token_id, secret = parsed if parsed is not None else ("", token)
        record = self.tokens.get(token_id)
        expected = record.sha256 if record is not None else _DUMMY
        matches = hmac.compare_digest(_digest(secret), expected)
        if record is None or not matches:
            raise exc.AuthenticationError(
                "the API token is not one this service knows: send `Authorization: Bearer stk_…` with a "
                "token made by `stockade token new`"
            )
        return self.principal(record.id)

    def principal(self, token_id: str) -> Principal:
        """Who holds the token ``token_id`` (one of ``tokens``; a session names it)."""
        record = self.tokens[token_id]
        return Principal(
            tenant=self.tenants[record.tenant], role=record.role, token_id=record.id, admin=record.admin
        )

    def toml_lines(self, record: TokenRecord) -> str:
        """The lines that add ``record`` to a tenants file."""
        # a TOML basic string: JSON's escapes are TOML's (a quote in a role ended the string)
        role = f"\nrole = {json.dumps(record.role, ensure_ascii=False)}" if record.role else ""
        admin = "\nadmin = true" if record.admin else ""
        return (
            f'[[tokens]]\nid = "{record.id}"\nsha256 = "{record.sha256}"\ntenant = "{record.tenant}"{role}'
            f"{admin}\n"
        )


# what tells one version of a file from the next without reading it: replaced (another
# inode), rewritten in place (size, mtime, ctime), or gone (None)
_Identity = tuple[int, int, int, int, int] | None
# A file's times tick coarsely (the kernel's clock tick, a few ms; more on some file systems):
# a second write of the same size within that tick looks like the first. A file changed this
# recently is read again at the next check (as git treats a "racy" index entry).
_RACY_NS = 2_000_000_000


def _identity(path: Path) -> _Identity:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _racy(seen: _Identity) -> bool:
    return seen is not None and time.time_ns() - max(seen[3], seen[4]) < _RACY_NS


class TenantsFile:
    """A tenants file the service follows while it runs. ``current()`` is its table: at most
    every ``check_s`` it compares the file's identity (a ``stat``, no read) with the one it
    loaded, and loads the file again when it changed. The first load raises as
    ``Tenants.load``; a later one that fails (bad TOML, an unknown role, no tenants left, the
    file gone) keeps the last table that loaded and logs why, once per version of the file:
    a typo does not lock every tenant out, nor does it bring back a token already refused.
    ``reload_soon()`` (``stockade serve``'s SIGHUP) makes the next ``current()`` load the file
    even if it looks unchanged: a policy file it names changed, say."""

    def __init__(self, path: str | Path, *, check_s: float = CHECK_S) -> None:
        self.path = Path(path)
        self.check_s = check_s
        self._seen = _identity(self.path)  # before reading: a write meanwhile is seen next time
        self._racy = _racy(self._seen)
        self._table = Tenants.load(self.path)
        self._failed: _Identity = None  # the version whose failure was logged
        self._checked = time.monotonic()
        self._forced = False
        # held only inside ``current()``; a Celery worker's parent never consults it, so no pool
        # child is forked while it is held
        self._lock = threading.Lock()

    def current(self) -> Tenants:
        if time.monotonic() - self._checked < self.check_s and not self._forced:
            return self._table
        with self._lock:
            if time.monotonic() - self._checked >= self.check_s or self._forced:
                self._check()
            return self._table

    def reload_soon(self) -> None:
        """Load the file at the next ``current()``, changed or not (safe in a signal handler)."""
        self._forced = True

    def _check(self) -> None:
        forced, self._forced = self._forced, False
        seen = _identity(self.path)
        self._checked = time.monotonic()
        if seen == self._seen and not (forced or self._racy):
            return
        self._seen, self._racy = seen, _racy(seen)
        try:
            if seen is None:
                raise exc.ConfigurationError(f"the tenants file {self.path} is gone")
            table = Tenants.load(self.path)
            if not table.tenants:
                raise exc.ConfigurationError(f"{self.path} names no tenants")
        except exc.StockadeError as error:
            if seen != self._failed or forced:
                self._failed = seen
                problems = "".join(f"\n  {p}" for p in getattr(error, "problems", ()))
                log.error(
                    "the tenants file changed but does not load: the service keeps its last table "
                    "(%d tenants, %d tokens) until it is fixed: %s%s",
                    len(self._table.tenants), len(self._table.tokens), error, problems,
                )  # fmt: skip
            return
        self._failed = None
        if table == self._table:  # read again for nothing (racy, or asked): nothing to say
            return
        removed = sorted(set(self._table.tokens) - set(table.tokens))
        self._table = table
        log.warning(
            "tenants file %s loaded again: %d tenants, %d tokens%s", self.path, len(table.tenants),
            len(table.tokens), f"; tokens refused from now on: {', '.join(removed)}" if removed else "",
        )  # fmt: skip
