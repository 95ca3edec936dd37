"""How a tier puts the masks in place: ``(host source, inside path)`` binds, by folder where
a masked copy can be made (``mask_binds``), and within gVisor's bounds (``own_kernel_binds``).

Apart from the plan (``_rules``), which says what is masked, and the copies
(``_rules_copies``), which live on the host: this is asked at each start.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

from stockade import exceptions as exc
from stockade.sandbox._rules_copies import MaskCache, masked_folder


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
