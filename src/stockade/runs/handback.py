"""What a copy of a run's workspace on the host leaves out, and says it left out.

A run's workspace is its code's: a copy written on the host (``stockade runs workspace``, the
service's artifacts) holds none of a repository's command files (``stockade._vcs``, with what
the seed's own config names: its hooks folder, its includes) but those the run started with,
byte for byte and executable or not as they were, and no change the policy's ``hands_back`` refuses (a path
the run may not write: a new ``.env`` under ``paths.deny``). What is left out is named: a copy
reviewed or started again from is never silently short.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stockade._vcs import Configured, command_files

__all__ = ["Exported", "FileState", "SeedFiles", "Withheld", "prune_folder", "withheld"]


@dataclass(frozen=True)
class FileState:
    """What a copy compares of a file with the seed's: its content, and whether it runs."""

    digest: str  # SHA-256 hex; "" for what is not a regular file (a link)
    executable: bool = False  # any x bit: `chmod +x` turns a seed's disabled hook on

    @classmethod
    def of_mode(cls, digest: str, mode: int) -> FileState:
        return cls(digest, bool(mode & 0o111))


@dataclass(frozen=True)
class SeedFiles:
    """The files a run started with (path -> state), and what its repositories' config names as
    commands (``core.hooksPath``, includes): the seed's, which is all that comes back of it."""

    files: Mapping[str, FileState] = field(default_factory=dict)
    configured: Configured = field(default_factory=Configured)


@dataclass(frozen=True)
class Withheld:
    """The paths a copy leaves out, by why."""

    commands: tuple[str, ...] = ()  # a repository's command files the run's seed did not hold so
    refused: tuple[str, ...] = ()  # changes the policy's hands_back refuses

    def lines(self) -> list[str]:
        """One line per reason that left something out, naming it (what a person reads)."""
        out = []
        if self.commands:
            why = (
                "a repository's files that make git, Mercurial or Jujutsu run programs (config, "
                "hooks, its hooksPath folder, an included config, a .git file...), not as the run "
                "started with them (content or executable bit)"
            )
            out.append(f"left out ({why}): {_names(self.commands)}")
        if self.refused:
            out.append(f"left out (the policy does not let the run write there): {_names(self.refused)}")
        return out


@dataclass(frozen=True)
class Exported:
    """What an export wrote: its count of files, and what it left out."""

    files: int
    withheld: Withheld = Withheld()
    unnamed: tuple[str, ...] = ()  # names not UTF-8: listed, never kept


def withheld(
    files: Mapping[str, FileState],
    folders: list[str],
    *,
    seed: SeedFiles,
    keep: Callable[[str], bool] | None,
) -> Withheld:
    """Of ``files`` (``folders``: the copy's folders), what it leaves out; ``seed``: what the
    run started with; ``keep``: the policy's hands_back. A file's state is looked at only
    where it decides (a command file, a path ``keep`` refuses): ``prune_folder`` hashes no other."""
    names = list(files)
    candidates = command_files(names, folders) | seed.configured.command_files(names, folders)

    def changed(path: str) -> bool:
        return seed.files.get(path) != files[path]

    commands = {path for path in candidates if changed(path)}
    refused = (
        set()
        if keep is None
        else {path for path in names if path not in candidates and not keep(path) and changed(path)}
    )
    return Withheld(commands=tuple(sorted(commands)), refused=tuple(sorted(refused)))


class _FolderStates(Mapping[str, FileState]):
    """The files of a host folder by path, each hashed when first asked for (a link is judged
    by its name: a ``.git`` link leads elsewhere)."""

    def __init__(self, root: Path, modes: dict[str, int]) -> None:
        self.root, self.modes, self.known = root, modes, dict[str, FileState]()

    def __getitem__(self, path: str) -> FileState:
        if path not in self.known:
            mode = self.modes[path]
            plain = stat.S_ISREG(mode)
            self.known[path] = FileState.of_mode(_digest(self.root / path), mode) if plain else FileState("")
        return self.known[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self.modes)

    def __len__(self) -> int:
        return len(self.modes)


def prune_folder(root: Path, *, seed: SeedFiles, keep: Callable[[str], bool] | None) -> Withheld:
    """Remove from the host folder ``root`` (a run's workspace, downloaded) what a copy leaves
    out; links are never followed, and only a file whose state decides (``withheld``) is read."""
    modes: dict[str, int] = {}
    folders: list[str] = []
    for top, dirs, names in os.walk(root):
        here = Path(top)
        rel = here.relative_to(root).as_posix()
        prefix = "" if rel == "." else f"{rel}/"
        for name in (*dirs, *names):
            path = here / name
            if path.is_dir() and not path.is_symlink():
                folders.append(f"{prefix}{name}")
            else:
                modes[f"{prefix}{name}"] = path.lstat().st_mode
    files = _FolderStates(root, modes)
    out = withheld(files, folders, seed=seed, keep=keep)
    for gone in (*out.commands, *out.refused):
        (root / gone).unlink()
    return out


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        for piece in iter(lambda: file.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def _names(paths: tuple[str, ...]) -> str:
    return ", ".join(repr(p) for p in paths[:20]) + (f" ... ({len(paths)} in all)" if len(paths) > 20 else "")
