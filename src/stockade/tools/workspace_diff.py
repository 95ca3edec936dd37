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
``new file mode`` or ``deleted file mode`` header, after the files with lines. A file's mode
changed (the baseline keeps each file's permission bits) is named at the end, as files left
out are: a patch does not carry it.

The baseline and the diff are the run's own bookkeeping: the loop computes them through its
bookkeeping sandbox, which the model's path rules do not restrict (a policy that lets the
model read only ``src/**`` must not break the run's diff). They still never leave the
workspace: the sandbox confines every path, and paths that do not name a file inside the
workspace (symlinks, anything absolute or with ``..``) are skipped here.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import re
import time
from collections import Counter
from collections.abc import Callable

from stockade._vcs import command_files, in_vcs_folder
from stockade.exceptions import BaselineTampered, BaselineUnreadable, SandboxFileNotFound
from stockade.sandbox._archive_members import MAX_DEPTH
from stockade.sandbox._channel import loads_bounded
from stockade.sandbox._transfers import MAX_LIST_ENTRIES
from stockade.sandbox.facade import Sandbox
from stockade.tools._kept_folders import IGNORED_DIRS, Kept, ignored_folder, is_ignored
from stockade.tools.deadline import checkpoint
from stockade.types import EntryInfo, EntryType

__all__ = [
    "BASELINE",
    "DIFF_TIME_S",
    "IGNORED_DIRS",
    "MAX_DIFF_BYTES",
    "is_ignored",
    "record_baseline",
    "snapshot",
    "started_in_repository",
    "workspace_diff",
]

BASELINE = ".stockade/baseline.json"
# The most files a snapshot reads (a bound on its time, a read each): past it, a file is known
# by its size, status change time and inode (``_PAST``), and a change to it is named, not shown.
MAX_FILES = 5000
# Of them, the most in folders of dependencies, caches and build output (``is_ignored``) and of
# VCS, read after all others: a node_modules of 20,000 files took 5,000 reads (2.5 s at each end
# of a run) where the project had 200.
MAX_KEPT_FILES = 1000
MAX_TEXT_BYTES = 512 * 1024
# Of text held by one snapshot, counted as its baseline's JSON (escapes included); past it, hashes.
MAX_TEXT_TOTAL = 32 * 1024 * 1024
# A baseline's JSON: the text, and a name and a hash marker a file. A baseline the run recorded
# is read up to the size the host kept; this bounds one read without it (a caller's own).
MAX_BASELINE_BYTES = MAX_TEXT_TOTAL + MAX_LIST_ENTRIES * 1024
# The most a baseline's JSON makes of text per byte of it (``protocol.text_bytes``): it is
# ASCII (``record_baseline``), each byte at most one character, and one character past U+FFFF
# (an escaped emoji, or a name not UTF-8) holds them all at four bytes. A text budget of its
# exact size refused a baseline of 161 bytes with one curly apostrophe in it, and the diff
# showed every file as new (found from outside).
_TEXT_PER_BYTE = 4
# The JSON values a baseline holds at most (``json_values``' count): a file's name and text
# with their ":" and ",", its mode's name, ":" and ",", and the name of what is neither file
# nor folder with its ","; then its own keys. 3 a file refused one of 3,000 files (a mode is
# three) and the diff showed every file as new. A listing holds at most ``MAX_LIST_ENTRIES``.
_BASELINE_VALUES = (4 + 3 + 2) * MAX_LIST_ENTRIES + 16
_PIECE = 1024 * 1024
# Past this a file is known by its size, status change time and inode, not its hash: code can
# set a file's mtime back, never its ctime, so a change is still seen (a copy of the workspace
# elsewhere, a resume's, shows such a file as changed).
MAX_HASH_BYTES = 1 << 30
# The most the diff holds: past it, the files left are named, not shown (it is kept with the run).
MAX_DIFF_BYTES = 8 * 1024 * 1024
# The most a diff takes, reading included (a run out of wall time still gets one, this much
# later): the files not compared by then are named, not shown. A file pair is diffed whole.
DIFF_TIME_S = 30.0
PAIR_TIME_S = 5.0  # the most one pair's difflib takes before it is shown coarse
# The most difflib may walk to diff one file pair: the sum, over the old side's lines, of the
# places each is found in the new side (what its search for the longest match walks, at each
# level of its recursion). Lines repeated just under difflib's 1% "popular" threshold made one
# pair of 512 KiB files take 76-237 s of a host core, past the run's wall time (found from
# outside). Past this, or past the diff's time, a pair is shown as one change between its
# common head and tail: a coarser patch, which applies all the same.
MAX_PAIR_WORK = 4_000_000
_UNREAD = "\x00unread"  # a file not read before the deadline: neither changed nor unchanged
_UNNAMED = "\x00unnamed"  # a file whose name is not UTF-8 (``EntryInfo.lossy``): no call can read it
# A file past ``MAX_FILES``, not read: its size, status change time and inode (code can set a
# file's mtime back, never its ctime); a tier that does not say its ctime leaves it unknown.
_PAST = "\x00past:"
_PAST_UNKNOWN = "\x00past"
# The baseline's key for what its listing did not reach: the folders past ``MAX_DEPTH`` (as deep
# as a workspace uploads, and the run store, take), and "" when the listing stopped at its cap.
# A change there is in no snapshot: the diff names them, never leaves them out unsaid (a file 70
# folders deep, and one past the 5,000th, were changed with no word said, found from outside).
_UNLISTED = "\x00unlisted"
# The baseline's key for its files' permission bits (no path holds a NUL): a chmod changes no
# line, and a diff that showed none hid `chmod 4777 build.sh` from its reader (found from outside).
_MODES = "\x00modes"
# The baseline's key for what is neither file nor folder (links, FIFOs, sockets): a patch carries
# none, and a link code made was missing from the diff with no word said (found from outside).
_OTHERS = "\x00others"
# The baseline's key for whether the workspace was a git repository when the run began: `git_diff`
# runs git on that one only, never on a `.git` code made afterwards (``started_in_repository``).
_REPOSITORY = "\x00repository"
_BASELINE_ID = re.compile(r"sha256:([0-9a-f]{64}):([0-9]+)")


def _inside(path: str) -> bool:
    """A plain workspace-relative path (what a listing of the workspace should only hold)."""
    return not path.startswith("/") and ".." not in path.split("/")


def _digest(data: bytes) -> str:
    """Binary or large files are compared by hash, never shown."""
    return f"\x00sha256:{hashlib.sha256(data).hexdigest()}:{len(data)}"


def snapshot(
    sandbox: Sandbox,
    *,
    deadline: float | None = None,
    modes: dict[str, int] | None = None,
    others: list[str] | None = None,
    unlisted: list[str] | None = None,
    commands: set[str] | None = None,
) -> dict[str, str]:
    """path -> text (or a hash marker for binary and large files), the run's baseline file left
    out; ``modes``, if given, is filled with each of those files' permission bits, ``others``
    with the paths of what is neither file nor folder (links, FIFOs, sockets: a patch carries
    none), ``commands`` with the files a VCS tool would run or follow (``_vcs.command_files``).

    The host holds at most ``MAX_TEXT_TOTAL`` of text, whatever the workspace holds (5,000
    hard links to one text file of 512 KiB cost the sandbox 512 KiB, and were 2.5 GB here):
    past it, files are hashed a piece at a time, as large files are. Text is counted as the
    baseline's JSON holds it, escapes included. Past ``deadline`` (a ``time.monotonic()``
    reading) no more files are read: they are listed as unread. Past ``MAX_FILES`` files are
    not read: each is held by its size, status change time and inode. The files in folders of
    dependencies, caches and build output (``is_ignored``) and of VCS come after every other
    (a large node_modules costs a listing's entries, not reads); a VCS folder's are held by
    their hash, never their text (a patch never carries them). ``unlisted``, if given, is
    filled with what the listing did not reach (``_UNLISTED``)."""
    files: dict[str, str] = {}
    room, read = MAX_TEXT_TOTAL, 0
    listing = _listing(sandbox, unlisted)
    if others is not None:
        kinds = (EntryType.SYMLINK, EntryType.OTHER)
        found = (e.path for e in listing if e.type in kinds and _inside(e.path))
        others.extend(itertools.islice(found, MAX_FILES))
    plain = [e for e in listing if e.type == EntryType.FILE and _inside(e.path) and e.path != BASELINE]
    folders = (e.path for e in listing if e.type == EntryType.DIR)
    hazards = command_files((e.path for e in plain), folders)
    if commands is not None:
        commands.update(hazards)

    kept_read = 0
    for rank, entry in _in_order(plain, hazards):
        checkpoint()
        if modes is not None:
            modes[entry.path] = entry.mode & 0o7777
        kept = rank > 0
        if read >= MAX_FILES or (kept and kept_read >= MAX_KEPT_FILES):
            files[entry.path] = _past(entry)
            continue
        read += 1
        kept_read += kept
        if entry.lossy:
            files[entry.path] = _UNNAMED
            continue
        if deadline is not None and time.monotonic() >= deadline:
            files[entry.path] = _UNREAD
            continue
        if entry.size > MAX_HASH_BYTES and entry.ctime_ns:
            # by what it is rather than what it holds: a sparse file of a TiB costs code nothing
            files[entry.path] = f"\x00stat:{entry.size}:{entry.ctime_ns}:{entry.inode}"
            continue
        # a VCS folder's files by their hash: never shown, so never text the baseline holds
        limit = 0 if in_vcs_folder(entry.path) else max(0, min(room, MAX_TEXT_BYTES))
        try:
            content = _content(sandbox, entry.path, limit, deadline)
        except SandboxFileNotFound:  # removed while we listed
            if modes is not None:  # not kept: the baseline holds no more modes than files
                del modes[entry.path]
            continue
        if not content.startswith("\x00"):
            held = len(json.dumps(content))  # ASCII, as the baseline holds it
            if held > room:  # escapes made it larger than it read: held by its hash instead
                content = _digest(content.encode())
            else:
                room -= held
        files[entry.path] = content
    return files


def _in_order(plain: list[EntryInfo], hazards: set[str]) -> list[tuple[int, EntryInfo]]:
    """The files in the order a snapshot reads them, each with its rank: 0 the project's own (a
    repository's command files are its own), 1 in folders of tools' output, the least crowded
    folder first (a build/ of a few scripts the project keeps, before node_modules), 2 the rest
    of VCS folders. The files of text before the large ones (hashed a piece at a time): a few
    large files spent the diff's time before the sources were read (found from outside). By
    name within each: the same files fall past the reads in the baseline and now."""
    folders = {e.path: ignored_folder(e.path) for e in plain}
    crowds = Counter(folder for folder in folders.values() if folder)

    def order(entry: EntryInfo) -> tuple[int, int, bool, str]:
        path, large = entry.path, entry.size > MAX_TEXT_BYTES
        if path in hazards:
            return 0, 0, large, path
        if in_vcs_folder(path):
            return 2, 0, large, path
        folder = folders[path]
        return (1, crowds[folder], large, path) if folder else (0, 0, large, path)

    ranked = [(order(entry), entry) for entry in plain]
    ranked.sort(key=lambda pair: pair[0])
    return [(key[0], entry) for key, entry in ranked]


def _listing(sandbox: Sandbox, unlisted: list[str] | None) -> list[EntryInfo]:
    """The workspace's entries, as deep as a workspace is taken; ``unlisted``, if given, is
    filled with what the listing did not reach (``_UNLISTED``)."""
    found = sandbox.files.list("", depth=MAX_DEPTH + 1)
    if unlisted is not None:
        deep = {e.path.rsplit("/", 1)[0] for e in found if e.path.count("/") >= MAX_DEPTH}
        unlisted.extend(sorted(p for p in deep if _inside(p))[:MAX_FILES])
        if found.truncated:
            unlisted.append("")
    return [e for e in found if e.path.count("/") < MAX_DEPTH]


def _past(entry: EntryInfo) -> str:
    """A file past ``MAX_FILES``: what its listing says of it, unread (a name not UTF-8 never is)."""
    if entry.lossy:
        return _UNNAMED
    return f"{_PAST}{entry.size}:{entry.ctime_ns}:{entry.inode}" if entry.ctime_ns else _PAST_UNKNOWN


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
    modes: dict[str, int] = {}
    others: list[str] = []
    unlisted: list[str] = []
    found = snapshot(sandbox, modes=modes, others=others, unlisted=unlisted)
    files: dict[str, object] = {**found, _MODES: modes, _OTHERS: sorted(others), _UNLISTED: unlisted}
    # a folder, not a link (which would lead where code may write) nor a file naming another
    files[_REPOSITORY] = any(
        e.path == ".git" and e.type == EntryType.DIR for e in sandbox.files.list("", depth=1)
    )
    data = json.dumps(files).encode("ascii")  # names not UTF-8 are escaped surrogates
    sandbox.files.write(BASELINE, data)
    return f"sha256:{hashlib.sha256(data).hexdigest()}:{len(data)}"


class _Baseline:
    """What a baseline holds: the files, their modes, the paths of what was neither file nor
    folder, what its listing did not reach (``_UNLISTED``), and whether the workspace was a git
    repository (none of these but the files in a baseline written before it kept them)."""

    def __init__(self, data: dict[str, object]) -> None:
        kept = data.pop(_MODES, None)
        self.modes = (
            {str(k): v for k, v in kept.items() if isinstance(v, int)} if isinstance(kept, dict) else {}
        )
        listed = data.pop(_OTHERS, None)
        self.others = {str(p) for p in listed} if isinstance(listed, list) else set()
        unreached = data.pop(_UNLISTED, None)
        self.unlisted = {str(p) for p in unreached} if isinstance(unreached, list) else set()
        self.repository = data.pop(_REPOSITORY, None) is True
        self.files = {str(k): str(v) for k, v in data.items()}


def _load_baseline(sandbox: Sandbox, recorded: str | None) -> _Baseline:
    """The baseline the run wrote. ``recorded``: what ``record_baseline`` returned; the file is
    read no further than its size and refused unless its hash matches (``BaselineTampered``).
    None (a caller that kept nothing): the file as it is, within ``MAX_BASELINE_BYTES``; none
    there is an empty baseline. A file that does not parse is ``BaselineUnreadable``."""
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
        return _Baseline({})
    if known is not None and (len(raw) != cap or hashlib.sha256(raw).hexdigest() != known.group(1)):
        raise BaselineTampered(
            "the run's baseline in the workspace is not the one the run recorded (code in the "
            "sandbox rewrote it): no diff is made from it",
            path=BASELINE,
        )
    if len(raw) > cap:
        raise BaselineUnreadable(
            f"the workspace's baseline is over the {cap} bytes a baseline takes: no diff is made from it",
            path=BASELINE,
        )
    try:
        # Its bytes were bounded above; its text by what they can make at most, never less.
        data = loads_bounded(raw, max_bytes=_TEXT_PER_BYTE * len(raw), max_values=_BASELINE_VALUES)
    except (ValueError, RecursionError) as err:
        # Never an empty baseline in its place: that diff showed every file as new.
        whose = "the run's baseline (its hash matched)" if known else "the workspace's baseline"
        raise BaselineUnreadable(
            f"{whose} does not parse: {str(err)[:200]}; no diff is made from it", path=BASELINE
        ) from None
    if not isinstance(data, dict):
        raise BaselineUnreadable("the workspace's baseline is not a JSON object", path=BASELINE)
    return _Baseline(data)


def started_in_repository(sandbox: Sandbox, baseline: str | None) -> bool:
    """Whether the run's baseline, as the host recorded it (``baseline``: what
    ``record_baseline`` returned), says the workspace was a git repository when the run began.
    None (no baseline kept by the host): False, since code could have written the file."""
    return baseline is not None and _load_baseline(sandbox, baseline).repository


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
    start = _load_baseline(sandbox, baseline)
    before, modes_before = start.files, start.modes
    modes: dict[str, int] = {}
    others: list[str] = []
    unlisted: list[str] = []
    commands: set[str] = set()
    after = snapshot(
        sandbox, deadline=deadline, modes=modes, others=others, unlisted=unlisted, commands=commands
    )
    unreached = start.unlisted | set(unlisted)
    kept = Kept(commands)
    chunks: list[str] = []
    empties: list[str] = []  # after the others: git reads a `---` line after one as its own
    size = 0
    left_out: list[str] = []
    unshown: list[str] = []  # past the diff's size or time
    unnamed: list[str] = []  # names not UTF-8: neither read nor compared, named every time
    unread: list[str] = []  # past MAX_FILES: changed by their stamps, not read
    uncompared: list[str] = []  # past MAX_FILES on one side, or on a tier that gives no ctime
    for path in sorted(before.keys() | after.keys()):
        checkpoint()
        old, new = before.get(path), after.get(path)
        if _UNNAMED in (old, new):
            unnamed.append(path)
            continue
        if new == _UNREAD:
            unshown.append(path)
            continue
        if old != _PAST_UNKNOWN and kept.takes(path, old is None, _same(old, new)):
            continue
        if _beyond(path, old, new, unreached, out=(unread, uncompared)):
            continue
        if _same(old, new):
            continue
        if time.monotonic() >= deadline:
            unshown.append(path)
            continue
        if (keep is not None and not keep(path)) or not _plain_name(path):
            # A name with a newline in it wrote headers of its own into the diff: a whole patch
            # of README, or a Makefile, that `git apply` on the host took (git quotes such
            # names; a patch tool reading ours would not). Named below, escaped, instead.
            left_out.append(path)
            continue
        piece = _file_diff(path, old, new, deadline)
        if size + len(piece) > MAX_DIFF_BYTES:
            unshown.append(path)
            continue
        (empties if piece.startswith("diff --git ") else chunks).append(piece)
        size += len(piece)
    chunks += empties
    chunks.extend(_modes_changed(modes_before, modes, keep))
    made = [path for path in sorted(others) if path not in start.others]
    over = f"over the diff's {MAX_DIFF_BYTES // 2**20} MiB or {time_s:g} s; not compared or not shown"
    for why, paths in (
        (
            "the policy does not let the run write there, or the name holds control characters "
            "or begins or ends with a space",
            left_out,
        ),
        ("links, FIFOs or sockets made during the run: a patch carries none", made),
        ("names not UTF-8, shown with U+FFFD; not read or compared", unnamed),
        (over, unshown),
    ):
        if paths:
            chunks.append(f"Left out ({why}): {_names(paths)}\n")
    chunks.extend(_unreached(unread, uncompared, unreached))
    chunks.extend(kept.lines())
    return "".join(chunks)


def _modes_changed(
    before: dict[str, int], now: dict[str, int], keep: Callable[[str], bool] | None
) -> list[str]:
    """The line naming the files whose permission bits changed (at most 100 of them), if any."""
    changed = [
        f"{path} {before[path]:04o} -> {now[path]:04o}"
        for path in sorted(before.keys() & now.keys())
        if before[path] != now[path] and (keep is None or keep(path)) and _plain_name(path)
    ]
    if not changed:
        return []
    more = f", and {len(changed) - 100} more" if len(changed) > 100 else ""
    return [f"Modes changed (a patch does not carry them): {', '.join(changed[:100])}{more}\n"]


def _is_past(content: str | None) -> bool:
    return content is not None and content.startswith(_PAST_UNKNOWN)  # _PAST begins so too


def _beyond(
    path: str, old: str | None, new: str | None, unlisted: set[str], *, out: tuple[list[str], list[str]]
) -> bool:
    """Whether the diff's bounds kept a side of ``path`` from it. Missing on a side, in a folder
    a listing did not reach: named with the folder. Past ``MAX_FILES`` on a side: put in
    ``out``'s first (changed by its stamps, unread), or its second (not compared: a side was
    read by content, or its tier gives no ctime); in neither when its stamps match."""
    if (old is None or new is None) and _reached_by(path, unlisted):
        return True
    if not (_is_past(old) or _is_past(new)):
        return False
    if old != new or old == _PAST_UNKNOWN:
        unread, uncompared = out
        known = all(side is None or side.startswith(_PAST) for side in (old, new))
        (unread if known else uncompared).append(path)
    return True


_READS = (
    f"{MAX_FILES:,} files the diff reads ({MAX_KEPT_FILES:,} of them in folders of dependencies, "
    "build output or VCS)"
)


def _reached_by(path: str, unlisted: set[str]) -> bool:
    """Whether ``path`` is in what a listing did not reach ("": the whole workspace)."""
    return bool(unlisted) and ("" in unlisted or any(path.startswith(f"{d}/") for d in unlisted))


def _unreached(unread: list[str], uncompared: list[str], unlisted: set[str]) -> list[str]:
    """The "Left out" lines for what the diff's bounds kept it from reading or listing."""
    out = []
    if unread:
        why = (
            f"changed past the {_READS}: known by size, inode and status "
            "change time, not read, so not shown (a resumed run's restore changes those too)"
        )
        out.append(f"Left out ({why}): {_names(unread)}\n")
    if uncompared:
        why = f"past the {_READS}, at the run's start or now; not compared"
        out.append(f"Left out ({why}): {_names(uncompared)}\n")
    deep = sorted(d for d in unlisted if d)
    if deep:
        why = f"folders more than {MAX_DEPTH} deep, past what a listing takes; nothing in them compared"
        out.append(f"Left out ({why}): {_names(deep)}\n")
    if "" in unlisted:
        out.append(
            f"Left out (the workspace held more than the {MAX_LIST_ENTRIES:,} entries a listing "
            "carries, at the run's start or now: the files past them were not compared)\n"
        )
    return out


def _plain_name(path: str) -> bool:
    """A name a patch tool reads as written: no control characters (a newline wrote headers of
    its own), no space at either end of a part (GNU patch drops it: ``.env `` under review was
    ``.env`` once applied, as our own ``apply_patch`` reads it too)."""
    return path.isprintable() and all(part == part.strip() for part in path.split("/"))


def _file_diff(path: str, old: str | None, new: str | None, deadline: float) -> str:
    if (old or "").startswith("\x00") or (new or "").startswith("\x00"):
        return f"Binary or large file {path} differs\n"
    if not (old or new):  # an empty file created or deleted: no line to show, so git's header
        # (the baseline keeps no mode: a regular file's; e69de29 is the empty blob)
        mode, index = ("new", "0000000..e69de29") if old is None else ("deleted", "e69de29..0000000")
        return f"diff --git a/{path} b/{path}\n{mode} file mode 100644\nindex {index}\n"
    a, b = (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True)
    try:
        groups = (
            list(_Matcher(a, b, deadline).get_grouped_opcodes(3)) if _work(a, b) <= MAX_PAIR_WORK else None
        )
    except _TooCostly:
        groups = None
    if groups is None:
        groups = list(_Coarse(a, b).get_grouped_opcodes(3))
    # a name with a space ends at a tab, as git writes it: GNU patch reads "b/Makefile x.txt"
    # as "Makefile" otherwise (found from outside)
    end = "\t" if " " in path else ""
    out = [
        f"--- a/{path}{end}\n" if old is not None else "--- /dev/null\n",
        f"+++ b/{path}{end}\n" if new is not None else "+++ /dev/null\n",
    ]
    for group in groups:
        first, last = group[0], group[-1]
        out.append(f"@@ -{_range(first[1], last[2])} +{_range(first[3], last[4])} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out.extend(_line(" ", line) for line in a[i1:i2])
                continue
            out.extend(_line("-", line) for line in a[i1:i2])
            out.extend(_line("+", line) for line in b[j1:j2])
    return "".join(out) if groups else ""


def _range(start: int, stop: int) -> str:
    """A hunk's range as unified diffs spell it (``difflib.unified_diff``'s)."""
    length = stop - start
    if length == 1:
        return str(start + 1)
    return f"{start + 1 if length else start},{length}"


def _line(mark: str, line: str) -> str:
    return mark + line if line.endswith("\n") else mark + line + "\n\\ No newline at end of file\n"


def _work(a: list[str], b: list[str]) -> int:
    """What difflib's search for the longest match walks at one level of its recursion: each
    old line's places in the new side, but for the lines it counts as junk (autojunk: in more
    than 1% of a side of 200 lines or more)."""
    counts = Counter(b)
    popular = len(b) // 100 + 1 if len(b) >= 200 else len(b) + 1
    return sum(n for line in a if (n := counts.get(line, 0)) <= popular)


class _TooCostly(Exception):
    """The pair's diff ran past the diff's time: shown coarse."""


class _Matcher(difflib.SequenceMatcher[str]):
    """difflib's, looking at the time between its searches (and at the tool's deadline: a
    ``git_diff`` whose call timed out stops, rather than run on in its thread)."""

    def __init__(self, a: list[str], b: list[str], deadline: float) -> None:
        super().__init__(None, a, b)
        self._deadline = min(deadline, time.monotonic() + PAIR_TIME_S)

    def find_longest_match(
        self, alo: int = 0, ahi: int | None = None, blo: int = 0, bhi: int | None = None
    ) -> difflib.Match:
        checkpoint()
        if time.monotonic() >= self._deadline:
            raise _TooCostly
        return super().find_longest_match(alo, ahi, blo, bhi)


class _Coarse(difflib.SequenceMatcher[str]):
    """One change between the common head and the common tail: linear, whatever the lines."""

    def __init__(self, a: list[str], b: list[str]) -> None:
        super().__init__(None, a, b)
        self._sides = a, b

    def get_matching_blocks(self) -> list[difflib.Match]:
        a, b = self._sides
        head = 0
        while head < min(len(a), len(b)) and a[head] == b[head]:
            head += 1
        tail = 0
        while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
            tail += 1
        blocks = [difflib.Match(0, 0, head)] if head else []
        if tail:
            blocks.append(difflib.Match(len(a) - tail, len(b) - tail, tail))
        return [*blocks, difflib.Match(len(a), len(b), 0)]


def _names(paths: list[str]) -> str:
    return ", ".join(repr(p) for p in paths[:20]) + (f" ... ({len(paths)} in all)" if len(paths) > 20 else "")
