"""The host's plan of a policy's rules: made once per policy and tier, shared by its sandboxes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.sandbox import _rules
from stockade.sandbox.base import SandboxSpec
from stockade.types import Mechanism, SandboxRules

RULES = SandboxRules(deny=("curl", "git push"), write=("src/**",))


def plan(spec: SandboxSpec, *, can_confine: bool = True, maps_noexec: bool = True) -> _rules.RulesPlan:
    return _rules.plan(spec, root=None, can_mask=True, can_confine=can_confine, maps_noexec=maps_noexec)


def test_sandboxes_of_one_policy_share_its_plan() -> None:
    first, second = plan(SandboxSpec(rules=RULES)), plan(SandboxSpec(rules=RULES))
    assert first is second
    assert first.config is not None and first.config["write"] == ["/workspace/src/"]
    assert first.enforcement["commands"] is Mechanism.SECCOMP_NOTIFY


def test_what_the_plan_reads_of_the_spec_gives_another_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = plan(SandboxSpec(rules=RULES))
    with_approver = plan(SandboxSpec(rules=RULES, approver=lambda record: True))
    assert with_approver.config is not None and with_approver.config["approver"] is True
    deny_only = SandboxSpec(rules=SandboxRules(deny=("curl",)))
    assert plan(deny_only).config is not None
    assert plan(deny_only, can_confine=False).config is None  # gVisor's: masks only
    monkeypatch.setenv("STOCKADE_EXEC_JUDGE", "python")
    in_python = plan(SandboxSpec(rules=RULES))
    assert in_python.config is not None and in_python.config["judge"] == "python"
    assert shared.config is not None and shared.config["judge"] == "compiled"  # unchanged


def test_a_refusal_is_raised_at_every_start_never_kept() -> None:
    spec = SandboxSpec(rules=SandboxRules(write=("src/*.py",)))
    for _ in range(2):
        with pytest.raises(exc.LimitNotEnforceable):
            plan(spec)
    weaker = plan(SandboxSpec(rules=SandboxRules(write=("src/*.py",)), allow_weaker=True))
    assert weaker.weakened and weaker.config is not None and weaker.config["write"] is None


def test_rules_given_as_lists_are_planned_all_the_same() -> None:
    listed = SandboxRules(deny=["curl", "git push"], write=["src/**"])  # type: ignore[arg-type]
    assert plan(SandboxSpec(rules=listed)) == plan(SandboxSpec(rules=RULES))


def test_the_masks_are_looked_up_in_the_image_given(tmp_path: Path) -> None:
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "bin" / "curl").write_bytes(b"\x7fELF curl")
    found = _rules.plan(SandboxSpec(rules=RULES), root=tmp_path, can_mask=True, can_confine=True)
    assert found.masks == ("/usr/bin/curl",)


def test_a_copy_of_a_rule_program_installed_later_is_masked_by_the_next_start(tmp_path: Path) -> None:
    # a package upgrade, or anyone with the host's root, puts programs in place by rename
    programs = tmp_path / "usr" / "bin"
    programs.mkdir(parents=True)
    (programs / "curl").write_bytes(b"\x7fELF curl")
    (programs / "curl").chmod(0o755)
    first = _rules.plan(SandboxSpec(rules=RULES), root=tmp_path, can_mask=True, can_confine=True)
    assert first.masks == ("/usr/bin/curl",)
    (programs / ".fetch.tmp").write_bytes(b"\x7fELF curl")
    (programs / ".fetch.tmp").chmod(0o755)
    (programs / ".fetch.tmp").rename(programs / "fetch")
    os.utime(programs, ns=(0, first_stamp(tmp_path) + 1))  # however coarse the filesystem's clock
    later = _rules.plan(SandboxSpec(rules=RULES), root=tmp_path, can_mask=True, can_confine=True)
    assert later.masks == ("/usr/bin/curl", "/usr/bin/fetch")


def first_stamp(root: Path) -> int:
    return (root / "usr" / "bin").stat().st_mtime_ns


def test_a_denied_programs_other_files_anywhere_in_the_image_are_masked(tmp_path: Path) -> None:
    # klibc ships a uname of its own, outside the program folders: a copy of it ran under
    # `deny uname`; a folder's documentation of the same name is no program
    files = {"usr/bin/uname": 0o755, "usr/lib/klibc/bin/uname": 0o755, "usr/share/doc/uname": 0o644}
    for path, mode in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(b"\x7fELF " + path.encode())
        (tmp_path / path).chmod(mode)
    (tmp_path / "bin").symlink_to("usr/bin")  # the same files: not walked twice
    rules = SandboxRules(deny=("uname",))
    found = _rules.plan(SandboxSpec(rules=rules), root=tmp_path, can_mask=True, can_confine=True)
    assert found.masks == ("/usr/bin/uname", "/usr/lib/klibc/bin/uname")


def test_a_folder_named_as_a_denied_program_is_not_masked(tmp_path: Path) -> None:
    # dpkg's helpers live in /usr/libexec/dpkg/: a file bound over that folder failed every
    # start under `deny dpkg` (bwrap, runsc)
    (tmp_path / "usr" / "libexec" / "dpkg").mkdir(parents=True)
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "bin" / "dpkg").write_bytes(b"\x7fELF dpkg")
    rules = SandboxRules(deny=("dpkg",))
    found = _rules.plan(SandboxSpec(rules=rules), root=tmp_path, can_mask=True, can_confine=True)
    assert found.masks == ("/usr/bin/dpkg",)


@pytest.mark.parametrize(
    "rules",
    [
        {"deny": (None,)},  # shlex.split(None) read the host's stdin: its text became policy
        {"deny": "rm"},  # a str, read a character at a time: rm ran
        {"approve": "rm -r"},  # the approver was never asked
        {"allow": ("",)},  # an empty pattern: the supervisor exited
        {"deny": ("",)},  # silently nothing
        {"deny": ("\ud800",)},  # the first command crashed the sandbox
        {"deny": (1,)},
        {"approve": ("rm 'unclosed",)},
    ],
)
def test_command_patterns_are_checked_as_a_policy_files_are(rules: dict[str, object]) -> None:
    with pytest.raises(exc.InvalidArgument) as refused:
        SandboxRules(**rules)  # type: ignore[arg-type]
    assert refused.value.argument.startswith("SandboxRules.")
    assert SandboxRules(deny=["curl", "git push"]).deny == ("curl", "git push")  # type: ignore[arg-type]


def _image(root: Path, files: dict[str, bytes]) -> None:
    for path, content in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(content)
        (root / path).chmod(0o755)


def test_under_an_allowlist_no_unlisted_program_of_the_image_is_in_the_view(tmp_path: Path) -> None:
    # The exec judge reads a path the caller can change after the answer (a link swapped
    # from ls to the loader), and the loader runs whatever it is handed: an unlisted bash ran.
    # What may not run is masked, wherever it is in the image: nothing is left to map.
    _image(
        tmp_path,
        {
            "usr/bin/ls": b"\x7fELF ls",
            "usr/bin/cat": b"\x7fELF cat",
            "usr/bin/bash": b"\x7fELF bash",
            "usr/bin/ldd": b"#!/bin/bash\necho a script",
            "usr/bin/python3.11": b"\x7fELF python",  # the supervisor's: never masked
            "usr/lib/apt/methods/http": b"\x7fELF apt's http method",
            "usr/lib/x86_64-linux-gnu/libc.so.6": b"\x7fELF libc",  # a library: mapped by all
            "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2": b"\x7fELF the loader",
        },
    )
    (tmp_path / "usr" / "bin" / "python3").symlink_to("python3.11")
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "ld-linux-x86-64.so.2").symlink_to("/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")
    listed = _rules.plan(
        SandboxSpec(rules=SandboxRules(allow=("ls",))), root=tmp_path, can_mask=True, can_confine=True
    )
    assert listed.masks == ("/usr/bin/bash", "/usr/bin/cat", "/usr/lib/apt/methods/http")
    assert listed.config is not None and listed.config["masked"] == []  # a denied program's copies only
    # a listed script's interpreter runs it: in the view
    script = _rules.plan(
        SandboxSpec(rules=SandboxRules(allow=("l?", "ldd"))), root=tmp_path, can_mask=True, can_confine=True
    )
    assert script.masks == ("/usr/bin/cat", "/usr/lib/apt/methods/http")


def test_an_allowlist_without_the_image_to_look_in_is_refused_unless_weaker() -> None:
    spec = SandboxSpec(rules=SandboxRules(allow=("ls",)))
    with pytest.raises(exc.LimitNotEnforceable) as refused:
        plan(spec)
    assert refused.value.setting == "commands.allow"
    weaker = plan(SandboxSpec(rules=SandboxRules(allow=("ls",)), allow_weaker=True))
    assert "/usr/bin/bash" not in weaker.masks  # by name only: the multi-call binaries
    assert any(w.startswith("commands.allow") for w in weaker.weakened)


def test_what_an_unconfined_allowlist_holds_of_written_files_is_what_the_tier_sees() -> None:
    """On gVisor the written places are noexec in its view (run by runsc; under Docker once the
    supervisor's boot remounted its binds so), over a host noexec tmpfs as root; without root
    its own tmpfs has no host tmpfs under it to refuse a library's executable mapping."""
    spec = SandboxSpec(rules=SandboxRules(allow=("ls",)), allow_weaker=True)

    def said(*, maps: bool) -> str:
        weakened = plan(spec, can_confine=False, maps_noexec=maps).weakened
        return next(said for said in weakened if said.startswith("command rules"))

    assert "no program the code wrote runs" in said(maps=True)
    assert "library" not in said(maps=True)
    assert "a library it wrote runs" in said(maps=False)
