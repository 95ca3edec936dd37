"""Data classes as the sandbox holds them (``PolicyEngine.sandbox_rules``, ``_rules.plan``): a
class code could read against its ``tools`` stays out; one the role may read but not write
stays read-only where the kernel can hold that, and is refused where it cannot."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stockade import exceptions as exc
from stockade.policy.engine import PolicyEngine
from stockade.policy.schema import Policy
from stockade.sandbox import _rules
from stockade.sandbox.base import SandboxSpec
from stockade.types import Mechanism, ReadOnly, SandboxRules

CODING = ("read_file", "write_file", "run_code", "list_files", "git_diff", "apply_patch")
READING = ("read_file", "list_files", "git_diff")


def policy(
    *, tools: tuple[str, ...] = CODING, write: tuple[str, ...] = ("src/**",), data: tuple[str, ...] = (),
    access: dict[str, Any] | None = None, deny: tuple[str, ...] = (),
) -> Policy:  # fmt: skip
    return Policy.model_validate(
        {
            "paths": {"read": ["**"], "write": list(write)},
            "roles": {"dev": {"tools": list(tools)}},
            "decisions": {"deny": list(deny)},
            "data": [{"paths": list(data or ("customers/**", "src/data/**")), "tier": "confidential"}],
            "data_access": {"confidential": access or {"read": ["dev"], "write": [], "tools": ["read_file"]}},
        }
    )


def rules(p: Policy) -> SandboxRules:
    return PolicyEngine(p, role="dev").sandbox_rules()


def plan(r: SandboxRules, *, allow_weaker: bool = False, can_confine: bool = True) -> _rules.RulesPlan:
    spec = SandboxSpec(rules=r, allow_weaker=allow_weaker)
    return _rules.plan(spec, root=None, can_mask=True, can_confine=can_confine)


def test_a_class_kept_to_tools_that_run_no_code_stays_out_where_the_role_runs_code() -> None:
    r = rules(policy())
    assert {"customers/**", "src/data/**"} <= set(r.hide)
    assert r.read_only == ()  # hidden: nothing of it there to hold read-only


@pytest.mark.parametrize(
    ("tools", "listed", "deny"),
    [
        (READING, ("read_file",), ()),  # no tool of the role runs code
        (CODING, ("read_file", "run_code"), ()),  # its code is one of the listed
        (CODING, ("read_file",), ("execute",)),  # the policy denies running code at all
    ],
)
def test_a_class_kept_to_tools_stays_in_where_no_other_code_can_read_it(
    tools: tuple[str, ...], listed: tuple[str, ...], deny: tuple[str, ...]
) -> None:
    access = {"read": ["dev"], "write": ["dev"], "tools": list(listed)}
    r = rules(policy(tools=tools, access=access, deny=deny))
    assert "customers/**" not in r.hide


@pytest.mark.parametrize("tools", [(), ("read_file", "shell"), ("read_file", "lookup")])
def test_a_tool_not_known_to_run_no_code_counts_as_running_code(tools: tuple[str, ...]) -> None:
    """Every tool, for a role that lists none; the raw shell; a tool of one's own, which may do
    anything with its sandbox."""
    access = {"read": ["dev"], "write": ["dev"], "tools": ["read_file"]}
    assert "customers/**" in rules(policy(tools=tools, access=access)).hide


def test_a_class_the_role_may_read_and_not_write_is_kept_read_only() -> None:
    r = rules(policy(access={"read": ["dev"], "write": []}))
    assert "customers/**" not in r.hide
    assert r.read_only == (
        ReadOnly(paths=("customers/**", "src/data/**"), setting="data_access.confidential.write"),
    )
    assert rules(policy(access={"read": ["dev"], "write": ["dev"]})).read_only == ()


def test_a_read_only_class_outside_every_written_folder_is_held_by_the_kernel() -> None:
    r = rules(policy(data=("customers/**", "docs/*.csv"), access={"read": ["dev"], "write": []}))
    held = plan(r)
    assert held.config is not None and held.config["write"] == ["/workspace/src/"]
    assert held.enforcement["paths"] is Mechanism.LANDLOCK
    assert held.weakened == ()


@pytest.mark.parametrize(
    ("write", "data", "under"),
    [
        (("src/**",), ("customers/**", "src/data/**"), "src"),  # a folder of it written
        (("**",), ("customers/**",), "**"),  # everything written
        (("src/**",), ("**/*.csv",), "src"),  # a glob that matches anywhere
        (("src/data/d.csv",), ("src/data/**",), "src/data/d.csv"),  # a file of it written
    ],
)
def test_a_read_only_class_beneath_a_written_folder_is_refused_with_a_fix(
    write: tuple[str, ...], data: tuple[str, ...], under: str
) -> None:
    r = rules(policy(write=write, data=data, access={"read": ["dev"], "write": []}))
    with pytest.raises(exc.LimitNotEnforceable) as refused:
        plan(r)
    assert refused.value.setting == "data_access.confidential.write"
    assert repr(under) in str(refused.value)
    assert "narrow paths.write" in (refused.value.fix or "")
    weaker = plan(r, allow_weaker=True)
    assert any(note.startswith("data_access.confidential.write:") for note in weaker.weakened)
    with pytest.raises(exc.LimitNotEnforceable):  # gVisor's kernel holds no path at all
        plan(r, can_confine=False)


READ_NOT_WRITE = {"read": ["dev"], "write": []}


@pytest.mark.parametrize(
    ("tools", "deny"),
    [
        (("read_file",), ()),  # no tool of the role runs code
        (CODING, ("execute",)),  # the policy denies running code at all
    ],
)
def test_a_role_that_runs_no_code_asks_the_kernel_to_keep_nothing_read_only(
    tools: tuple[str, ...], deny: tuple[str, ...]
) -> None:
    """Only the role's tools touch its files, each write judged by
    ``data_access.confidential.write``: no code to keep from the class. Before, the class was
    read-only all the same, and under ``write = ["**"]`` every sandbox of the role was refused
    (``LimitNotEnforceable``), its runs accepted and then ended ``error``."""
    r = rules(policy(tools=tools, write=("**",), access=READ_NOT_WRITE, deny=deny))
    assert r.read_only == ()
    assert "customers/**" not in r.hide  # the role reads it: it is there
    assert plan(r).weakened == ()  # started, nothing weaker
    _rules.check_holdable(r)


def test_a_role_that_runs_code_still_keeps_the_class_read_only_or_gets_no_sandbox() -> None:
    r = rules(policy(tools=("read_file", "run_code"), write=("**",), access=READ_NOT_WRITE))
    assert [kept.setting for kept in r.read_only] == ["data_access.confidential.write"]
    with pytest.raises(exc.LimitNotEnforceable):
        plan(r)


def test_what_no_tier_holds_is_known_from_the_rules_alone_with_a_fix_the_policy_makes() -> None:
    """``check_holdable``: asked before a run is queued (a run takes no ``allow_weaker``), its
    fix names only what the policy can change."""
    refused = []
    for r in (
        rules(policy(write=("**",), access=READ_NOT_WRITE)),
        rules(policy(write=("src/*.py",), access={"read": ["dev"], "write": ["dev"]})),
    ):
        with pytest.raises(exc.LimitNotEnforceable) as raised:
            _rules.check_holdable(r)
        refused.append(raised.value)
    assert [r.setting for r in refused] == ["data_access.confidential.write", "paths.write"]
    assert all("allow_weaker" not in (r.fix or "") for r in refused)
    assert "give the role no tool that runs code" in (refused[0].fix or "")


def test_rules_with_read_only_paths_come_back_from_a_snapshots_state() -> None:
    from stockade.sandbox._snapshot_state import spec_from_state, spec_state

    r = rules(policy(access={"read": ["dev"], "write": []}))
    back = spec_from_state(json.loads(json.dumps(spec_state(SandboxSpec(rules=r)))))
    assert back.rules == r
    assert hash(back.rules) == hash(r)  # the plan's cache key
