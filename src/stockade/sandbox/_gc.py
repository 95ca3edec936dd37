"""Garbage collection of what a crashed process left behind, for every tier, and of the
snapshot store: snapshots nothing keeps (deleted, resumed, boot images of an old kernel).

Each tier module may define ``collect_garbage() -> list[str]``; ``collect`` runs those of the
tiers whose module imports (a missing optional dependency means that tier left nothing).
The host's snapshot store is collected, and each of ``stores``: what ``snapshot_stores`` finds
in a folder (``gc --snapshot-dir``: a store, or a service's snapshot folder, whose every
tenant's store is collected). A store is known by its mark (``SnapshotStore.recognised``),
never by its folders' names: a parent folder given by mistake, whose projects held a tmp/ or
an objects/, lost their files.
"""

from __future__ import annotations

import contextlib
import importlib
import stat
from collections.abc import Iterable
from pathlib import Path

from stockade.sandbox._registry import TIERS
from stockade.sandbox.snapshots import SnapshotStore


def collect(stores: Iterable[SnapshotStore] = ()) -> list[str]:
    removed: list[str] = []
    for module_name, _, _ in TIERS.values():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        collector = getattr(module, "collect_garbage", None)
        if collector is not None:
            removed += collector()
    removed += SnapshotStore.default().collect()
    for store in stores:
        removed += store.collect()
    from stockade.server import scratch  # the service's, in the default temporary folder

    removed += scratch.collect()
    return removed


def snapshot_stores(folder: Path) -> list[SnapshotStore]:
    """``folder`` if it is a snapshot store, else the stores in it (a service's tenants'): a
    child reached through a link is none (it leads out of the folder, to another's files)."""
    store = SnapshotStore(folder)
    if store.recognised():
        return [store]
    found = []
    with contextlib.suppress(OSError):  # not a folder, or not ours to read: no store
        for child in sorted(folder.iterdir()):
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(child.lstat().st_mode) and (store := SnapshotStore(child)).recognised():
                    found.append(store)
    return found
