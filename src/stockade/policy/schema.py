"""The policy file, as validated values. Every section has a safe default: an empty policy
allows the tools, commands and paths of the workspace, keeps the network off and fails
closed on everything it cannot analyse.

    version = 1
    [commands]
    deny = ["curl", "wget", "sudo"]
    approve = ["rm -r", "git push", "pip install"]
    [paths]
    write = ["src/**", "tests/**"]
    deny = [".git/**", "secrets/**"]
    [risk]
    high = "approve"            # every call of a high-risk tool (the raw shell) asks a human
    [anomaly.repeated_failure]
    times = 3
    action = "kill"             # an incident: the run stops, its sandbox dies, its workspace is kept
"""

from __future__ import annotations

import enum
import fnmatch
import re
import shlex
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from stockade.types import Trust

__all__ = [
    "AnomalyRules",
    "Classification",
    "CommandRules",
    "ComplianceRules",
    "CredentialRule",
    "DataAccess",
    "DataTier",
    "Decisions",
    "HostAllow",
    "ModelRegistry",
    "NetworkRules",
    "PathRules",
    "Policy",
    "PromptRule",
    "RiskRules",
    "Role",
    "TrustRules",
    "Verdict",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Verdict(enum.StrEnum):
    ALLOW = "allow"
    APPROVE = "approve"  # a human must say yes first
    DENY = "deny"


class Classification(enum.StrEnum):
    PUBLIC = "public"
    INTERNAL = "internal"
    CONFIDENTIAL = "confidential"
    RESTRICTED = "restricted"


class CommandRules(_Strict):
    """Patterns are argv prefixes: ``"rm -r"`` is the program ``rm`` with a recursive flag
    in any spelling (``-R``, ``--recursive``, ``-fR``; the rule may use any of them too),
    ``"git push"`` is ``git`` with the word ``push`` among its arguments. An empty ``allow``
    allows every program that no other rule refuses."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    approve: tuple[str, ...] = ()

    @field_validator("allow", "deny", "approve")
    @classmethod
    def _parseable(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            try:
                words = shlex.split(pattern)
            except ValueError as err:
                raise ValueError(f"pattern {pattern!r} is not valid shell words: {err}") from None
            if not words:
                raise ValueError("a command pattern cannot be empty")
        return patterns


def _glob(glob: str) -> str:
    """A workspace glob in the form it is matched in (``stockade._globs.workspace_glob``): one
    written ``./secrets/**`` or ``/workspace/secrets/**`` is ``secrets/**``; one that climbs or
    names another absolute path is a mistake in the file."""
    from stockade._globs import workspace_glob
    from stockade.exceptions import InvalidArgument

    try:
        return workspace_glob(glob, setting="")
    except InvalidArgument as err:
        raise ValueError(str(err)) from None


Glob = Annotated[str, AfterValidator(_glob)]


class PathRules(_Strict):
    """Globs relative to the workspace (``*``, ``?`` and ``[...]`` within a directory, ``**``
    across), normalised as they are read."""

    read: tuple[Glob, ...] = ("**",)
    write: tuple[Glob, ...] = ("**",)
    deny: tuple[Glob, ...] = ()


def _check_host(host: str) -> str:
    from stockade.exceptions import InvalidArgument
    from stockade.types import HostRule

    try:
        HostRule.parse(host)
    except InvalidArgument as err:
        raise ValueError(str(err)) from None
    return host


class HostAllow(_Strict):
    """One allowed destination with its ports and methods, for some roles (empty: all)."""

    host: str
    ports: tuple[int, ...] = (80, 443)
    methods: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _valid(self) -> HostAllow:
        from stockade.exceptions import InvalidArgument
        from stockade.types import HostRule

        try:
            HostRule(host=self.host, ports=self.ports, methods=self.methods)
        except InvalidArgument as err:
            raise ValueError(str(err)) from None
        return self


class NetworkRules(_Strict):
    """Off by default. ``allow`` lists the hosts code may reach over HTTP(S), through the
    sandbox's egress proxy: ``"pypi.org"``, ``"*.github.com"``, ``"host:8443"``, or a table
    with ports, methods and roles. ``enabled = true`` without ``allow`` is the whole network:
    the docker tier's reaches the internet only (not the host, private addresses or another
    sandbox); the process tier's is the host's own stack, with ``allow_weaker`` only, and
    ``stockade serve`` never gives it.
    ``allow_hosts`` is an older name of ``allow``."""

    enabled: bool = False
    allow: tuple[str | HostAllow, ...] = ()
    allow_hosts: tuple[str, ...] = ()
    allow_addresses: tuple[str, ...] = ()
    resolve: dict[str, tuple[str, ...]] = {}  # names pinned to addresses (internal names)
    max_requests_per_minute: int = Field(default=600, ge=1)
    max_bytes_per_minute: int = Field(default=1024 * 1024 * 1024, ge=1)
    upstream_ca: str | None = None

    @field_validator("allow_hosts")
    @classmethod
    def _hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        for host in hosts:
            _check_host(host)
        return hosts

    @field_validator("allow")
    @classmethod
    def _allow(cls, items: tuple[str | HostAllow, ...]) -> tuple[str | HostAllow, ...]:
        for item in items:
            if isinstance(item, str):
                _check_host(item)
        return items

    @field_validator("allow_addresses")
    @classmethod
    def _networks(cls, networks: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        for text in networks:
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError as err:
                raise ValueError(f"{text!r} is not an address or network: {err}") from None
        return networks

    @model_validator(mode="after")
    def _pins(self) -> NetworkRules:
        from stockade.exceptions import InvalidArgument
        from stockade.types import NetworkPolicy

        try:  # the pinned addresses, as the sandbox's policy will check them (upstream_ca: there)
            NetworkPolicy(resolve=self.resolve)
        except InvalidArgument as err:
            raise ValueError(str(err)) from None
        return self


class _Unread:
    """A credential's source as a policy file names it: its form is checked, not its value."""

    def read(self) -> str:
        return ""


class CredentialRule(_Strict):
    """A secret the egress proxy adds to requests for ``hosts``; it never enters a sandbox.

    ``source``: ``"env:VAR"`` (the host's environment), ``"file:PATH"``, or a scheme
    registered with ``stockade.egress.register_scheme``. A run gets it when its role lists
    it in ``credentials``, or is named in ``roles`` (a policy without roles: when ``roles``
    is empty)."""

    source: str = Field(pattern=r"^[a-z][a-z0-9_-]*:.+")
    hosts: tuple[str, ...] = Field(min_length=1)
    style: Literal["bearer", "basic", "header"] = "bearer"
    header: str = "Authorization"
    username: str = ""
    roles: tuple[str, ...] = ()

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        for host in hosts:
            _check_host(host)
        return hosts

    @model_validator(mode="after")
    def _form(self) -> CredentialRule:
        from stockade.exceptions import InvalidArgument
        from stockade.types import Credential

        try:  # the header and username as the proxy will send them: refused at load, not per run
            Credential(
                name="", hosts=self.hosts, source=_Unread(), style=self.style, header=self.header,
                username=self.username,
            )  # fmt: skip
        except InvalidArgument as err:
            raise ValueError(str(err)) from None
        return self


class DataTier(_Strict):
    """Files matching ``paths`` hold data of class ``tier``."""

    paths: tuple[Glob, ...] = Field(min_length=1)
    tier: Classification


class DataAccess(_Strict):
    """Who may touch one class of data: roles that may read / write it, tools that may touch it
    (empty ``tools``: any tool the role has)."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()


class Decisions(_Strict):
    """Action categories (read, write, delete, execute, install, network, vcs_push, credential)
    and what each needs. A category in no list is allowed."""

    allow: tuple[str, ...] = ()
    approve: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _disjoint(self) -> Decisions:
        for a, b in (("allow", "approve"), ("allow", "deny"), ("approve", "deny")):
            both = set(getattr(self, a)) & set(getattr(self, b))
            if both:
                raise ValueError(f"{', '.join(sorted(both))} listed in both {a} and {b}")
        return self


class Role(_Strict):
    """What a run started under this role may use. ``tools``/``tiers`` empty: any.
    ``credentials`` names the ``[credentials]`` its sandbox's egress proxy adds.
    ``can_approve``: whether a person holding this role may approve or deny the actions a run
    waits for (the service's API and its run viewer)."""

    tools: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    credentials: tuple[str, ...] = ()
    can_approve: bool = True


class ModelRegistry(_Strict):
    """Globs of the models that may be invoked; empty: any model. A glob with a provider
    (``openai:gpt-4.1*``, ``scripted:*``) matches that provider's models only; one without
    (``gpt-4.1*``) matches the name on any provider."""

    approved: tuple[str, ...] = ()

    def allows(self, model: str, provider: str = "") -> bool:
        qualified = f"{provider}:{model}"
        return not self.approved or any(
            fnmatch.fnmatchcase(qualified if ":" in p else model, p) for p in self.approved
        )


class PromptRule(_Strict):
    """Regular expressions (case-insensitive) checked against task prompts and tool outputs."""

    name: str
    patterns: tuple[str, ...] = Field(min_length=1)
    applies_to: tuple[Literal["task", "tool_output"], ...] = ("task", "tool_output")
    action: Literal["allow", "flag", "deny"] = "flag"

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {err}") from None
        return patterns


class TrustRules(_Strict):
    """Who wrote the code and who the user is: decides the minimum sandbox tier (the README's trust table)."""

    level: Trust = Trust.UNTRUSTED
    allow_gvisor_for_untrusted: bool = False
    # Trust sets the minimum tier; of the tiers that meet it, the cheapest this host has is used
    # unless this says "strongest".
    prefer: Literal["cheapest", "strongest"] = "cheapest"


class RiskRules(_Strict):
    """What a call of a tool needs, by the tool's declared risk (``Tool.risk``): ``high =
    "approve"`` sends every call of a high-risk tool (the raw shell) to a human first."""

    low: Verdict = Verdict.ALLOW
    medium: Verdict = Verdict.ALLOW
    high: Verdict = Verdict.ALLOW


AnomalyActionName = Literal["warn", "require_approval", "open_breaker", "kill"]


class AnomalyRule(_Strict):
    """One rule of the anomaly monitor; what is not given keeps the rule's default."""

    enabled: bool = True
    action: AnomalyActionName | None = None
    window_s: float | None = Field(default=None, gt=0)


class CountingRule(AnomalyRule):
    times: int | None = Field(default=None, ge=1)


class BurstRule(AnomalyRule):
    actions: int | None = Field(default=None, ge=1)


class CostRule(AnomalyRule):
    dollars: float | None = Field(default=None, gt=0)


class FloodRule(AnomalyRule):
    max_bytes: int | None = Field(default=None, ge=1)


class AnomalyRules(_Strict):
    """The anomaly monitor's rules (``stockade.runtime.anomaly``): thresholds, windows and
    actions (warn, require_approval, open_breaker, kill). A failed action is one whose tool
    raised or whose result said so (code that raised, a failed command or test run)."""

    enabled: bool = True
    repeated_failure: CountingRule = CountingRule()  # the same action failed `times` in a row
    burst: BurstRule = BurstRule()  # more than `actions` within `window_s`
    cost_spike: CostRule = CostRule()  # more than `dollars` within `window_s`
    repeated_denials: CountingRule = CountingRule()  # `times` denials within `window_s`
    output_flood: FloodRule = FloodRule()  # more than `max_bytes` of output within `window_s`
    flagged_content: CountingRule = CountingRule()  # `times` prompt-rule flags within `window_s`

    def settings(self) -> dict[str, dict[str, object]]:
        """Per rule, what the policy sets (for ``stockade.runtime.anomaly.configured_rules``)."""
        return {
            name: getattr(self, name).model_dump(exclude_none=True)
            for name in type(self).model_fields
            if name != "enabled"
        }


ProfileName = Literal["soc2", "hipaa", "gdpr"]


class ComplianceRules(_Strict):
    """Compliance profiles the deployment must meet (``stockade.policy.compliance``): each is a
    list of checkable requirements, checked at start-up (``build_agent`` refuses to start when
    one is not met). Checkpoints, not certifications. A declared profile raises the minimum
    tier to the microVM. ``retention_days``: how long run data is kept (GDPR Art. 5(1)(e))."""

    profiles: tuple[ProfileName, ...] = ()
    retention_days: int | None = Field(default=None, ge=1)


class Policy(_Strict):
    version: Literal[1] = 1
    commands: CommandRules = CommandRules()
    paths: PathRules = PathRules()
    network: NetworkRules = NetworkRules()
    credentials: dict[str, CredentialRule] = {}
    data: tuple[DataTier, ...] = ()
    data_access: dict[Classification, DataAccess] = {}
    decisions: Decisions = Decisions()
    roles: dict[str, Role] = {}
    models: ModelRegistry = ModelRegistry()
    prompts: tuple[PromptRule, ...] = ()
    trust: TrustRules = TrustRules()
    risk: RiskRules = RiskRules()
    anomaly: AnomalyRules = AnomalyRules()
    compliance: ComplianceRules = ComplianceRules()

    @model_validator(mode="after")
    def _roles_exist(self) -> Policy:
        for tier, access in self.data_access.items():
            for role in (*access.read, *access.write):
                if self.roles and role not in self.roles:
                    raise ValueError(f"data_access.{tier.value} names role {role!r}, which is not in [roles]")
        for name, granted in self.roles.items():
            if not name.strip() or name != name.strip():
                # what the service keeps for "no role" (a token without one, rows from before
                # roles) is the empty name: a role of that name, or one only spaces tell
                # apart, would be read as it
                raise ValueError(f"roles.{name!r}: a role's name is words, not empty or padded with spaces")
            for credential in granted.credentials:
                if credential not in self.credentials:
                    raise ValueError(
                        f"roles.{name}.credentials names {credential!r}, which is not in [credentials]"
                    )
        named = [(f"credentials.{k}", c.roles) for k, c in self.credentials.items()]
        allows = [a for a in self.network.allow if isinstance(a, HostAllow)]
        named += [(f"network.allow ({a.host})", a.roles) for a in allows]
        for where, roles in named:
            for role in roles:
                if role not in self.roles:
                    raise ValueError(f"{where} names role {role!r}, which is not in [roles]")
        return self
