"""The host's half of ``SandboxRules``: what the supervisor is told, what the tier masks, and
whether the kernel inside can hold the rest.

The supervisor enforces the rules on the code (``supervisor/rules.py``: Landlock for writes,
seccomp user notification for execs). Programs denied whatever their arguments are masked
by the tier itself, before anything starts: an empty, unreadable file in their place, so
that they cannot run, nor be copied, under any name. A tier whose kernel cannot hold a rule
refuses, like a limit, unless the caller accepts less (``allow_weaker``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import os
import re
import shlex
import shutil
import stat
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade._globs import may_hold
from stockade.sandbox._builds import take_away
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.supervisor import execrules, execruns
from stockade.sandbox.supervisor.protocol import MAX_EXEC_ARGV, MAX_EXEC_RECORDS, MAX_EXEC_WORD
from stockade.types import ExecRecord, Mechanism, ReadOnly, SandboxRules

WORKSPACE = "/workspace"
# Where programs live in an image; their copies under other names are found by content.
PROGRAM_DIRS = ("usr/local/bin", "usr/bin", "bin", "usr/sbin", "sbin", "usr/libexec", "usr/lib/git-core")
# Where a denied program's other files are looked for: the whole image, not its program folders
# only (klibc's own uname, in /usr/lib/klibc/bin, was copied and ran under `deny uname`); the
# trees every tier shows (the process tier binds these of the host, and no /opt).
IMAGE_TREES = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Changed by the package manager at every install and removal: part of an image's stamp.
PACKAGE_STATE = ("var/lib/dpkg/info", "var/lib/rpm", "lib/apk/db")
MULTI_CALL = execruns.MULTICALL  # one binary, many programs: denied with any of them
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
                fix="write it as folders (src/**) or files, or pass allow_weaker=True "
                "(then only the tool calls' paths are judged)",
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
            fix="narrow paths.write to folders that hold none of it, let the role write it, or "
            "pass allow_weaker=True (then only the tool calls' paths are judged)",
        )


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
) -> RulesPlan:
    """The rules of ``spec`` for a tier: ``root`` is the image the masks are looked up in
    (None: by name only), ``can_confine`` whether the tier's kernel runs Landlock and seccomp
    user notification at all (gVisor does not), ``runs`` the programs of the image the tier
    itself runs in the sandbox's view (names, or paths inside): never masked.

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
        "programs": _programs_stamp(root),
    }
    try:
        return _plan(spec.rules, **key)
    except TypeError:  # rules given lists where tuples belong: no key, planned each time
        return _plan.__wrapped__(spec.rules, **key)


def image_stamp(root: Path) -> tuple[int, ...]:
    """The state of the image at ``root`` (``_programs_stamp``), the key of what is read of it."""
    return _programs_stamp(root)


def _programs_stamp(root: Path | None) -> tuple[int, ...]:
    """When each program folder of ``root``, and its package manager's state, last changed
    (0: none there)."""
    if root is None:
        return ()
    stamps = []
    for folder in (*PROGRAM_DIRS, *PACKAGE_STATE):
        try:
            stamps.append(os.stat(root / folder).st_mtime_ns)
        except OSError:
            stamps.append(0)
    return tuple(stamps)


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
        held = "; the image's unlisted programs are masked" if rules.allow and masks else ""
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


# A word of a record: MAX_EXEC_WORD characters, and the mark of a word cut (its length and SHA-256).
_WORD = MAX_EXEC_WORD + 160


def exec_records(header: dict[str, Any], *, between: bool = False) -> tuple[ExecRecord, ...]:
    """The execs a final frame reports (untrusted: bounded, and every field made text);
    ``between``: those a ``between`` frame or a ``TakeExecs`` answer hands over (judged while
    no call ran)."""
    raw = header.get("execs")
    if not isinstance(raw, list):
        return ()
    out = []
    for item in raw[:MAX_EXEC_RECORDS]:
        if not isinstance(item, dict):
            continue
        out.append(
            ExecRecord(
                path=str(item.get("path", ""))[:4096],
                argv=_words_of(item.get("argv")),
                verdict=str(item.get("verdict", ""))[:16],
                rule=str(item.get("rule", ""))[:512],
                between=between,
                runs=_words_of(item.get("runs")),
                file=str(item.get("file", ""))[:4096],
            )
        )
    return tuple(out)


def _words_of(raw: Any) -> tuple[str, ...]:
    return tuple(str(a)[:_WORD] for a in raw[:MAX_EXEC_ARGV]) if isinstance(raw, list) else ()


# -- masks ------------------------------------------------------------------------------------


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
def view_masks(
    root: str, globs: tuple[str, ...], runs: tuple[str, ...], stamp: tuple[int, ...] = ()
) -> tuple[str, ...]:
    """Under an allowlist of ``globs``, every ELF program of the image at ``root`` that may not
    run: not listed, no interpreter a listed script names, no loader, no shared library
    (``*.so``, ``*.so.*``), none of the tier's own (``runs``). The exec judge reads a path the
    caller can change after the answer (a link swapped, a relative path under another
    thread's chdir), and Landlock must let the loader run: a raced exec of the loader ran
    any program of the image it was handed. Masked, those have nothing to map: neither a
    raced exec nor the loader run by hand can start one (files the code wrote are on
    ``noexec`` mounts). Once per image, allowlist and state (``stamp``: the cache's key)."""
    image = Path(root)
    kept = allowed_programs(image, globs, runs)
    inodes = set()
    for inside in kept:
        try:
            st = os.stat(image / inside.lstrip("/"))
        except OSError:
            continue
        inodes.add((st.st_dev, st.st_ino))
    return tuple(
        sorted(
            inside
            for inside, st in elf_programs(image, stamp)
            if inside not in kept and (st.st_dev, st.st_ino) not in inodes
        )
    )


def allowed_programs(root: Path, globs: tuple[str, ...], runs: tuple[str, ...] = ()) -> set[str]:
    """The files (inside paths, links resolved in the image) an allowlist of ``globs`` lets
    run, as the supervisor finds them (``execrules.allowlisted``, one list for the view,
    Landlock and the exec judge): the programs named so in the program folders and their
    helper folders, what they need (their scripts' interpreters, the loaders); and ``runs``."""
    listed, needed = execrules.allowlisted(
        globs, str(root).rstrip("/"), lambda path: resolve_inside(root, path)
    )
    files = {*listed, *needed}
    for folder in execrules.ALLOW_FOLDERS:
        for name in runs:
            if not name.startswith("/") and (root / folder.lstrip("/") / name).exists():
                files.add(resolve_inside(root, f"{folder}/{name}"))
    files.update(resolve_inside(root, path) for path in runs if path.startswith("/"))
    return files


def resolve_inside(root: Path, path: str) -> str:
    """``path`` as the sandbox resolves it (every link followed, absolute ones from ``root``):
    the image's links point inside the image, never at the host's files."""
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        if here.is_symlink() and hops < 40:
            hops += 1
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        done.append(part)
    return "/" + "/".join(done)


@functools.lru_cache(maxsize=8)
def elf_programs(root: Path, stamp: tuple[int, ...] = ()) -> tuple[tuple[str, os.stat_result], ...]:
    """The executable ELF files of the image (``image_programs``) that are no shared library
    by their name (``*.so``, ``*.so.*``: the loader maps them for every program): (path
    inside, stat). A script needs an interpreter, which an allowlist judges as a program."""
    found = []
    for name, inside, st in image_programs(root, stamp):
        if name.endswith(".so") or ".so." in name:
            continue
        try:
            with open(root / inside.lstrip("/"), "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
        except OSError:
            continue
        found.append((inside, st))
    return tuple(found)


@functools.lru_cache(maxsize=64)
def _masks(root: str, names: tuple[str, ...], programs: tuple[int, ...]) -> tuple[str, ...]:
    """``program_masks``, once per image, names and state of its program folders
    (``_programs_stamp``: a host's root does change, at its next upgrade)."""
    return tuple(program_masks(Path(root) if root else None, list(names), programs))


def program_masks(root: Path | None, names: list[str], stamp: tuple[int, ...] = ()) -> list[str]:
    """Paths (inside the sandbox) to mask so that the programs ``names`` (globs) cannot run:
    every executable file of the image named so, wherever it is (``named_anywhere``), every
    other name in the program folders of the same file or of a copy of it, and a multi-call
    binary (busybox: its applets cannot be told apart from the file). Without an image to
    look in, the usual places of each name. ``stamp``: the image's state (the cache's key)."""
    if root is None or not root.is_dir():
        return sorted({f"/{d}/{n}" for d in PROGRAM_DIRS for n in names if not any(c in n for c in "*?[")})
    files: list[tuple[str, os.stat_result, str]] = []  # inside path, its file's stat, host path
    for folder in PROGRAM_DIRS:
        base = root / folder
        if base.is_symlink() or not base.is_dir():
            continue  # /bin -> usr/bin: the same files
        for entry in os.scandir(base):
            try:
                # a link leads to a file that is masked, or to none; a folder named as a
                # program (/usr/libexec/dpkg) is none, and no file can be bound over it
                if not entry.is_file(follow_symlinks=False):
                    continue
                files.append((f"/{folder}/{entry.name}", entry.stat(), entry.path))
            except OSError:
                continue
    wanted = [*names, *MULTI_CALL]
    targets = {inside: st for inside, st, _ in files if _named(inside.rsplit("/", 1)[1], wanted)}
    targets.update(named_anywhere(root, tuple(wanted), stamp))
    same_file = {(st.st_dev, st.st_ino) for st in targets.values()}
    sizes = {st.st_size for st in targets.values()}
    digests: set[str] | None = None
    for inside, st, host in files:
        if inside in targets or not (st.st_mode & 0o111):
            continue
        if (st.st_dev, st.st_ino) in same_file:
            targets[inside] = st  # a hard link: another name of the same file
        elif st.st_size in sizes:
            if digests is None:
                digests = {d for i in targets if (d := _digest(root / i.lstrip("/"))) is not None}
            if _digest(Path(host)) in digests:
                targets[inside] = st  # a copy under another name
    return sorted(targets)


def _named(name: str, globs: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, glob) for glob in globs)


def named_anywhere(
    root: Path, globs: tuple[str, ...], stamp: tuple[int, ...] = ()
) -> dict[str, os.stat_result]:
    """The executable files of the image at ``root`` named as one of ``globs``, in any of its
    folders (``IMAGE_TREES``, links not followed): klibc's own uname, in /usr/lib/klibc/bin,
    was another file than /usr/bin/uname, and its copy ran under `deny uname`."""
    exact = {glob for glob in globs if not any(c in glob for c in "*?[")}
    pattern = re.compile("|".join(fnmatch.translate(glob) for glob in globs if glob not in exact) or "(?!)")
    return {
        inside: st for name, inside, st in image_programs(root, stamp) if name in exact or pattern.match(name)
    }


@functools.lru_cache(maxsize=8)
def image_programs(root: Path, stamp: tuple[int, ...] = ()) -> tuple[tuple[str, str, os.stat_result], ...]:
    """Every executable regular file of the image at ``root`` (``IMAGE_TREES``, links not
    followed): (name, path inside, stat), once per image and ``stamp`` (its state,
    ``_programs_stamp``): a host's /usr of 150,000 files in ~0.6 s, once a process, rather
    than a walk for each policy (~0.3 s each; the properties draw many)."""
    found: list[tuple[str, str, os.stat_result]] = []
    todo = [(root / top, f"/{top}") for top in IMAGE_TREES]
    while todo:
        folder, inside = todo.pop()
        try:
            if folder.is_symlink():
                continue  # /bin -> usr/bin: the same files
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    todo.append((Path(entry.path), f"{inside}/{entry.name}"))
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
                found.append((entry.name, f"{inside}/{entry.name}", st))
    return tuple(found)


def _digest(path: Path) -> str | None:
    try:
        h = hashlib.sha256()
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def masked_identities(root: str, masks: tuple[str, ...], stamp: tuple[int, ...] = ()) -> list[list[Any]]:
    """What the programs ``masks`` are in the image at ``root``, for the exec judge inside:
    ``[names, size, sha256, ELF build ID in hex or ""]``, one entry per content (the names
    it has among the masked). Inside, no one can read a masked program, so a byte-for-byte
    copy of one the code brought in (from the seed, an upload, the network: `curl` as
    `fetch`) had nothing to be compared with and ran, and one with bytes appended too.
    Once per image, masks and state of its program folders (``stamp``: the cache's key);
    the plan that holds it is shared, so nobody may change it."""
    by_content: dict[str, list[Any]] = {}
    for inside in masks:
        path = Path(root) / inside.lstrip("/")
        try:
            st = path.stat()
            digest = _digest(path)
            build = execrules.build_id(str(path))
        except OSError:
            continue
        if digest is None or not stat.S_ISREG(st.st_mode):
            continue
        entry = by_content.setdefault(digest, [[], st.st_size, digest, build.hex() if build else ""])
        name = inside.rsplit("/", 1)[1]
        if name not in entry[0]:
            entry[0].append(name)
    return list(by_content.values())


# -- binding the masks ------------------------------------------------------------------------

# A masked copy no sandbox has used for this long is removed (each use touches it), unless a
# live sandbox lists it; a build left half-done by a crash, after an hour.
MASKED_UNUSED_S = 7 * 86400
# The cache's budget, held when a copy is built. Each distinct set of masks in a folder is a
# copy (an allowlist's, up to ~40), so without one a host running many policies grew by a
# copy of /usr/bin and more per policy, for a week. Each copy costs at least a folder
# (a 4 KiB block and an inode): 1,000 of them, ~4 MiB.
MASKED_COPIES_MAX = 1000
# Each entry is a name in a folder of the copy (~40 bytes) and each masked one an inode too:
# 250,000 of them, some 25 MiB at most.
MASKED_ENTRIES_MAX = 250_000
# (folder, its identity, names) -> the masked copy, and the folders beneath as they were; the
# latest MASKED_COPIES_MAX used, as the cache holds no more.
_masked: OrderedDict[tuple[Any, ...], tuple[Path, tuple[tuple[str, int, int, int], ...]]] = OrderedDict()


@dataclass(frozen=True)
class MaskCache:
    """Where masked copies are kept (``folder``), what live sandboxes bind of them
    (``in_use``: the copies' paths, asked only when one must go to make room) and how many
    copies and entries it may hold."""

    folder: Path
    in_use: Callable[[], Collection[str]]
    copies: int = MASKED_COPIES_MAX
    entries: int = MASKED_ENTRIES_MAX


def masked_folders() -> Path:
    """Where a host that runs as root keeps its masked copies of program folders:
    ``STOCKADE_MASK_CACHE``, else /var/cache/stockade, on the file system of the programs
    themselves (/usr), as hard links need (elsewhere, each program is bound instead)."""
    return Path(os.environ.get("STOCKADE_MASK_CACHE") or "/var/cache/stockade")


def collect_masked(cache: Path, in_use: set[str], *, now: float | None = None) -> list[str]:
    """Remove the masked copies in ``cache`` unused for ``MASKED_UNUSED_S`` that no live
    sandbox lists in ``in_use`` (removing one in use would empty a folder under a sandbox),
    and the stripped programs no copy links any more."""
    now = time.time() if now is None else now
    removed: list[str] = []
    for copy, used, _ in _copies(cache):
        if (
            now - used > MASKED_UNUSED_S
            and str(copy) not in in_use
            and _remove_copy(copy, now - MASKED_UNUSED_S)
        ):
            removed.append(f"masked copy {copy.name}")
    for left in (*cache.glob(".masked-*"), *cache.glob(".stripped-*"), *cache.glob("stripped-*")):
        try:
            st = left.lstat()
        except OSError:
            continue
        # a build left half-done, or a stripped program no copy links any more (its only link)
        done = left.name.startswith("stripped-")
        if now - st.st_mtime > 3600.0 and (not done or st.st_nlink == 1):
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink(missing_ok=True)
            removed.append(f"masked copy {left.name}")
    return removed


def _copies(cache: Path) -> list[tuple[Path, float, int]]:
    """The masked copies in ``cache``: (path, last used, entries), least lately used first."""
    found = []
    for copy in cache.glob("masked-*"):
        try:
            used = copy.stat().st_mtime
        except OSError:
            continue
        # a copy's entries are in its name; one named before that counts as the most there can be
        named = _COPY_NAME.fullmatch(copy.name)
        found.append((copy, used, int(named[1]) if named else MASKED_TREE_ENTRIES))
    return sorted(found, key=lambda c: c[1])


_COPY_NAME = re.compile(r"masked-[0-9a-f]{16}-([0-9]{1,9})")


def _remove_copy(copy: Path, used_before: float) -> bool:
    """Remove ``copy`` unless a use touched it since ``used_before`` (``_builds.take_away``:
    a use from then on finds it gone, ``_touch`` fails, and it is built again)."""
    return take_away(copy, used_before, copy.with_name(f".masked-removing-{copy.name}-{os.getpid()}"))


# A copy is evicted to make room only when unused for longer than this: a use in the last
# TOUCH_EVERY_S may not have touched it, and a sandbox lists what it binds only after it got
# the copy (the extra ten minutes: a start held up between the two).
EVICTABLE_IDLE_S = 3600.0 + 600.0


def _make_room(cache: MaskCache, entries: int) -> bool:
    """Whether a copy of ``entries`` entries fits in ``cache``'s budget, once the copies least
    lately used, unused for ``EVICTABLE_IDLE_S`` and bound by no live sandbox, are removed
    (removing one bound would empty a folder under a sandbox)."""
    copies = _copies(cache.folder)
    count, total = len(copies), sum(weight for _, _, weight in copies)
    if count < cache.copies and total + entries <= cache.entries:
        return True
    in_use = set(cache.in_use())
    cutoff = time.time() - EVICTABLE_IDLE_S
    for copy, used, weight in copies:
        if used > cutoff:
            return False  # the rest were used later
        if str(copy) not in in_use and _remove_copy(copy, cutoff):
            count, total = count - 1, total - weight
            if count < cache.copies and total + entries <= cache.entries:
                return True
    return False


# What a sandbox's run folder lists of the masked copies it binds, one a line: garbage
# collection keeps those (``masks_in_use``).
MASKS_FILE = "masks"
# The run folders of every tier's sandboxes in a state folder: the process tier's, Docker's
# containers and runsc's bundles.
RUN_FOLDERS = ("sbx-*", "ctr-*", "gv-*")


def masks_in_use(state_dir: Path) -> set[str]:
    """The masked copies the sandboxes of ``state_dir`` bind, whatever their tier (the ones
    gone too, until their tier's garbage collection removes their folders)."""
    in_use: set[str] = set()
    for pattern in RUN_FOLDERS:
        for rundir in state_dir.glob(pattern):
            with contextlib.suppress(OSError):
                in_use.update((rundir / MASKS_FILE).read_text().split())
    return in_use


def mask_binds(
    root: Path, masks: Iterable[str], cache: MaskCache | None, *, cover: str = "/dev/null"
) -> list[tuple[str, str]]:
    """How a tier that binds files (bwrap, gVisor) puts ``masks`` in place: ``(host source,
    inside path)`` pairs. Each bind costs the sandbox's start a mount, a remount and a read of
    the mount table (about 0.3 ms each): a folder with several masked programs, in it or
    beneath it, is bound once, as a masked copy of its tree (``masked_folder``: an allowlist
    masks hundreds of programs, /usr/lib/systemd's among them); else each program is covered
    by ``cover`` (/dev/null, bound nodev: it can be neither read, nor copied, nor run): so too
    where the cache is full of copies in use."""
    binds: list[tuple[str, str]] = []
    copied: list[str] = []  # folders bound as a copy: what is beneath them is in it
    for folder, names, beneath in _by_folder(tuple(masks)):
        if any(folder.startswith(done + "/") for done in copied):
            continue
        copy = masked_folder(root / folder.lstrip("/"), beneath, cache) if len(beneath) > 1 else None
        if copy is not None:
            binds.append((str(copy), folder))
            copied.append(folder)
        else:
            binds += [(cover, f"{folder}/{name}") for name in names]
    return binds


# gVisor's gofer serves each bind, and runsc did not hold hundreds of them: an allowlist's
# ~300 masks, one file bound over each, failed its start ("cannot read client sync file");
# 120 to 200 started, then refused to load programs nobody had masked. 60 held.
OWN_KERNEL_FILE_BINDS = 64


def own_kernel_binds(
    root: Path | None, masks: Sequence[str], cover: str, cache: MaskCache | None
) -> list[tuple[str, str]]:
    """How a tier whose kernel ignores masked paths (gVisor) puts ``masks`` in place:
    ``(host source, inside path)`` pairs, each program covered by ``cover`` (an empty file only
    root may read) while they are few; more, by folder (``mask_binds``: a masked copy of the
    image's folder at ``root``, made with ``cache``). ``LimitNotEnforceable`` where more than
    ``OWN_KERNEL_FILE_BINDS`` files would still be bound one by one (no copy could be made:
    not root, the image's files not on this host, the cache full)."""
    if len(masks) <= OWN_KERNEL_FILE_BINDS:  # one bind each: a memory snapshot restores those
        return [(cover, path) for path in masks]
    binds = mask_binds(root, masks, cache, cover=cover) if root is not None else [(cover, p) for p in masks]
    files = sum(1 for source, _ in binds if source == cover)
    if files > OWN_KERNEL_FILE_BINDS:
        why = (
            "the image's files are not on this host"
            if root is None
            else "no masked copy of their folders could be made (that needs root, the image's files "
            "on this host and room in the cache of copies)"
        )
        raise exc.LimitNotEnforceable(
            f"the rules mask {len(masks)} programs, {files} of them one file at a time, past the "
            f"{OWN_KERNEL_FILE_BINDS} binds gVisor starts with: {why}",
            setting="commands",
            fix="run stockade as root with the default image (whole folders are then masked at "
            "once), deny fewer programs, or use the process, docker or microvm tier",
        )
    return binds


@functools.lru_cache(maxsize=64)
def _by_folder(masks: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...], frozenset[str]], ...]:
    """``masks`` by folder, in order: (folder, the names in it, the paths beneath it relative
    to it), once per plan's masks (an allowlist's thousand, ~20 ms of each start otherwise)."""
    by_folder: dict[str, list[str]] = {}
    for path in masks:
        folder, _, name = path.rpartition("/")
        by_folder.setdefault(folder, []).append(name)
    return tuple(
        (
            folder,
            tuple(sorted(names)),
            frozenset(path[len(folder) + 1 :] for path in masks if path.startswith(folder + "/")),
        )
        for folder, names in sorted(by_folder.items())
    )


# A folder whose tree holds more entries than this is not copied (its programs are bound one
# by one): /usr/lib's tree would cost a start's walk and the cache's inodes.
MASKED_TREE_ENTRIES = 5000


def masked_folder(folder: Path, names: frozenset[str], cache: MaskCache | None) -> Path | None:
    """A copy of ``folder``'s tree made of hard links (no data copied; setuid, setgid and
    capable programs are one copy without their privilege, shared), in which each of ``names`` (paths
    relative to ``folder``) is an empty file that only root may read: bound over the folder,
    it hides those programs as the /dev/null binds do, in one mount. None where it cannot
    be made (no cache, another file system, a special file, a tree over
    ``MASKED_TREE_ENTRIES``, a cache over its budget with every copy used lately): then
    each program is bound.

    Made once per host and state of the tree: the copy is named after the inode and
    modification time of each of its folders, which a package manager changes when it adds,
    removes or replaces (renames over) a file, so a stale copy is never used; a file
    rewritten in place is the same inode, seen through the link."""
    if cache is None:
        return None
    try:
        st = os.stat(folder)
    except OSError:
        return None
    key = (str(folder), st.st_dev, st.st_ino, st.st_mtime_ns, tuple(sorted(names)))
    known = _masked.get(key)
    if known is not None and _same_folders(known[1]) and _touch(known[0]):
        _masked.move_to_end(key)
        return known[0]
    tree = _folders_beneath(folder)
    if tree is None:
        return None
    folders, entries = tree
    name = hashlib.sha256(repr((key, folders)).encode()).hexdigest()[:16]
    target = cache.folder / f"masked-{name}-{entries}"
    if not _touch(target):  # not there: built, if the budget has room
        try:
            cache.folder.mkdir(parents=True, exist_ok=True, mode=0o755)
            if not _make_room(cache, entries):
                return None
            _build_masked(folder, names, cache.folder, target)
        except OSError:
            return None
    _masked[key] = (target, folders)
    _masked.move_to_end(key)
    while len(_masked) > MASKED_COPIES_MAX:
        _masked.popitem(last=False)
    return target


def _folders_beneath(folder: Path) -> tuple[tuple[tuple[str, int, int, int], ...], int] | None:
    """Each folder beneath ``folder`` (links not followed): (path, device, inode, mtime), and
    how many entries its tree holds; None if more than ``MASKED_TREE_ENTRIES``."""
    found: list[tuple[str, int, int, int]] = []
    todo, entries = [str(folder)], 0
    while todo:
        try:
            with os.scandir(todo.pop()) as listing:
                for entry in listing:
                    entries += 1
                    if entries > MASKED_TREE_ENTRIES:
                        return None
                    if entry.is_dir(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        found.append((entry.path, st.st_dev, st.st_ino, st.st_mtime_ns))
                        todo.append(entry.path)
        except OSError:
            return None
    return tuple(sorted(found)), entries


def _same_folders(folders: tuple[tuple[str, int, int, int], ...]) -> bool:
    for path, dev, ino, mtime in folders:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        if (st.st_dev, st.st_ino, st.st_mtime_ns) != (dev, ino, mtime):
            return False
    return True


# How stale a copy's time may get before a use marks it again: far below MASKED_UNUSED_S, and
# a start then pays a stat, not a write of the folder's inode each time.
TOUCH_EVERY_S = 3600.0


def _touch(copy: Path) -> bool:
    """Marks the copy used now (``collect_masked`` keeps what was used lately) unless it was
    within the hour; False if it is not there."""
    try:
        st = os.stat(copy)
        if not stat.S_ISDIR(st.st_mode):
            return False
        if time.time() - st.st_mtime > TOUCH_EVERY_S:
            os.utime(copy)
    except OSError:
        return False
    return True


def _build_masked(folder: Path, names: frozenset[str], cache: Path, target: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".masked-", dir=cache))
    try:
        _link_tree(folder, tmp, names, "", cache)
        os.rename(tmp, target)  # whole or not at all: another process may build the same
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise


def _link_tree(folder: Path, dest: Path, names: frozenset[str], prefix: str, cache: Path) -> None:
    """``folder``'s entries into ``dest`` (made), linked, and ``names`` (relative to the
    copy's top: ``prefix`` is where this folder is in it) empty and unreadable."""
    with os.scandir(folder) as entries:
        for entry in entries:
            into = dest / entry.name
            if prefix + entry.name in names:
                os.close(os.open(into, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0))
            elif entry.is_symlink():
                os.symlink(os.readlink(entry.path), into)
            elif entry.is_dir(follow_symlinks=False):
                into.mkdir()
                _link_tree(Path(entry.path), into, names, f"{prefix}{entry.name}/", cache)
            elif entry.is_file(follow_symlinks=False):
                source = _stripped(entry, cache) if _privileged(entry) else entry.path
                os.link(source, into, follow_symlinks=False)
            else:
                raise OSError(f"{entry.path}: a special file, not linked")
    os.chmod(dest, os.stat(folder).st_mode & 0o7777)


def _privileged(entry: os.DirEntry[str]) -> bool:
    """Whether running the file gives privilege: setuid, setgid, or file capabilities."""
    if entry.stat(follow_symlinks=False).st_mode & 0o6000:
        return True
    try:
        os.getxattr(entry.path, "security.capability", follow_symlinks=False)
    except OSError:
        return False
    return True


def _stripped(entry: os.DirEntry[str], cache: Path) -> Path:
    """A copy of the privileged program ``entry`` without its privilege, in ``cache``, that
    every masked copy links: a link to the program itself would keep an old setuid or
    capable program reachable there after the host upgrades it, and a copy in each masked
    copy cost a host's /usr/bin ~1 MB a copy. Named after the program's inode and change
    time (an upgrade or a chmod makes another); removed once no copy links it."""
    st = entry.stat(follow_symlinks=False)
    path = cache / f"stripped-{st.st_dev}-{st.st_ino}-{st.st_ctime_ns}"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=".stripped-", dir=cache)
        os.close(fd)
        try:
            shutil.copyfile(entry.path, tmp, follow_symlinks=False)
            os.chmod(tmp, st.st_mode & 0o777)
            os.rename(tmp, path)  # whole or not at all; another build's is the same
        except OSError:
            os.unlink(tmp)
            raise
    return path
