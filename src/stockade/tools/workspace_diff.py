"""The workspace's changes since the run began, as a unified diff (what ``git diff`` shows).

At the start of a run the agent records a baseline of the workspace's text files in
``.stockade/baseline.json`` inside the workspace itself, so a run resumed in another
process (with the workspace carried along) still diffs against its true beginning. The
diff is computed by our own code from ``sandbox.files``: no git needed in the image, and
it works on every tier and on the fake backend. Its output is a patch ``apply_patch`` takes.

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
from collections.abc import Callable

from stockade.exceptions import SandboxFileNotFound
from stockade.sandbox._channel import loads_bounded
from stockade.sandbox.facade import Sandbox
from stockade.types import EntryType

__all__ = ["BASELINE", "IGNORED_DIRS", "is_ignored", "record_baseline", "snapshot", "workspace_diff"]

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
MAX_TEXT_TOTAL = 32 * 1024 * 1024  # of text held by one snapshot; past it, hashes
# A baseline's JSON: its text escaped (six bytes a character at most), and the hashes.
MAX_BASELINE_BYTES = 6 * MAX_TEXT_TOTAL + MAX_FILES * 1024
_PIECE = 1024 * 1024
MAX_DEPTH = 64


def is_ignored(path: str) -> bool:
    """VCS, caches, dependencies and build output: not the project's own files."""
    return any(part in IGNORED_DIRS or part.endswith(".egg-info") for part in path.split("/"))


def _inside(path: str) -> bool:
    """A plain workspace-relative path (what a listing of the workspace should only hold)."""
    return not path.startswith("/") and ".." not in path.split("/")


def _digest(data: bytes) -> str:
    """Binary or large files are compared by hash, never shown."""
    return f"\x00sha256:{hashlib.sha256(data).hexdigest()}:{len(data)}"


def snapshot(sandbox: Sandbox) -> dict[str, str]:
    """path -> text (or a hash marker for binary and large files), ignored folders left out.

    The host holds at most ``MAX_TEXT_TOTAL`` of text, whatever the workspace holds (5,000
    hard links to one text file of 512 KiB cost the sandbox 512 KiB, and were 2.5 GB here):
    past it, files are hashed a piece at a time, as large files are."""
    files: dict[str, str] = {}
    room = MAX_TEXT_TOTAL
    for entry in sandbox.files.list("", depth=MAX_DEPTH):
        if entry.type != EntryType.FILE or is_ignored(entry.path) or not _inside(entry.path):
            continue
        if len(files) >= MAX_FILES:
            break
        try:
            content = _content(sandbox, entry.path, min(room, MAX_TEXT_BYTES))
        except SandboxFileNotFound:
            continue  # removed while we listed
        if not content.startswith("\x00"):
            room -= len(content)
        files[entry.path] = content
    return files


def _content(sandbox: Sandbox, path: str, room: int) -> str:
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


def record_baseline(sandbox: Sandbox) -> None:
    sandbox.files.write(BASELINE, json.dumps(snapshot(sandbox)))


def _load_baseline(sandbox: Sandbox) -> dict[str, str]:
    # The workspace's own file, which code there may rewrite: read and parsed within bounds.
    try:
        raw = sandbox.files.read_range(BASELINE, 0, MAX_BASELINE_BYTES + 1)
        data = loads_bounded(raw, max_bytes=MAX_BASELINE_BYTES, max_values=2 * MAX_FILES + 1)
    except SandboxFileNotFound:
        return {}
    except ValueError:  # not JSON, or over the bounds: not a baseline we wrote
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


def workspace_diff(sandbox: Sandbox, keep: Callable[[str], bool] | None = None) -> str:
    """A unified diff from the baseline to now; empty when nothing changed. ``keep``: which
    changed paths it may show (a policy's ``hands_back``); the others are named at its end."""
    before, after = _load_baseline(sandbox), snapshot(sandbox)
    chunks: list[str] = []
    left_out: list[str] = []
    for path in sorted(before.keys() | after.keys()):
        old, new = before.get(path), after.get(path)
        if _same(old, new):
            continue
        if (keep is not None and not keep(path)) or not path.isprintable():
            # A name with a newline in it wrote headers of its own into the diff: a whole patch
            # of README, or a Makefile, that `git apply` on the host took (git quotes such
            # names; a patch tool reading ours would not). Named below, escaped, instead.
            left_out.append(path)
            continue
        if (old or "").startswith("\x00") or (new or "").startswith("\x00"):
            chunks.append(f"Binary or large file {path} differs\n")
            continue
        old_lines = (old or "").splitlines(keepends=True)
        new_lines = (new or "").splitlines(keepends=True)
        diff = difflib.unified_diff(
            old_lines,
            new_lines,
            fromfile=f"a/{path}" if old is not None else "/dev/null",
            tofile=f"b/{path}" if new is not None else "/dev/null",
        )
        for line in diff:
            chunks.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    if left_out:
        shown = ", ".join(repr(p) for p in left_out[:20]) + (" ..." if len(left_out) > 20 else "")
        why = "the policy does not let the run write there, or the name holds control characters"
        chunks.append(f"Left out ({why}): {shown}\n")
    return "".join(chunks)
