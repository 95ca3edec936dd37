"""Unified diffs applied by our own code over ``sandbox.files``, all or nothing.

Why not ``git apply`` inside the sandbox: it needs git in every image and on every tier
(the container images need not ship it, and the fake backend has no processes at all);
its error messages name a patch line, not the hunk and the text that differed; and
checking every file before writing any is simple when the whole transaction is ours.

The parser is forgiving where models are sloppy (hunk line counts are recomputed from the
body, missing leading spaces on blank context lines are accepted, a hunk that moved is
found nearby) and strict where it matters: every context and removed line must match.
"""

from __future__ import annotations

import posixpath
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stockade.exceptions import PatchRejected, RunStopped, SandboxFileNotFound, StockadeError
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.ops import Op, ReadFile, Remove, Stat, WriteFile
from stockade.tools.deadline import checkpoint

__all__ = [
    "MAX_SEARCH_WORK",
    "FilePatch",
    "Hunk",
    "SearchWork",
    "apply_patch_to_sandbox",
    "apply_to_text",
    "parse_unified_diff",
    "patch_ops",
]

# The most text one diff may patch, all its files together: the patch holds every line of a
# file as an object of its own (28 times the bytes of a file of short lines), and a file the
# code wrote may be as large as the sandbox's disk. Larger files are edited with run_code.
MAX_PATCH_BYTES = 2 * 1024 * 1024

# Matching a hunk where its header does not say costs O(file lines) to scan for its rarest line,
# then O(hunk lines) per place that line occurs: linear for a normal file, and bounded per diff
# for a hostile one (every line the same), which was O(file x hunk) of host CPU (hours).
MAX_SEARCH_WORK = 200_000_000  # lines scanned or compared (~1 s), all the hunks of a diff together
_CHECK_EVERY = 1 << 16  # of that work: how often a search looks whether its call was given up


@dataclass
class SearchWork:
    """What is left of a diff's ``MAX_SEARCH_WORK``, spent by every hunk searched for."""

    left: int = MAX_SEARCH_WORK
    since_check: int = 0
    path: str = ""  # what is being patched, for the message
    hunk: int = 0

    def spend(self, amount: int) -> None:
        self.left -= amount
        self.since_check += amount
        if self.left < 0:
            raise PatchRejected(
                f"hunk {self.hunk} for {self.path} could not be placed: searching the file for where its "
                f"lines are went past {MAX_SEARCH_WORK:,} lines compared (the file repeats the "
                "hunk's lines too often). Nothing was changed. Give the hunk's true line numbers "
                "and distinctive context, or edit the file with run_code.",
                path=self.path,
                hunk=self.hunk,
            )
        if self.since_check >= _CHECK_EVERY:
            self.since_check = 0
            checkpoint()


# ASCII digits, at most 18 (int() refuses past 4,300 digits; no file has 10**18 lines)
_HUNK = re.compile(r"^@@ -([0-9]{1,18})(?:,([0-9]{1,18}))? \+([0-9]{1,18})(?:,([0-9]{1,18}))? @@")
_NO_NEWLINE = "\\ No newline at end of file"
_BINARY = re.compile(r"Binary files .* differ$")


@dataclass(frozen=True, kw_only=True)
class Hunk:
    header: str
    old_start: int
    lines: tuple[str, ...]  # each starts with " ", "-" or "+"
    old_no_newline: bool = False
    new_no_newline: bool = False

    @property
    def old(self) -> list[str]:
        return [line[1:] for line in self.lines if line[0] in " -"]

    @property
    def new(self) -> list[str]:
        return [line[1:] for line in self.lines if line[0] in " +"]


@dataclass(frozen=True, kw_only=True)
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: tuple[Hunk, ...]

    def __post_init__(self) -> None:
        # "--- /dev/null" over "+++ /dev/null" names no file: a diff is model input, refused
        # as one (an assert here crashed the run from the policy guard)
        if not (self.old_path or self.new_path):
            raise PatchRejected(
                "a file's '---' and '+++' headers are both /dev/null: name the file the diff "
                "creates (+++ b/path), changes or deletes (--- a/path). Nothing was changed."
            )

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""  # never "": see __post_init__


def _clean_path(raw: str) -> str | None:
    path = raw.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    if not path.strip("/"):
        raise PatchRejected(f"the header {_quote(raw)} names no file. Nothing was changed.")
    return path


def _quote(line: str) -> str:
    """A line of the diff quoted in a refusal, cut: the model sent it, and may send megabytes."""
    return repr(line[:120]) + ("…" if len(line) > 120 else "")


def _same_file(path: str) -> str:
    """The name two spellings of one workspace path share (``./x``, ``d/../x``, ``x``)."""
    return posixpath.normpath("/" + path)


_LINE_END = re.compile(r"\r?\n")


def parse_unified_diff(diff: str) -> list[FilePatch]:
    """Parse a (possibly multi-file) unified diff; ``PatchRejected`` if it is not one."""
    # lines end at \n (or \r\n) only: splitlines() also cut at \f, \x85, \u2028 and others,
    # which a file's line may hold, and the hunk's line came out cut short
    lines = _LINE_END.split(diff)
    if lines and lines[-1] == "":
        lines.pop()
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if lines[i] == "GIT binary patch" or _BINARY.match(lines[i]):
            # git's binary forms (base85 deltas, or no content at all): the first made an
            # empty file reported as applied, the second was skipped without a word
            raise PatchRejected(
                f"binary patches are not supported ({_quote(lines[i])}). Nothing was changed. "
                "Write the file with write_file, or make it with run_code."
            )
        empty = _empty_file(lines, i)
        if empty is not None:
            patches.append(empty[0])
            i = empty[1]
            continue
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        old_path, new_path = _clean_path(lines[i][4:]), _clean_path(lines[i + 1][4:])
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _read_hunk(lines, i, new_path or old_path or "")
            hunks.append(hunk)
        if not hunks:
            raise PatchRejected(f"no hunks for {new_path or old_path}", path=new_path or old_path or "")
        patches.append(FilePatch(old_path=old_path, new_path=new_path, hunks=tuple(hunks)))
    if not patches:
        raise PatchRejected("no unified diff found: expected '--- a/path', '+++ b/path' and '@@' hunks")
    _refuse_twice(patches)
    return patches


def _refuse_twice(patches: list[FilePatch]) -> None:
    """``PatchRejected`` when two of the diff's files name the same path: each would be checked
    against the file as it was and the last would win (``git apply`` refuses them too)."""
    seen: set[str] = set()
    for patch in patches:
        for path in {p for p in (patch.old_path, patch.new_path) if p is not None}:
            key = _same_file(path)
            if key in seen:
                raise PatchRejected(
                    f"the diff patches {path} twice. Nothing was changed. Send one diff per "
                    "file, all its hunks under one '---'/'+++' header.",
                    path=path,
                )
            seen.add(key)


def _empty_file(lines: list[str], start: int) -> tuple[FilePatch, int] | None:
    """An empty file created or deleted, as git writes it (``diff --git a/P b/P``, then ``new
    file mode`` or ``deleted file mode``, and no hunk: there is no line to show), and the index
    of the line after it; None when ``lines[start]`` does not start one."""
    rest = lines[start].removeprefix("diff --git a/")
    path = rest[: (len(rest) - 3) // 2]
    if rest == lines[start] or rest != f"{path} b/{path}" or not path:
        return None
    created = deleted = False
    i = start + 1
    while i < len(lines) and lines[i].startswith(("new file mode ", "deleted file mode ", "index ")):
        created = created or lines[i].startswith("new file mode ")
        deleted = deleted or lines[i].startswith("deleted file mode ")
        i += 1
    if created == deleted or (i < len(lines) and lines[i].startswith(("--- ", "@@", "Binary files "))):
        return None  # the header of a diff with lines (read as any other), or of neither
    return FilePatch(old_path=None if created else path, new_path=path if created else None, hunks=()), i


def _read_hunk(lines: list[str], i: int, path: str) -> tuple[Hunk, int]:
    """The hunk whose header is ``lines[i]``, and the index of the line after it."""
    match = _HUNK.match(lines[i])
    if match is None:
        raise PatchRejected(f"malformed hunk header {_quote(lines[i])}", path=path)
    header = lines[i]
    body: list[str] = []
    old_nl = new_nl = False
    i += 1
    while i < len(lines) and not lines[i].startswith(("@@", "--- ", "diff ")):
        line = lines[i]
        if line.startswith("\\"):
            if body and body[-1][0] == "-":
                old_nl = True
            elif body and body[-1][0] == "+":
                new_nl = True
            elif body:
                old_nl = new_nl = True
        elif line == "":
            body.append(" ")  # a blank context line whose leading space was stripped
        elif line[0] in " -+":
            body.append(line)
        else:
            break  # trailing prose after the diff
        i += 1
    while body and body[-1] == " " and _blank_tail(lines, i):
        body.pop()
    hunk = Hunk(
        header=header,
        old_start=int(match.group(1)),
        lines=tuple(body),
        old_no_newline=old_nl,
        new_no_newline=new_nl,
    )
    return hunk, i


def _blank_tail(lines: list[str], end: int) -> bool:
    """True when the blank lines before ``end`` were the diff's trailing newlines, not context."""
    return end >= len(lines) or lines[end].startswith(("--- ", "diff "))


class _Index:
    """The file's lines without trailing whitespace, and how often each occurs: built at the
    first hunk that is not where its header says (once per file; the diff's files hold at most
    ``MAX_PATCH_BYTES``), then kept up to date as hunks apply."""

    def __init__(self, lines: list[str]) -> None:
        self.stripped = [line.rstrip() for line in lines]
        self.counts = Counter(self.stripped)

    def splice(self, pos: int, size: int, new: list[str]) -> None:
        self.counts.subtract(self.stripped[pos : pos + size])
        added = [line.rstrip() for line in new]
        self.counts.update(added)
        self.stripped[pos : pos + size] = added


def _find(  # noqa: PLR0917
    lines: list[str],
    block: list[str],
    expected: int,
    floor: int,
    index: Callable[[], _Index],
    work: SearchWork,
) -> int | None:
    """Where ``block`` occurs, nearest to ``expected`` and not before ``floor``: an exact match
    anywhere before one that differs only in trailing whitespace; of two as near, the one met
    first in ``{expected - d, expected + d}`` (the order the search always had)."""
    size = len(block)
    if not block:
        return max(min(expected, len(lines)), floor)
    if floor <= expected and expected + size <= len(lines) and lines[expected : expected + size] == block:
        return expected  # where the header says: the common case, no search
    # Elsewhere: the hunk can only be where its rarest line is, so only those places are
    # compared whole (comparing at every place was O(file x hunk) of host CPU: hours).
    stripped, counts = index().stripped, index().counts
    wanted = [line.rstrip() for line in block]
    k = min(range(size), key=lambda i: counts[wanted[i]])
    if counts[wanted[k]] <= 0:
        return None
    exact: list[int] = []
    loose: list[int] = []
    at, end = floor + k, len(lines) - size + k + 1
    work.spend(max(end - at, 0))  # the scan for that line's places
    while at < end:
        try:
            at = stripped.index(wanted[k], at, end)
        except ValueError:
            break
        pos = at - k
        at += 1
        if stripped[pos] != wanted[0] or stripped[pos + size - 1] != wanted[-1]:
            work.spend(1)
            continue
        work.spend(size)
        if stripped[pos : pos + size] == wanted:
            loose.append(pos)
            if lines[pos : pos + size] == block:
                exact.append(pos)
    for found in (exact, loose):
        near = {pos for pos in found if abs(pos - expected) <= len(lines)}
        if near:
            distance = min(abs(pos - expected) for pos in near)
            for pos in {expected - distance, expected + distance}:
                if pos in near:
                    return pos
    return None


def apply_to_text(original: str, patch: FilePatch, *, work: SearchWork | None = None) -> str:
    """Apply every hunk of ``patch`` to ``original``, or raise ``PatchRejected`` naming the hunk
    (or saying the text is over ``MAX_PATCH_BYTES``, or that searching for a hunk went past
    ``work``, a diff's ``MAX_SEARCH_WORK`` by default)."""
    work = SearchWork() if work is None else work
    if len(original) > MAX_PATCH_BYTES:
        raise PatchRejected(_too_large(patch.path), path=patch.path)
    ends_with_newline = original.endswith("\n") or original == ""
    lines = original.split("\n")
    if original.endswith("\n"):
        lines.pop()
    if original == "":
        lines = []
    offset = 0
    floor = 0
    total = len(patch.hunks)
    work.path = patch.path
    held: list[_Index] = []

    def index() -> _Index:
        if not held:
            held.append(_Index(lines))
        return held[0]

    for number, hunk in enumerate(patch.hunks, 1):
        old, new = hunk.old, hunk.new
        expected = max(hunk.old_start - 1, 0) + offset if old else hunk.old_start + offset
        work.hunk = number
        pos = _find(lines, old, expected, floor, index, work)
        if pos is None:
            raise PatchRejected(
                _explain(patch.path, number, total, hunk, lines, expected), path=patch.path, hunk=number
            )
        at_end = pos + len(old) == len(lines)
        # a splice that changes the line count moves the file's tail (a memmove: cheap per line)
        work.spend((len(lines) - pos) // 4 if len(new) != len(old) else len(new))
        if held:
            held[0].splice(pos, len(old), new)
        lines[pos : pos + len(old)] = new
        offset += len(new) - len(old)
        floor = pos + len(new)
        if at_end and (hunk.old_no_newline or hunk.new_no_newline or old):
            ends_with_newline = not hunk.new_no_newline
    text = "\n".join(lines)
    return text + "\n" if ends_with_newline and lines else text


def _too_large(path: str) -> str:
    return (
        f"{path} is too large for apply_patch: it edits up to {MAX_PATCH_BYTES:,} bytes of files "
        "(all the files of one diff together). Nothing was changed. Edit the file with run_code."
    )


def _read_for_patch(sandbox: Sandbox, path: str, room: int) -> tuple[str, int]:
    """The text of ``path`` and its size, ``PatchRejected`` when it is over ``room`` bytes: no
    more than ``room + 1`` bytes of it are read."""
    try:
        data = sandbox.files.read_range(path, 0, room + 1)
    except SandboxFileNotFound:
        raise PatchRejected(f"{path}: no such file to patch", path=path) from None
    if len(data) > room:
        raise PatchRejected(_too_large(path), path=path)
    return data.decode("utf-8", "replace"), len(data)


def _explain(path: str, number: int, total: int, hunk: Hunk, lines: list[str], expected: int) -> str:  # noqa: PLR0917
    old = hunk.old
    where = f"hunk {number} of {total} for {path} ({hunk.header.split('@@')[1].strip()})"
    mismatch = ""
    for k, want in enumerate(old):
        at = expected + k
        have = lines[at] if 0 <= at < len(lines) else None
        if have != want:
            found = "the end of the file" if have is None else repr(have)
            mismatch = f" At line {at + 1} the hunk expects {want!r} but the file has {found}."
            break
    return (
        f"{where} does not apply: its context and removed lines were not found in the file.{mismatch}"
        " Nothing was changed. Read the current text with read_file and send a corrected diff."
    )


def patch_ops(diff: str) -> list[Op[Any]]:
    """The sandbox ops applying ``diff`` would issue (without their data), for a policy to judge
    every path it touches before anything happens: old and new names, renames, deletions.
    ``PatchRejected`` if it is not a diff."""
    ops: list[Op[Any]] = []
    for patch in parse_unified_diff(diff):
        if patch.old_path is None:
            ops.append(Stat(path=patch.path))  # a created file must not exist yet
        else:
            ops.append(ReadFile(path=patch.old_path))
            if patch.new_path != patch.old_path:  # deleted, or renamed away
                ops.append(Remove(path=patch.old_path))
        if patch.new_path is not None:
            ops.append(WriteFile(path=patch.new_path, data=b""))
    return ops


def apply_patch_to_sandbox(sandbox: Sandbox, diff: str) -> list[tuple[str, int, int]]:
    """Apply ``diff`` to the workspace: every file is checked before any is written.

    Returns ``(path, added, removed)`` per file. On a write failure the files already
    written are restored, so the workspace is left as it was.
    """
    plan: list[tuple[str, str | None, str | None]] = []  # path, before, after (None: absent)
    stats: list[tuple[str, int, int]] = []
    room = MAX_PATCH_BYTES
    work = SearchWork()  # one bound for the whole diff
    for patch in parse_unified_diff(diff):
        before: str | None = None
        if patch.old_path is not None:
            before, size = _read_for_patch(sandbox, patch.old_path, room)
            room -= size
        if patch.old_path is None and sandbox.files.exists(patch.path):
            raise PatchRejected(
                f"{patch.path} already exists; the diff creates it from /dev/null", path=patch.path
            )
        patched = apply_to_text(before or "", patch, work=work)
        if patch.new_path is None:
            if patched.strip() or (not patch.hunks and patched):  # no hunk: it must be empty
                raise PatchRejected(f"the diff deletes {patch.path} but leaves text in it", path=patch.path)
            plan.append((patch.path, before, None))
        else:
            if patch.old_path and patch.old_path != patch.new_path:
                plan.append((patch.old_path, before, None))
            plan.append((patch.new_path, before if patch.old_path == patch.new_path else None, patched))
        added = sum(1 for h in patch.hunks for line in h.lines if line[0] == "+")
        removed = sum(1 for h in patch.hunks for line in h.lines if line[0] == "-")
        stats.append((patch.path, added, removed))
    done: list[tuple[str, str | None]] = []
    try:
        for target, original, new_text in plan:
            if new_text is None:
                sandbox.files.remove(target)
            else:
                sandbox.files.write(target, new_text)
            done.append((target, original))
    except (StockadeError, RunStopped):  # a pause for approval too: the call runs again on resume
        for target, original in reversed(done):
            if original is None:
                sandbox.files.remove(target)
            else:
                sandbox.files.write(target, original)
        raise
    return stats
