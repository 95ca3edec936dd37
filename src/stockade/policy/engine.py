"""Decisions over one policy for one role: what a sandbox op, a tool, a model or a prompt may do.

Every answer is a ``Decision`` (allow / approve / deny, the rule that decided, and why);
the guards turn them into ``PolicyDenied`` / ``ApprovalRequired``. Verdicts combine to the
strictest: deny beats approve beats allow.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from stockade._globs import covers_below, reaches
from stockade.exceptions import ConfigurationError, TierUnavailable
from stockade.policy.commands import UnanalysableError, analyse, decide_command, matches
from stockade.policy.paths import (
    GLOB_CHARS,
    literal_prefix,
    normalise,
    readable,
    tree_allowed,
    writable,
)
from stockade.policy.schema import Classification, DataTier, Policy, Role, Verdict
from stockade.policy.targets import WORKSPACE, file_access
from stockade.sandbox import _registry
from stockade.sandbox.ops import (
    GetArchive,
    ListDir,
    MakeDir,
    Op,
    Pause,
    PutArchive,
    ReadFile,
    Remove,
    Reset,
    RunCode,
    RunCommand,
    Stat,
    TakeSnapshot,
    WriteFile,
    as_inline,
)
from stockade.types import Credential, HostRule, NetworkPolicy, ReadOnly, SandboxRules

__all__ = ["Decision", "PolicyEngine", "PromptDecision", "command_categories"]

_STRICTNESS = {Verdict.ALLOW: 0, Verdict.APPROVE: 1, Verdict.DENY: 2}
# Category of a simple command, by pattern (first match wins; everything runs code: "execute").
# A pattern holds over the program's other spellings (pip3, python3 -m pip); `npm install`
# over each of npm's and over what installs as it does: ci, update, dedupe, prune, uninstall,
# link, rebuild, exec, npx, audit fix, init x (execnpm.npm_installs).
_INSTALLS = (
    "pip install", "uv pip", "uv add", "uv tool install", "uvx", "pipx install", "pipx run",
    "easy_install*", "npm install", "yarn add", "yarn install", "yarn dlx", "pnpm add",
    "pnpm install", "pnpm i", "pnpm install-test", "pnpm it", "pnpm dlx", "pnpx", "bun add",
    "bun install", "bun i", "bunx", "gem install", "bundle install", "cargo install",
    "go install", "go get", "apt-get install", "apt install", "aptitude install", "dnf install",
    "yum install", "apk add", "conda install",
)  # fmt: skip
_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("git push", "vcs_push"), *((pattern, "install") for pattern in _INSTALLS),
    ("rm", "delete"), ("curl", "network"), ("wget", "network"),
    ("ssh", "network"), ("scp", "network"), ("nc", "network"), ("git clone", "network"),
    ("git fetch", "network"), ("git pull", "network"),
)  # fmt: skip
TOOL_CATEGORIES = {
    "read_file": "read", "list_files": "read", "git_diff": "read",
    "write_file": "write", "apply_patch": "write",
    "run_code": "execute", "run_tests": "execute", "run_command": "execute",
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Decision:
    verdict: Verdict
    rule: str
    reason: str

    @property
    def allowed(self) -> bool:
        return self.verdict is Verdict.ALLOW


ALLOW = Decision(verdict=Verdict.ALLOW, rule="", reason="allowed")


def strictest(decisions: Iterable[Decision]) -> Decision:
    worst = ALLOW
    for decision in decisions:
        if _STRICTNESS[decision.verdict] > _STRICTNESS[worst.verdict]:
            worst = decision
    return worst


@dataclass(frozen=True, kw_only=True)
class PromptDecision:
    verdict: Literal["allow", "flag", "deny"]
    rules: tuple[str, ...] = ()


def command_categories(argv: tuple[str, ...]) -> set[str]:
    try:
        layers, commands = analyse(argv)
    except UnanalysableError:
        return {"execute"}
    found = {"execute"}
    for command in (*layers, *commands):  # layers: what python3 .../pip/__main__.py runs too
        for pattern, category in _CATEGORIES:
            if matches(pattern, command):
                found.add(category)
                break
    return found


class PolicyEngine:
    def __init__(self, policy: Policy, *, role: str | None = None) -> None:
        if role is not None and policy.roles and role not in policy.roles:
            raise ConfigurationError(
                f"role {role!r} is not defined; the policy has: {', '.join(policy.roles)}"
            )
        if role is None and policy.roles:
            raise ConfigurationError("the policy defines roles: start the run under one of them")
        self.policy = policy
        self.role_name = role
        self.role: Role = policy.roles.get(role, Role()) if role is not None else Role()
        self._prompt_patterns = [
            (rule, [re.compile(p, re.IGNORECASE) for p in rule.patterns]) for rule in policy.prompts
        ]

    # -- categories, data classes -------------------------------------------------------

    def category(self, category: str) -> Decision:
        d = self.policy.decisions
        if category in d.deny:
            return Decision(
                verdict=Verdict.DENY, rule=f"decisions.deny: {category}", reason=f"{category} is denied"
            )
        if category in d.approve:
            return Decision(
                verdict=Verdict.APPROVE, rule=f"decisions.approve: {category}",
                reason=f"{category} needs a human's approval",
            )  # fmt: skip
        return ALLOW

    def classification(self, path: str) -> Classification | None:
        norm = normalise(path)
        if norm is None:
            return None
        for entry in self.policy.data:
            if covers_below(entry.paths, norm):  # a class's folder: its files too
                return entry.tier
        return None

    def _data(self, path: str, mode: Literal["read", "write"], tool: str) -> Decision:
        tier = self.classification(path)
        if tier is None:
            return ALLOW
        return self._access(tier, mode, tool, f"{path!r} holds {tier.value} data")

    def _access(self, tier: Classification, mode: Literal["read", "write"], tool: str, what: str) -> Decision:
        """Whether this role may ``mode`` data of class ``tier`` with ``tool``; ``what`` says
        where the data is, for the reason."""
        access = self.policy.data_access.get(tier)
        if access is None:
            return ALLOW
        roles = access.read if mode == "read" else access.write
        if self.role_name is None or self.role_name not in roles:
            return Decision(
                verdict=Verdict.DENY, rule=f"data_access.{tier.value}.{mode}",
                reason=f"{what}; role {self.role_name!r} may not {mode} it",
            )  # fmt: skip
        if access.tools and tool and tool not in access.tools:
            return Decision(
                verdict=Verdict.DENY, rule=f"data_access.{tier.value}.tools",
                reason=f"{what}; tool {tool!r} may not touch it",
            )  # fmt: skip
        return ALLOW

    def classes_beneath(self, folder: str, depth: int | None = None) -> tuple[DataTier, ...]:
        """The data classes a path beneath ``folder``, at most ``depth`` levels down (None: any),
        may hold: the class's own folder and every folder above it hold the class
        (``reports/**`` lies beneath ``reports`` and the root). None for a path outside."""
        norm = normalise(folder)
        if norm is None:
            return ()
        return tuple(entry for entry in self.policy.data if reaches(entry.paths, norm, depth))

    def _beneath(
        self, folder: str, mode: Literal["read", "write"], tool: str, depth: int | None = None
    ) -> Decision:
        """An op over a whole folder (a download, a listing to ``depth``, a removal): judged for
        each data class a path beneath it may hold, as an op on one of its files. A class kept
        out of this role's sandboxes (``sandbox_rules``) is not: what of it a sandbox holds is
        what the role's own code wrote there, and a download of the whole workspace by a role
        that may not read one class would otherwise always be refused."""
        kept_out = self._kept_out()
        present = [entry for entry in self.classes_beneath(folder, depth) if entry not in kept_out]
        return self._classes(folder, present, mode, tool)

    def _classes(
        self, folder: str, entries: Iterable[DataTier], mode: Literal["read", "write"], tool: str
    ) -> Decision:
        return strictest(
            self._access(entry.tier, mode, tool, f"{folder or '.'!r} may hold {entry.tier.value} data "
                         f"({', '.join(entry.paths)})")
            for entry in entries
        )  # fmt: skip

    def _put(self, op: PutArchive, tool: str) -> Decision:
        """Each name of the archive as a file written (a class's ``write`` and ``tools``), a
        class kept out of the role's sandboxes too (the archive would bring it in); an archive
        the host cannot read is judged for every class beneath its folder."""
        classes = self.classes_beneath(op.path or ".")
        if not classes:
            return ALLOW  # no class to find: the archive is not read here
        names = op.names()
        if names is None:  # what it would write is unknown: every class it may reach
            return self._classes(op.path, classes, "write", tool)
        return strictest(self._data(posixpath.join(op.path or ".", name), "write", tool) for name in names)

    def _path(self, path: str, mode: Literal["read", "write"], tool: str) -> Decision:
        ok = readable(self.policy.paths, path) if mode == "read" else writable(self.policy.paths, path)
        if not ok:
            return Decision(
                verdict=Verdict.DENY, rule=f"paths.{mode}",
                reason=f"the policy does not let this run {mode} {path!r}",
            )  # fmt: skip
        return self._data(path, mode, tool)

    def hands_back(self, path: str) -> bool:
        """Whether the run's diff may carry a change of ``path`` back to the host: a path the
        policy lets the run write. Code can still make a file the rules keep out where the
        write rules let it (a new ``.env`` under ``write = ["**"]``): a host that applied the
        diff would overwrite its own."""
        return self._path(path, "write", "").verdict is Verdict.ALLOW

    # -- what the guards ask ------------------------------------------------------------

    def op(self, op: Op[Any], *, tool: str = "") -> Decision:
        parts = self.explain(op, tool=tool)
        if not parts:
            return Decision(verdict=Verdict.DENY, rule="ops", reason=f"unknown operation {type(op).__name__}")
        return strictest(decision for _, decision in parts)

    def explain(self, op: Op[Any], *, tool: str = "") -> tuple[tuple[str, Decision], ...]:
        """Every check ``op`` goes through, named, with its decision; ``op()`` is the strictest.
        Empty for an operation the engine does not know (which ``op()`` denies)."""
        match op:
            case RunCommand():
                argv = as_inline(op)  # a program on stdin (run_code) is judged as the program
                return (
                    ("command rules", self.command(argv)),
                    ("files the command names", self.command_files(argv, op.cwd, tool=tool)),
                    *((f"category {c}", self.category(c)) for c in sorted(command_categories(argv))),
                )
            case RunCode():
                return (("category execute", self.category("execute")),)
            case ReadFile() | Stat():
                return (
                    ("paths (read)", self._path(op.path or ".", "read", tool)),
                    ("category read", self.category("read")),
                )
            case ListDir() | GetArchive():
                depth = op.depth if isinstance(op, ListDir) else None
                return (
                    ("paths (read)", self._path(op.path or ".", "read", tool)),
                    ("data classes beneath (read)", self._beneath(op.path or ".", "read", tool, depth)),
                    ("category read", self.category("read")),
                )
            case WriteFile() | MakeDir():
                return (
                    ("paths (write)", self._path(op.path or ".", "write", tool)),
                    ("category write", self.category("write")),
                )
            case PutArchive():
                return (
                    ("paths (write)", self._path(op.path or ".", "write", tool)),
                    ("data classes of its files (write)", self._put(op, tool)),
                    ("category write", self.category("write")),
                )
            case Remove():
                beneath = self._beneath(op.path, "write", tool) if op.recursive else ALLOW
                return (
                    ("paths (write)", self._path(op.path, "write", tool)),
                    ("data classes beneath (write)", beneath),
                    ("category delete", self.category("delete")),
                )
            case Reset():
                return (("category delete", self.category("delete")),)
            case TakeSnapshot() | Pause():
                # Every file is copied, into the host's store and not to the caller; whatever
                # starts from it runs under the rules its creator gives (the service: the
                # tenant's policy again), so the paths' read rules are not the question here.
                return (("category read", self.category("read")),)
        return ()

    def command(self, argv: tuple[str, ...]) -> Decision:
        d = decide_command(self.policy.commands, argv)
        return Decision(verdict=d.verdict, rule=d.rule, reason=d.reason)

    def command_files(self, argv: tuple[str, ...], cwd: str | None = None, *, tool: str = "") -> Decision:
        """The path rules over the files a command line would write (redirections, ``tee``,
        ``cp``/``mv``/``rm`` operands, ``dd of=``, ...) and read (``< f``, ``cat``, ``cp``
        sources); see ``stockade.policy.targets``."""
        try:
            access = file_access(argv, cwd)
        except UnanalysableError:
            return ALLOW  # the command rules already deny a line they cannot analyse
        decisions = [self._target(path, "write", tool) for path in access.writes]
        for path in access.reads:
            if normalise(path) is not None:  # reading the sandbox's own image is not the rules' concern
                decisions.append(self._target(path, "read", tool))
        if access.unknown and not self._tree("", "write"):
            decisions.append(
                Decision(
                    verdict=Verdict.DENY, rule="paths.write",
                    reason=f"cannot tell which files this command writes ({access.unknown[0]}); "
                    "the policy restricts writes: name the files",
                )
            )  # fmt: skip
        if access.writes or access.unknown:
            decisions.append(self.category("write"))
        return strictest(decisions)

    def _tree(self, prefix: str, mode: Literal["read", "write"]) -> bool:
        rules = self.policy.paths
        globs = rules.read if mode == "read" else rules.write
        classified = [g for entry in self.policy.data for g in entry.paths]
        return tree_allowed(globs, rules, prefix, classified=classified)

    def _target(self, word: str, mode: Literal["read", "write"], tool: str) -> Decision:
        """A file a command names; a shell wildcard is judged by everything it may expand to."""
        if not GLOB_CHARS & set(word):
            return self._path(word, mode, tool)
        relative = word[len(WORKSPACE) :] if word.startswith(WORKSPACE + "/") else word
        prefix = normalise(literal_prefix(relative)) if not relative.startswith("/") else None
        if prefix is not None and self._tree(prefix, mode):
            return ALLOW
        return Decision(
            verdict=Verdict.DENY, rule=f"paths.{mode}",
            reason=f"cannot tell which files `{word}` names under the policy's path rules; name them",
        )  # fmt: skip

    def sandbox_rules(self) -> SandboxRules:
        """The policy as the sandbox itself enforces it, on any code, by any route: the command
        rules (and the decisions over command categories) judged at each exec, the write rules
        held by the kernel, and what this role may not read left out of the sandbox. A data
        class whose ``tools`` leave out a tool of the role that runs code (``code_tools``) is
        left out too; one the role may read but not write is to stay read-only to its code
        (``read_only``: refused where the kernel cannot hold that). A role with no tool that
        runs code (``code_tools``) asks for none: only its tools touch the files, each write
        judged by ``data_access.X.write``, and the service's sandbox of such a role runs no
        code later either (``server.authz.sandbox_op_guard``)."""
        p = self.policy
        deny, approve = list(p.commands.deny), list(p.commands.approve)
        for pattern, category in _CATEGORIES:
            verdict = self.category(category).verdict
            if verdict is Verdict.DENY:
                deny.append(pattern)
            elif verdict is Verdict.APPROVE:
                approve.append(pattern)
        hidden = list(p.paths.deny)
        read_only: list[ReadOnly] = []
        kept_out = self._kept_out()
        runs_code = bool(self.code_tools())
        for entry in p.data:
            access = p.data_access.get(entry.tier)
            if entry in kept_out:
                hidden += entry.paths
            elif access is not None and self.role_name not in access.write and runs_code:
                read_only.append(ReadOnly(paths=entry.paths, setting=f"data_access.{entry.tier.value}.write"))
        if hidden or "**" not in (r.strip("/") for r in p.paths.read):
            # A repository's history holds every file it ever had, the ones kept out included
            # (`git show HEAD:secrets/key`): the history stays out with them. The run's diff is
            # then against its start (the baseline), as for a folder that is no repository.
            hidden += [".git", ".git/**", "**/.git", "**/.git/**"]  # a nested repository's too
        return SandboxRules(
            deny=tuple(dict.fromkeys(deny)),
            approve=tuple(dict.fromkeys(approve)),
            allow=p.commands.allow,
            write=p.paths.write,
            read=p.paths.read,
            hide=tuple(dict.fromkeys(hidden)),
            read_only=tuple(read_only),
        )

    def _kept_out(self) -> tuple[DataTier, ...]:
        """The data classes this role's sandboxes are given none of: one it may not read, and
        one whose ``tools`` leave out a tool of the role that runs code (code of a tool the
        class's list leaves out could read it, and no kernel tells one tool's code from
        another's: it stays out, for the listed too)."""
        coders = self.code_tools()
        out = []
        for entry in self.policy.data:
            access = self.policy.data_access.get(entry.tier)
            if access is None:
                continue
            unreadable = self.role_name is None or self.role_name not in access.read
            if unreadable or (access.tools and not coders <= set(access.tools)):
                out.append(entry)
        return tuple(out)

    def code_tools(self) -> frozenset[str]:
        """The tools of this role that may run code of the caller's choosing in the sandbox:
        every tool but the reads and writes of ``TOOL_CATEGORIES`` (a tool of one's own may do
        anything with its sandbox), none if the policy denies ``execute``. A role that lists no
        tools may use any: ``"*"``."""
        if self.category("execute").verdict is Verdict.DENY:
            return frozenset()
        if not self.role.tools:
            return frozenset({"*"})
        return frozenset(
            name
            for name in self.role.tools
            if TOOL_CATEGORIES.get(name) not in ("read", "write")
            and self.tool(name).verdict is not Verdict.DENY
        )

    def tool(self, name: str) -> Decision:
        if self.role.tools and name not in self.role.tools:
            return Decision(
                verdict=Verdict.DENY, rule=f"roles.{self.role_name}.tools",
                reason=f"role {self.role_name!r} may not use the tool {name!r}",
            )  # fmt: skip
        category = TOOL_CATEGORIES.get(name)
        return self.category(category) if category is not None else ALLOW

    def risk(self, level: str, *, tool: str = "") -> Decision:
        """What a call of a tool of this risk level needs (``[risk]``)."""
        verdict = getattr(self.policy.risk, level, Verdict.ALLOW)
        if verdict is Verdict.ALLOW:
            return ALLOW
        what = f"{tool!r} is a {level}-risk tool" if tool else f"a {level}-risk tool"
        needs = "every call of it needs a human's approval" if verdict is Verdict.APPROVE else "it is denied"
        return Decision(verdict=verdict, rule=f"risk.{level}", reason=f"{what}: {needs}")

    def model(self, name: str, provider: str = "") -> Decision:
        """Whether the registry approves ``name`` as ``provider`` serves it ("" for any or none)."""
        if self.policy.models.allows(name, provider):
            return ALLOW
        shown = f"{provider}:{name}" if provider else name
        return Decision(
            verdict=Verdict.DENY, rule="models.approved",
            reason=f"model {shown!r} is not in the policy's registry of approved models "
            "(to allow it, add a glob that matches it to [models] approved)",
        )  # fmt: skip

    def prompt(self, text: str, source: Literal["task", "tool_output"]) -> PromptDecision:
        verdict: Literal["allow", "flag", "deny"] = "allow"
        fired = []
        for rule, patterns in self._prompt_patterns:
            if source not in rule.applies_to or not any(p.search(text) for p in patterns):
                continue
            fired.append(rule.name)
            if rule.action == "deny":
                verdict = "deny"
            elif rule.action == "flag" and verdict == "allow":
                verdict = "flag"
        return PromptDecision(verdict=verdict, rules=tuple(fired))

    def credentials(self, names: Iterable[str]) -> tuple[str, ...]:
        """The credentials this role is bound to, of those named."""
        granted = set(self._credential_names())
        return tuple(n for n in names if n in granted)

    def _credential_names(self) -> list[str]:
        out = []
        for name, rule in self.policy.credentials.items():
            if self.role_name is None:
                if not rule.roles:
                    out.append(name)
            elif name in self.role.credentials or self.role_name in rule.roles:
                out.append(name)
        return out

    def network_policy(self) -> NetworkPolicy:
        """The sandbox's network for this role: the hosts it may reach (through the egress
        proxy), with their ports and methods, and the credentials the proxy adds for it."""
        from stockade.egress.secrets import secret_source

        n = self.policy.network
        rules: list[HostRule] = [HostRule.parse(h) for h in n.allow_hosts]
        for item in n.allow:
            if isinstance(item, str):
                rules.append(HostRule.parse(item))
            elif not item.roles or self.role_name in item.roles:
                rules.append(HostRule(host=item.host, ports=item.ports, methods=item.methods))
        credentials = []
        for name in self._credential_names():
            c = self.policy.credentials[name]
            credentials.append(
                Credential(
                    name=name, hosts=c.hosts, source=secret_source(c.source), style=c.style,
                    header=c.header, username=c.username,
                )
            )  # fmt: skip
        return NetworkPolicy(
            enabled=n.enabled,
            rules=tuple(rules),
            allow_addresses=n.allow_addresses,
            resolve=dict(n.resolve),
            credentials=tuple(credentials) if rules else (),
            max_requests_per_minute=n.max_requests_per_minute,
            max_bytes_per_minute=n.max_bytes_per_minute,
            upstream_ca=n.upstream_ca,
        )

    def allowed_tiers(self) -> tuple[str, ...]:
        """The tiers trust allows (the README's trust table), of those the role may use; a declared
        compliance profile means the strongest: the microVM only."""
        t = self.policy.trust
        allowed = _registry.allowed_tiers(t.level, allow_gvisor_for_untrusted=t.allow_gvisor_for_untrusted)
        if self.role.tiers:
            allowed = tuple(x for x in allowed if x in self.role.tiers)
        if self.policy.compliance.profiles:
            allowed = tuple(x for x in allowed if x == "microvm")
        return allowed

    def why_tiers(self) -> str:
        """In words, what decides ``allowed_tiers``."""
        why = f"trust {self.policy.trust.level.value!r}"
        profiles = self.policy.compliance.profiles
        if profiles:
            why += f" and compliance profiles {', '.join(profiles)} (the microvm tier only)"
        return why

    def select_tier(self, prefer: _registry.Preference | None = None) -> str:
        """The cheapest tier the trust table and the role allow and this host has (trust sets the
        minimum; ``[trust] prefer = "strongest"`` or ``prefer`` turns the order round); fail closed."""
        allowed = self.allowed_tiers()
        if not allowed:
            raise TierUnavailable(f"role {self.role_name!r} may use no tier that {self.why_tiers()} allows")
        return _registry.choose(
            allowed, prefer=prefer or self.policy.trust.prefer, why=f"the policy ({self.why_tiers()})"
        )
