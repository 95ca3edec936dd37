"""The snapshot store's folder: its layout, the names it writes, the mark that makes it a
store (or the layout an older version made), and how its files are opened (never through a
link, never waited on).

The base of the store's other parts (``_snapshot_refs``, ``_snapshot_content``,
``_snapshot_room``, ``snapshots``): whether a folder is a store at all is decided here, before
``stockade gc`` removes anything from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade._checks import _shown, check_text
from stockade.sandbox import _trusted
from stockade.types import Snapshot

MiB = 1024 * 1024
MAX_BYTES = 1 << 62  # past any disk; and a size an int64 (st_blocks, a tar header) holds
ID_PREFIX = "snap-"
ID_HEX = 32  # 128 bits of the manifest's hash name a snapshot
CHUNK = 4 * MiB
REF_KINDS = ("paused", "kept", "boot", "run")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_WRITER = re.compile(r"-([0-9]+)-[0-9a-f]{8,12}$")  # the pid in a ``temp_path``'s or claim's name
_MANIFEST_NAME = re.compile(r"^[0-9a-f]{64}\.json$")
# Written when a store is made: no folder is collected without it (but one an older version
# made, known by its layout, and marked then). Its format is the layout's: a newer one's
# store is not collected by code that may misjudge it.
MARKER = ".stockade-snapshot-store"
STORE_FORMAT = 1
_MARKER_KIND = "stockade snapshot store"
_STORE_PARTS = frozenset({"objects", "snapshots", "refs", "verified", "tmp", "reserved", "reading", "lock"})
_MAX_MANIFEST = 1 << 20


class SnapshotFolder:
    """The store's folder (``root``): its parts made on first use (0700, root's alone), its
    mark, and the paths of its objects and of what is being written. A part of
    ``SnapshotStore``, which holds the fields."""

    root: Path
    max_bytes: int
    name: str
    _mark_found: bool
    _known_store: bool

    @property
    def label(self) -> str:
        return self.name or str(self.root)

    def _dir(self, name: str) -> Path:
        # A restore loads what is here into a sandbox, QEMU or runsc: no other user's store.
        path = self.root / name
        if not _trusted.check(path).is_dir():
            root = _trusted.folder(self.root, 0o700)
            os.chmod(root, 0o700)
            path.mkdir(exist_ok=True, mode=0o700)
        # What holds snapshots is a store from its first write on (one an older version made
        # too): a lock or a read alone marks nothing (``snapshots delete`` given a wrong folder)
        if name in ("objects", "snapshots", "refs", "tmp") and not self._mark_found:
            object.__setattr__(self, "_mark_found", os.path.lexists(self.root / MARKER) or self._mark())
        return path

    def _mark(self) -> bool:
        """Write the mark; whether it is there now."""
        marker = self.root / MARKER
        tmp = marker.with_name(f"{MARKER}.{secrets.token_hex(4)}")
        try:
            tmp.write_text(json.dumps({"store": _MARKER_KIND, "format": STORE_FORMAT}) + "\n")
            os.replace(tmp, marker)
        except OSError:  # a store mounted read-only: nothing here collects it either
            tmp.unlink(missing_ok=True)
            return False
        object.__setattr__(self, "_mark_found", True)
        object.__setattr__(self, "_known_store", True)
        return True

    def recognised(self) -> bool:
        """Whether the folder is a snapshot store, which ``collect`` may remove from: it holds
        the store's mark (``MARKER``), or it is a store an older version made, before the
        mark, known by a layout nothing else has (only the store's folders; objects named by
        64 hex digits; manifests that hash to their names), and marked now. Once known, the
        mark is not read again."""
        if not (self._known_store or self._marked()):
            if not _made_before_marks(self.root):
                return False
            self._mark()
        object.__setattr__(self, "_known_store", True)
        return True

    def _marked(self) -> bool:
        try:
            fd = _open_regular(self.root / MARKER)
        except OSError:
            return False
        if fd is None:
            return False
        try:
            data = json.loads(os.read(fd, 4096))
        except (OSError, ValueError):
            return False
        finally:
            os.close(fd)
        return isinstance(data, dict) and (data.get("store"), data.get("format")) == (
            _MARKER_KIND,
            STORE_FORMAT,
        )

    def object_path(self, digest: str) -> Path:
        if not _DIGEST.match(check_text(digest, argument="digest", fix="give an object's SHA-256 in hex")):
            raise exc.SnapshotCorrupt(f"a snapshot names an object {digest[:80]!r}, which is no SHA-256")
        return self.root / "objects" / digest

    def temp_path(self, hint: str = "blob") -> Path:
        """A fresh path to write an object to, before ``add_file`` names it by its hash."""
        if not _NAME.match(check_text(hint, argument="hint")):  # a "/" would leave tmp/
            raise exc.InvalidArgument(
                f"hint {_shown(hint)} is no file name",
                argument="hint",
                fix="give letters, digits, '.', '_', '-'",
            )
        return self._dir("tmp") / f"{hint}-{os.getpid()}-{secrets.token_hex(6)}"


def _snapshot_id(snapshot: object) -> str:
    """The id of a ``Snapshot`` or the str given; anything else (None, a number) is refused,
    not looked up as its ``str()`` (a ``delete(None)`` did nothing and said nothing)."""
    if isinstance(snapshot, Snapshot):
        return snapshot.id
    return check_text(
        snapshot, argument="snapshot", fix="give a Snapshot or its id (snap- and 32 hex digits)"
    )


def _entries(folder: Path) -> list[Path]:
    """What ``folder`` holds; nothing when it is a link (the store made it a folder: a link
    in its place leads elsewhere, to what is not the store's)."""
    return [] if not _is_folder(folder) else sorted(folder.iterdir())


def _is_folder(path: Path) -> bool:
    """A folder itself, not a link to one."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def _made_before_marks(root: Path) -> bool:
    """Whether ``root`` is a store an older version made: only the store's own folders, and
    at least one object or manifest; every object named by its SHA-256, every manifest a
    text that hashes to its name and parses as one. A folder that merely holds a tmp/ or an
    objects/ (a project's, a home) is none."""
    try:
        names = set(os.listdir(root))
        if not names <= _STORE_PARTS | {MARKER} or not names & {"objects", "snapshots"}:
            return False
        if not all(_is_folder(root / name) for name in names - {"lock", MARKER}):
            return False
        found = 0
        for path in _entries(root / "objects"):
            if not _DIGEST.fullmatch(path.name) or not stat.S_ISREG(path.lstat().st_mode):
                return False
            found += 1
        for path in _entries(root / "snapshots"):
            if not _MANIFEST_NAME.fullmatch(path.name) or not _is_manifest(path):
                return False
            found += 1
        kinds = {path.name for path in _entries(root / "refs")}
        return found > 0 and kinds <= set(REF_KINDS)
    except OSError:
        return False


def _is_manifest(path: Path) -> bool:
    """Whether ``path`` is a manifest of any format: a regular file of at most
    ``_MAX_MANIFEST`` bytes whose text hashes to its name and names its objects."""
    try:
        fd = _open_regular(path)
        if fd is None:
            return False
        with open(fd, "rb") as fh:
            text = fh.read(_MAX_MANIFEST + 1)
    except OSError:
        return False
    data = _manifest_fields(text, path.name.removesuffix(".json")) if len(text) <= _MAX_MANIFEST else None
    return data is not None and isinstance(data.get("blobs"), dict) and "format" in data


def _manifest_fields(text: bytes, digest: str) -> dict[str, Any] | None:
    """A manifest's fields, when its ``text`` hashes to ``digest`` (its name) and is a JSON
    object; else None."""
    if hashlib.sha256(text).hexdigest() != digest:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _open_regular(path: Path) -> int | None:
    """A descriptor reading ``path`` (blocking) when it is a regular file, None when it is
    anything else: never opened through a link (``OSError``, ELOOP) nor waited on (a FIFO in
    an object's place hung a restore for good, a link to /dev/zero streamed zeros)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            os.set_blocking(fd, True)
    except OSError:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        return None
    return fd


def _disk_size(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _writer_gone(path: Path) -> bool:
    """A write under ``tmp/`` or a claimed ref whose process (its name says which) is gone
    from this machine."""
    found = _WRITER.search(path.name)
    return found is not None and not Path(f"/proc/{found.group(1)}").exists()
