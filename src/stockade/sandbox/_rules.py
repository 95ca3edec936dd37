"""The host's half of ``SandboxRules``: what the supervisor is told, and whether the tier and
the kernel inside can hold the rest.

The supervisor enforces the rules on the code (``supervisor/rules.py``: Landlock for writes,
seccomp user notification for execs). Programs denied whatever their arguments are masked
by the tier itself, before anything starts: an empty, unreadable file in their place, so
that they cannot run, nor be copied, under any name. A tier whose kernel cannot hold a rule
refuses, like a limit, unless the caller accepts less (``allow_weaker``).

This module plans (``plan``: once per policy and tier) and checks the kernel's report
(``check_ready``); what it masks is found in the image by ``_rules_programs``, put in place
by ``_rules_binds`` (with ``_rules_copies``' masked copies), and what the judge reports of
the execs is read by ``_rules_execs``.
"""

from __future__ import annotations

import functools
import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade._globs import may_hold
from stockade.sandbox._rules_programs import (
    MULTI_CALL,
    masked_identities,
    program_masks,
    programs_stamp,
    view_masks,
)
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.supervisor import execrules
from stockade.types import Mechanism, ReadOnly, SandboxRules

WORKSPACE = "/workspace"
# The last of a kernel refusal's fix, for a caller that may accept less.
_OR_WEAKER = ", or pass allow_weaker=True (then only the tool calls' paths are judged)"
# What every tier runs of the image itself: the supervisor's interpreter.
SUPERVISOR_PROGRAMS = ("python3",)


# How each tier holds a policy's rules from inside (its kernel may still lack them: checked
# at start). gVisor's kernel has neither Landlock nor seccomp user notification.
_FULL = {"commands": Mechanism.SECCOMP_NOTIFY, "paths": Mechanism.LANDLOCK, "programs": Mechanism.MASK}
TIER_SUPPORT: dict[str, dict[str, Mechanism]] = {
    "process": _FULL,
    "docker": _FULL,
    "gvisor": {"commands": Mechanism.NONE, "paths": Mechanism.NONE, "programs": Mechanism.MASK},
    "microvm": _FULL,
}


@dataclass(frozen=True)
class RulesPlan:
    """How one sandbox will hold its rules: the supervisor's part and the tier's masks."""

    config: dict[str, Any] | None
    masks: tuple[str, ...]
    enforcement: dict[str, Mechanism]
    weakened: tuple[str, ...]


def write_targets(globs: Iterable[str]) -> list[str] | None:
    """Absolute paths the code may write (folders end with ``/``); None: everything.

    Raises ``LimitNotEnforceable`` for a glob the kernel cannot hold as a path (a wildcard
    inside a name: ``src/*.py``): Landlock and mounts grant folders and files, not patterns.
    """
    out: list[str] = []
    for glob in globs:
        g = glob.strip().strip("/")
        if g in ("**", ""):
            return None
        folder = g[:-3] if g.endswith("/**") else g
        if any(c in folder for c in "*?["):
            raise exc.LimitNotEnforceable(
                f"the write rule {glob!r} is a pattern the kernel cannot hold (it grants folders and files)",
                setting="paths.write",
                fix=f"write it as folders (src/**) or files{_OR_WEAKER}",
            )
        out.append(f"{WORKSPACE}/{folder}" + ("/" if g.endswith("/**") else ""))
    return out


def check_read_only(kept: ReadOnly, write: list[str] | None) -> None:
    """Raise ``LimitNotEnforceable`` where a glob of ``kept`` may match beneath a written
    target (``write``, as ``write_targets`` gives it): Landlock grants a folder with all it
    holds and takes nothing back, so no tier's kernel keeps a part of a written folder
    read-only. Outside every written target the kernel holds it already."""
    folders = ["**"] if write is None else [target.removeprefix(WORKSPACE).strip("/") for target in write]
    for folder in folders:
        under = [glob for glob in kept.paths if folder == "**" or may_hold((glob,), folder)]
        if not under:
            continue
        raise exc.LimitNotEnforceable(
            f"code may read {', '.join(under)} but not change it, and it may lie beneath the "
            f"written {folder!r}: the kernel grants written folders whole, and cannot keep a part "
            "of one read-only",
            setting=kept.setting,
            fix="narrow paths.write to folders that hold none of it, let the role write it, or give "
            f"the role no tool that runs code{_OR_WEAKER}",
        )


def check_holdable(rules: SandboxRules) -> None:
    """Raise ``LimitNotEnforceable`` for the write rules and read-only classes of ``rules``
    that no tier's kernel holds (``write_targets``, ``check_read_only``): known from the rules
    alone, before any tier is chosen. Its fix is the policy's to make: for a caller that cannot
    accept weaker enforcement (a run of the service)."""
    try:
        write = write_targets(rules.write)
        for kept in rules.read_only:
            check_read_only(kept, write)
    except exc.LimitNotEnforceable as refused:
        raise exc.LimitNotEnforceable(
            str(refused), setting=refused.setting, fix=(refused.fix or "").removesuffix(_OR_WEAKER)
        ) from None


def _words(patterns: Iterable[str]) -> list[list[str]]:
    return [list(_split(p)) for p in patterns]


@functools.lru_cache(maxsize=1024)
def _split(pattern: str) -> tuple[str, ...]:
    """One pattern's words, split once per process: shlex costs about 20 us a pattern, and
    every sandbox of a policy starts with the same patterns."""
    return tuple(shlex.split(pattern))


def written_noexec(spec: SandboxSpec) -> bool:
    """Whether the places code writes are mounted ``noexec``: under an allowlist, where a file
    the code wrote must not run, neither as a program (Landlock's execute right) nor as a
    library a listed program maps executable (``LD_PRELOAD``, ``dlopen``: Landlock does not
    see mappings, the mount's flag does)."""
    return spec.rules is not None and bool(spec.rules.allow)


def plan(
    spec: SandboxSpec,
    *,
    root: Path | None,
    can_mask: bool,
    can_confine: bool,
    runs: tuple[str, ...] = SUPERVISOR_PROGRAMS,
    maps_noexec: bool = True,
) -> RulesPlan:
    """The rules of ``spec`` for a tier: ``root`` is the image the masks are looked up in
    (None: by name only), ``can_confine`` whether the tier's kernel runs Landlock and seccomp
    user notification at all (gVisor does not), ``runs`` the programs of the image the tier
    itself runs in the sandbox's view (names, or paths inside): never masked. Every tier's
    kernel sees the written places ``noexec`` under an allowlist (``written_noexec``; gVisor
    under Docker, whose binds carry no such option, once its supervisor's boot remounted them
    so: ``supervisor/noexec.py``). ``maps_noexec`` whether an executable mapping of their
    files is refused: gVisor maps a ``noexec`` file executable, only a host tmpfs ``noexec``
    under it (as root) refuses.

    Made once per policy and tier (every sandbox of a policy gets the same plan, ~25 us of
    its start otherwise): the plan is shared, so nobody may change what it holds. It is made
    again when a program folder of ``root`` changed (a package installed or upgraded puts
    new files, or new copies of a rule's program, there by rename: the folder's mtime moves)."""
    if spec.rules is None:
        return RulesPlan(None, (), {}, ())
    judge = "python" if os.environ.get("STOCKADE_EXEC_JUDGE") == "python" else "compiled"
    key: dict[str, Any] = {
        "allow_weaker": spec.allow_weaker,
        "approver": spec.approver is not None,
        "judge": judge,
        "root": root,
        "can_mask": can_mask,
        "can_confine": can_confine,
        "runs": runs,
        "maps_noexec": maps_noexec,
        "programs": programs_stamp(root),
    }
    try:
        return _plan(spec.rules, **key)
    except TypeError:  # rules given lists where tuples belong: no key, planned each time
        return _plan.__wrapped__(spec.rules, **key)


@functools.lru_cache(maxsize=256)
def _plan(
    rules: SandboxRules,
    *,
    allow_weaker: bool,
    approver: bool,
    judge: str,
    root: Path | None,
    can_mask: bool,
    can_confine: bool,
    runs: tuple[str, ...],
    maps_noexec: bool,
    programs: tuple[int, ...],  # the key only: the program folders as they were
) -> RulesPlan:
    """``plan``, from what of the spec it reads (hashable: the cache's key). A refusal
    (``LimitNotEnforceable``) is raised again at each call, never cached."""
    weakened: list[str] = []
    enforcement: dict[str, Mechanism] = {}
    try:
        write = write_targets(rules.write)
    except exc.LimitNotEnforceable as err:
        if not allow_weaker:
            raise
        weakened.append(f"paths.write: {err}; judged on tool calls only")
        write = None
    for kept in rules.read_only:
        try:
            check_read_only(kept, write)
        except exc.LimitNotEnforceable as err:
            if not allow_weaker:
                raise
            weakened.append(f"{kept.setting}: {err}; judged on tool calls only")
    denied = [w for w in _words(rules.deny) if len(w) == 1]
    names = tuple(sorted(w[0] for w in denied))
    # Programs denied whatever their arguments are masked on every tier; what depends on
    # the arguments (or on approval, or on an allowlist) needs each exec judged.
    argv_rules = bool(rules.approve or rules.allow or any(len(w) > 1 for w in _words(rules.deny)))
    # A multi-call binary runs its applets inside itself (`busybox sh -c 'rm -r x'` runs rm
    # with no exec to judge): masked under rules over argv too, as with any denied program.
    if argv_rules:
        names = tuple(sorted({*names, *MULTI_CALL}))
    denied_masks = _masks(str(root) if root else "", names, programs) if can_mask and names else ()
    if denied and (denied_masks or can_mask):
        enforcement["programs"] = Mechanism.MASK
    # Under an allowlist, what may not run is not in the view either: the judge reads a path
    # the caller can change after the answer, and the loader Landlock lets run runs any file.
    view = (
        _allowlist_view(rules, root, runs, programs, allow_weaker=allow_weaker, weakened=weakened)
        if can_mask
        else ()
    )
    masks = tuple(sorted({*denied_masks, *view})) if view else denied_masks
    needs_kernel = write is not None or argv_rules
    if needs_kernel and not can_confine:
        what = "write rules (Landlock)" if write is not None else "command rules (seccomp user notification)"
        if not allow_weaker:
            raise exc.LimitNotEnforceable(
                f"this tier's kernel has no {what}: code could walk around the policy here",
                setting="paths.write" if write is not None else "commands",
                fix="use the process, docker or microvm tier, or pass allow_weaker=True "
                "(then the policy judges tool calls only, and masks denied programs)",
            )
        held = _held_unconfined(rules, masks, maps_noexec=maps_noexec)
        weakened.append(f"{what}: not held by this tier's kernel{held}; judged on tool calls only")
        return RulesPlan(None, masks, enforcement, tuple(weakened))
    if not can_confine:  # masks hold every rule there is
        return RulesPlan(None, masks, enforcement, tuple(weakened))
    config: dict[str, Any] = {
        "commands": {
            "deny": _words(rules.deny),
            "approve": _words(rules.approve),
            "allow": _words(rules.allow),
        }
        if rules.judges_execs
        else {},
        "write": write,
        "approver": approver,
        # what the masked programs are, read here before the tier masks them: the judge
        # inside can read none of them, and knows a copy brought in by this
        "masked": masked_identities(str(root), denied_masks, programs)
        if root is not None and denied_masks
        else [],
        # STOCKADE_EXEC_JUDGE=python: every exec judged in Python (the compiled fast path off),
        # to compare the two (bench/policy_inside.py) or to rule the fast path out.
        "judge": judge,
    }
    if write is not None:
        enforcement["paths"] = Mechanism.LANDLOCK
    if rules.judges_execs:
        enforcement["commands"] = Mechanism.SECCOMP_NOTIFY
    return RulesPlan(config, masks, enforcement, tuple(weakened))


def _held_unconfined(rules: SandboxRules, masks: tuple[str, ...], *, maps_noexec: bool) -> str:
    """What still holds of an allowlist where the kernel judges no exec (gVisor): the masks,
    and no file the code wrote runs (``written_noexec``, the supervisor's ``no_memfd``): gVisor
    sees its places ``noexec`` (refusing an exec) over a host tmpfs ``noexec`` (which makes
    gVisor's executable mapping of one fault: a library). Without root its own tmpfs has no
    host one under it."""
    if not rules.allow:
        return ""
    held = "; the image's unlisted programs are masked" if masks else ""
    if not maps_noexec:
        return held + (
            "; no program the code wrote runs (its places noexec, memfd_create refused), but a "
            "library it wrote runs in a listed program (LD_PRELOAD, dlopen: gVisor maps a noexec "
            "file executable, and no host tmpfs under it refuses; run as root beside the engine)"
        )
    return held + "; no program the code wrote runs (its places noexec, memfd_create refused)"


def check_ready(spec: SandboxSpec, plan_: RulesPlan, report: Any) -> tuple[str, ...]:
    """What the supervisor said its kernel can do, against what the rules need: raise
    ``LimitNotEnforceable`` (or, with ``allow_weaker``, say what is weaker)."""
    if plan_.config is None:
        return ()
    got = report if isinstance(report, dict) else {}
    missing = []
    if plan_.config["write"] is not None and not got.get("landlock"):
        missing.append(("paths.write", "Landlock (the kernel's write rules)"))
    if plan_.config["commands"] and not got.get("notify"):
        missing.append(("commands", "seccomp user notification (judging each exec)"))
    if missing and not spec.allow_weaker:
        setting, what = missing[0]
        raise exc.LimitNotEnforceable(
            f"the kernel inside this sandbox has no {what}",
            setting=setting,
            fix="use a kernel with it (Linux >= 5.13 for Landlock, >= 5.5 for notification), "
            "or pass allow_weaker=True (then the policy judges tool calls only)",
        )
    return tuple(f"{setting}: {what} missing; judged on tool calls only" for setting, what in missing)


def _allowlist_view(
    rules: SandboxRules,
    root: Path | None,
    runs: tuple[str, ...],
    stamp: tuple[int, ...],
    *,
    allow_weaker: bool,
    weakened: list[str],
) -> tuple[str, ...]:
    """The masks that keep an allowlist's unlisted programs out of the view (``view_masks``;
    none without an allowlist); without an image to look in, a refusal
    (``LimitNotEnforceable``) or, with ``allow_weaker``, none (said in ``weakened``)."""
    if not rules.allow:
        return ()
    if root is None or not root.is_dir():
        what = "the image's files are not known here: its unlisted programs cannot be masked"
        if not allow_weaker:
            raise exc.LimitNotEnforceable(
                f"an allowlist needs its unlisted programs out of the sandbox's view, and {what}",
                setting="commands.allow",
                fix="use the default image, or pass allow_weaker=True (then an unlisted program "
                "can still run through the ELF loader, by a path changed after the exec was judged)",
            )
        weakened.append(f"commands.allow: {what}; the exec judge and Landlock alone hold it")
        return ()
    globs = tuple(sorted({execrules.pattern(words)[0] for words in _words(rules.allow)}))
    return view_masks(str(root), globs, runs, stamp)


@functools.lru_cache(maxsize=64)
def _masks(root: str, names: tuple[str, ...], programs: tuple[int, ...]) -> tuple[str, ...]:
    """``program_masks``, once per image, names and state of its program folders
    (``programs_stamp``: a host's root does change, at its next upgrade)."""
    return tuple(program_masks(Path(root) if root else None, list(names), programs))
