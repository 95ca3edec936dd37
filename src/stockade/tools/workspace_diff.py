"""The workspace's changes since the run began, as a unified diff (what ``git diff`` shows).

At the start of a run the agent records a baseline of the workspace's text files in
``.stockade/baseline.json`` inside the workspace itself, so a run resumed in another
process (with the workspace carried along) still diffs against its true beginning. Code in
the sandbox can rewrite that file, so the host keeps what it wrote: ``record_baseline`` returns
its SHA-256 and size (the run's state keeps them), and the diff reads no more than that size
and refuses a file with another hash (``BaselineTampered``): a forged baseline is neither
believed nor, at any size, read past the real one's. The
diff is computed by our own code from ``sandbox.files``: no git needed in the image, and
it works on every tier and on the fake backend. Its output is a patch ``apply_patch`` (and
``git apply``) takes: an empty file created or deleted, which has no line to show, is git's
``new file mode`` or ``deleted file mode`` header, after the files with lines.

The baseline and the diff are the run's own bookkeeping: the loop computes them through its
bookkeeping sandbox, which the model's path rules do not restrict (a policy that lets the
model read only ``src/**`` must not break the run's diff). They still never leave the
workspace: the sandbox confines every path, and paths that do not name a file inside the
workspace (symlinks, anything absolute or with ``..``) are skipped here.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import time
from collections.abc import Callable

from stockade.exceptions import BaselineTampered, SandboxFileNotFound
from stockade.sandbox._channel import loads_bounded
from stockade.sandbox.facade import Sandbox
from stockade.tools.deadline import checkpoint
from stockade.types import EntryType

__all__ = [
    "BASELINE",
    "DIFF_TIME_S",
    "IGNORED_DIRS",
    "MAX_DIFF_BYTES",
    "is_ignored",
    "record_baseline",
    "snapshot",
    "workspace_diff",
]

BASELINE = ".stockade/baseline.json"
IGNORED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        "node_modules",
        ".venv",
        "venv",
        "build",
        "dist",
        "target",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".tox",
        ".nox",
        ".stockade",
        ".eggs",
    }
)
MAX_FILES = 5000
MAX_TEXT_BYTES = 512 * 1024
# Of text held by one snapshot, counted as its baseline's JSON (escapes included); past it, hashes.
MAX_TEXT_TOTAL = 32 * 1024 * 1024
# A baseline's JSON: the text, and a name and a hash marker a file. A baseline the run recorded
# is read up to the size the host kept; this bounds one read without it (a caller's own).
MAX_BASELINE_BYTES = MAX_TEXT_TOTAL + MAX_FILES * 1024
_PIECE = 1024 * 1024
MAX_DEPTH = 64
# The most the diff holds: past it, the files left are named, not shown (it is kept with the run).
MAX_DIFF_BYTES = 8 * 1024 * 1024
# The most a diff takes, reading included (a run out of wall time still gets one, this much
# later): the files not compared by then are named, not shown. A file pair is diffed whole.
DIFF_TIME_S = 30.0
_UNREAD = "\x00unread"  # a file not read before the deadline: neither changed nor unchanged
_UNNAMED = "\x00unnamed"  # a file whose name is not UTF-8 (``EntryInfo.lossy``): no call can read it
_BASELINE_ID = re.compile(r"sha256:([0-9a-f]{64}):([0-9]+)")


def is_ignored(path: str) -> bool:
    """VCS, caches, dependencies and build output: not the project's own files."""
    return any(part in IGNORED_DIRS or part.endswith(".egg-info") for part in path.split("/"))


def _inside(path: str) -> bool:
    """A plain workspace-relative path (what a listing of the workspace should only hold)."""
    return not path.startswith("/") and ".." not in path.split("/")


def _digest(data: bytes) -> str:
    """Binary or large files are compared by hash, never shown."""
    return f"\x00sha256:{hashlib.sha256(data).hexdigest()}:{len(data)}"


def snapshot(sandbox: Sandbox, *, deadline: float | None = None) -> dict[str, str]:
    """path -> text (or a hash marker for binary and large files), ignored folders left out.

    The host holds at most ``MAX_TEXT_TOTAL`` of text, whatever the workspace holds (5,000
    hard links to one text file of 512 KiB cost the sandbox 512 KiB, and were 2.5 GB here):
    past it, files are hashed a piece at a time, as large files are. Text is counted as the
    baseline's JSON holds it, escapes included. Past ``deadline`` (a ``time.monotonic()``
    reading) no more files are read: they are listed as unread."""
    files: dict[str, str] = {}
    room = MAX_TEXT_TOTAL
    for entry in sandbox.files.list("", depth=MAX_DEPTH):
        checkpoint()
        if entry.type != EntryType.FILE or is_ignored(entry.path) or not _inside(entry.path):
            continue
        if len(files) >= MAX_FILES:
            break
        if entry.lossy:
            files[entry.path] = _UNNAMED
            continue
        if deadline is not None and time.monotonic() >= deadline:
            files[entry.path] = _UNREAD
            continue
        try:
            content = _content(sandbox, entry.path, max(0, min(room, MAX_TEXT_BYTES)), deadline)
        except SandboxFileNotFound:
            continue  # removed while we listed
        if not content.startswith("\x00"):
            held = len(json.dumps(content))  # ASCII, as the baseline holds it
            if held > room:  # escapes made it larger than it read: held by its hash instead
                content = _digest(content.encode())
            else:
                room -= held
        files[entry.path] = content
    return files


def _content(sandbox: Sandbox, path: str, room: int, deadline: float | None = None) -> str:
    """The file's text when it is UTF-8 of at most ``room`` characters, else its hash marker;
    the host never holds more than ``room`` bytes of it and a piece (read as it grows or not)."""
    head = sandbox.files.read_range(path, 0, room + 1)
    if len(head) <= room and b"\x00" not in head:
        try:
            return head.decode("utf-8")
        except UnicodeDecodeError:
            pass
    digest, size = hashlib.sha256(head), len(head)
    while size > room:  # more may follow: hashed a piece at a time
        if deadline is not None and time.monotonic() >= deadline:
            return _UNREAD
        piece = sandbox.files.read_range(path, size, _PIECE)
        digest.update(piece)
        size += len(piece)
        if len(piece) < _PIECE:
            break
    return f"\x00sha256:{digest.hexdigest()}:{size}"


def _same(old: str | None, new: str | None) -> bool:
    """Equal contents, one side held as text and the other as a hash marker included."""
    if old is None or new is None or old.startswith("\x00") == new.startswith("\x00"):
        return old == new
    text, marker = (new, old) if old.startswith("\x00") else (old, new)
    return _digest(text.encode()) == marker


def record_baseline(sandbox: Sandbox) -> str:
    """Write the workspace's baseline; returns what identifies it (``sha256:HEX:SIZE``), for
    the host to keep: the diff refuses any other file in its place."""
    data = json.dumps(snapshot(sandbox)).encode("ascii")  # names not UTF-8 are escaped surrogates
    sandbox.files.write(BASELINE, data)
    return f"sha256:{hashlib.sha256(data).hexdigest()}:{len(data)}"


def _load_baseline(sandbox: Sandbox, recorded: str | None) -> dict[str, str]:
    """The baseline the run wrote. ``recorded``: what ``record_baseline`` returned; the file is
    read no further than its size and refused unless its hash matches (``BaselineTampered``).
    None (a caller that kept nothing): the file as it is, within ``MAX_BASELINE_BYTES``."""
    known = _BASELINE_ID.fullmatch(recorded) if recorded is not None else None
    if recorded is not None and known is None:
        raise BaselineTampered(
            f"the baseline's record {recorded[:100]!r} is not sha256:HEX:SIZE", path=BASELINE
        )
    cap = int(known.group(2)) if known is not None else MAX_BASELINE_BYTES
    try:
        raw = sandbox.files.read_range(BASELINE, 0, cap + 1)
    except SandboxFileNotFound:
        if known is not None:
            raise BaselineTampered(
                "the run's baseline was removed from the workspace (by code in the sandbox): "
                "there is nothing to diff against",
                path=BASELINE,
            ) from None
        return {}
    if known is not None and (len(raw) != cap or hashlib.sha256(raw).hexdigest() != known.group(1)):
        raise BaselineTampered(
            "the run's baseline in the workspace is not the one the run recorded (code in the "
            "sandbox rewrote it): no diff is made from it",
            path=BASELINE,
        )
    try:
        data = loads_bounded(raw, max_bytes=cap, max_values=2 * MAX_FILES + 1)
    except ValueError:  # not JSON, or over the bounds: not a baseline we wrote
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


def workspace_diff(
    sandbox: Sandbox,
    keep: Callable[[str], bool] | None = None,
    *,
    baseline: str | None = None,
    time_s: float = DIFF_TIME_S,
) -> str:
    """A unified diff from the baseline to now; empty when nothing changed. ``keep``: which
    changed paths it may show (a policy's ``hands_back``); the others are named at its end.
    ``baseline``: what ``record_baseline`` returned (the file is verified against it). The diff
    holds at most ``MAX_DIFF_BYTES`` and takes at most ``time_s`` (and one file pair's diff):
    the files past either are named at its end, not shown."""
    deadline = time.monotonic() + time_s
    before = _load_baseline(sandbox, baseline)
    after = snapshot(sandbox, deadline=deadline)
    chunks: list[str] = []
    empties: list[str] = []  # after the others: git reads a `---` line after one as its own
    size = 0
    left_out: list[str] = []
    unshown: list[str] = []  # past the diff's size or time
    unnamed: list[str] = []  # names not UTF-8: neither read nor compared, named every time
    for path in sorted(before.keys() | after.keys()):
        checkpoint()
        old, new = before.get(path), after.get(path)
        if _UNNAMED in (old, new):
            unnamed.append(path)
            continue
        if new == _UNREAD:
            unshown.append(path)
            continue
        if _same(old, new):
            continue
        if time.monotonic() >= deadline:
            unshown.append(path)
            continue
        if (keep is not None and not keep(path)) or not path.isprintable():
            # A name with a newline in it wrote headers of its own into the diff: a whole patch
            # of README, or a Makefile, that `git apply` on the host took (git quotes such
            # names; a patch tool reading ours would not). Named below, escaped, instead.
            left_out.append(path)
            continue
        piece = _file_diff(path, old, new)
        if size + len(piece) > MAX_DIFF_BYTES:
            unshown.append(path)
            continue
        (empties if piece.startswith("diff --git ") else chunks).append(piece)
        size += len(piece)
    chunks += empties
    if left_out:
        why = "the policy does not let the run write there, or the name holds control characters"
        chunks.append(f"Left out ({why}): {_names(left_out)}\n")
    if unnamed:
        why = "names not UTF-8, shown with U+FFFD; not read or compared"
        chunks.append(f"Left out ({why}): {_names(unnamed)}\n")
    if unshown:
        why = f"over the diff's {MAX_DIFF_BYTES // 2**20} MiB or {time_s:g} s; not compared or not shown"
        chunks.append(f"Left out ({why}): {_names(unshown)}\n")
    return "".join(chunks)


def _file_diff(path: str, old: str | None, new: str | None) -> str:
    if (old or "").startswith("\x00") or (new or "").startswith("\x00"):
        return f"Binary or large file {path} differs\n"
    if not (old or new):  # an empty file created or deleted: no line to show, so git's header
        # (the baseline keeps no mode: a regular file's; e69de29 is the empty blob)
        mode, index = ("new", "0000000..e69de29") if old is None else ("deleted", "e69de29..0000000")
        return f"diff --git a/{path} b/{path}\n{mode} file mode 100644\nindex {index}\n"
    diff = difflib.unified_diff(
        (old or "").splitlines(keepends=True),
        (new or "").splitlines(keepends=True),
        fromfile=f"a/{path}" if old is not None else "/dev/null",
        tofile=f"b/{path}" if new is not None else "/dev/null",
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in diff
    )


def _names(paths: list[str]) -> str:
    return ", ".join(repr(p) for p in paths[:20]) + (f" ... ({len(paths)} in all)" if len(paths) > 20 else "")
