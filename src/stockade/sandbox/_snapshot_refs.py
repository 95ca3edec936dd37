"""What keeps a snapshot: its refs (``refs/<kind>/<name>``), claimed by one resume at a time.

A part of ``SnapshotStore``. A ref is a small JSON file naming a snapshot and what its writer
added (a run's id, the role that took it); ``Held`` is a snapshot with the ref that keeps it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from stockade import exceptions as exc
from stockade._checks import _shown, check_text
from stockade.sandbox._snapshot_files import _NAME, REF_KINDS, SnapshotFolder, _snapshot_id, _writer_gone
from stockade.types import Snapshot

# A ref's field naming the role that took the snapshot (a service's tenant store): none, a
# token without a role, or a snapshot taken before the service said
ROLE_KEY = "role"
CLAIMED = ".claimed-"  # a ref being claimed (a resume): ``.NAME.claimed-PID-TOKEN``


@dataclass(frozen=True)
class Held:
    """A snapshot and a ref that keeps it: its ``kind`` (``paused``: a paused sandbox, named
    by its id; ``kept``: taken by a caller; ``run``: an agent run's sandbox, ``extra["run"]``
    the run's id; ``boot``: a microVM's boot image), its ``name``, and what its writer added."""

    snapshot: Snapshot
    kind: str
    name: str
    extra: Mapping[str, str]

    @property
    def holder(self) -> str:
        """Who keeps it, in words: ``paused sandbox sbx-...``, ``run <id>``, ``kept``, ``boot image``."""
        if self.kind == "paused":
            return f"paused sandbox {self.name}"
        if self.kind == "run":
            return f"run {self.extra.get('run', self.name)}"
        if self.kind == "boot":
            return "boot image"
        return "kept"

    @property
    def role(self) -> str | None:
        """The role that took it, where a service's ref says (``ROLE_KEY``)."""
        return self.extra.get(ROLE_KEY)


class SnapshotRefs(SnapshotFolder):
    """The refs of the store: set, read, dropped, listed and claimed."""

    def _ref(self, kind: str, name: str) -> Path:
        _ref_kind(kind)
        if not _NAME.match(check_text(name, argument="name")):
            raise exc.InvalidArgument(f"bad snapshot ref {kind}/{name}", argument="ref")
        return self._dir("refs") / kind / name

    def set_ref(self, kind: str, name: str, snapshot_id: str, **extra: str) -> None:
        path = self._ref(kind, name)
        _snapshot_id(snapshot_id)
        for key, value in extra.items():
            check_text(value, argument=key)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{name}-{secrets.token_hex(4)}")
        tmp.write_text(json.dumps({"snapshot": snapshot_id, **extra}))
        os.replace(tmp, path)

    def ref(self, kind: str, name: str) -> dict[str, str] | None:
        """What the ref holds (``snapshot``, and what its writer added), or None."""
        path = self._ref(kind, name)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # used: the boot image evicted last
        return {str(k): str(v) for k, v in data.items()}

    def drop_ref(self, kind: str, name: str) -> None:
        self._ref(kind, name).unlink(missing_ok=True)

    def refs(self, kind: str) -> list[tuple[str, str]]:
        _ref_kind(kind)
        folder = self.root / "refs" / kind
        out = []
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                if path.name.startswith("."):
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    out.append((path.name, str(json.loads(path.read_text())["snapshot"])))
        return out

    @contextlib.contextmanager
    def claim(self, kind: str, name: str) -> Iterator[dict[str, str]]:
        """Take a ref for oneself (a resume): one claimer wins, the others get
        ``SnapshotNotFound``. The ref is gone when the block ends well, back when it raises."""
        path = self._ref(kind, name)
        claimed = path.with_name(f".{name}{CLAIMED}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            try:
                os.rename(path, claimed)
            except FileNotFoundError:
                # a claimer killed mid-resume hid the ref for a day (found from outside): its
                # claim is put back once its process is gone, and taken again
                for dead in path.parent.glob(f".{name}{CLAIMED}*"):
                    if _writer_gone(dead) and not path.exists():
                        with contextlib.suppress(FileNotFoundError):
                            os.rename(dead, path)
                os.rename(path, claimed)
        except FileNotFoundError:
            raise exc.SnapshotNotFound(f"nothing {kind} under {name!r} in {self.label}") from None
        with contextlib.suppress(OSError):
            os.utime(claimed)  # when it was claimed (the ref kept its writing's time)
        try:
            data = json.loads(claimed.read_text())
            yield {str(k): str(v) for k, v in data.items()}
        except BaseException:
            os.rename(claimed, path)
            raise
        claimed.unlink(missing_ok=True)


def _ref_kind(kind: object) -> str:
    if not isinstance(kind, str) or kind not in REF_KINDS:
        choices = ", ".join(map(repr, REF_KINDS))
        raise exc.InvalidArgument(
            f"a snapshot ref's kind is {_shown(kind)}, not one of {choices}",
            argument="kind",
            fix=f"give one of {choices}",
        )
    return kind
