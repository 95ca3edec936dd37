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
from collections.abc import Callable, Mapping
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
    run started with; ``keep``: the policy's hands_back."""
    changed = {path for path, state in files.items() if seed.files.get(path) != state}
    commands = (command_files(files, folders) | seed.configured.command_files(files, folders)) & changed
    refused = {p for p in changed - commands if keep is not None and not keep(p)}
    return Withheld(commands=tuple(sorted(commands)), refused=tuple(sorted(refused)))


def prune_folder(root: Path, *, seed: SeedFiles, keep: Callable[[str], bool] | None) -> Withheld:
    """Remove from the host folder ``root`` (a run's workspace, downloaded) what a copy leaves
    out; links are never followed, and a file is read only to compare it with the seed's."""
    files: dict[str, FileState] = {}
    folders: list[str] = []
    for top, dirs, names in os.walk(root):
        here = Path(top)
        rel = here.relative_to(root).as_posix()
        prefix = "" if rel == "." else f"{rel}/"
        for name in (*dirs, *names):
            path = here / name
            if path.is_dir() and not path.is_symlink():
                folders.append(f"{prefix}{name}")
            else:  # a link (to a folder too) is judged by its name: a `.git` link leads elsewhere
                st = path.lstat()
                plain = stat.S_ISREG(st.st_mode)
                files[f"{prefix}{name}"] = (
                    FileState.of_mode(_digest(path), st.st_mode) if plain else FileState("")
                )
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
