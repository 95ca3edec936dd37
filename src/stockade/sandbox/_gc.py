"""Garbage collection of what a crashed process left behind, for every tier, and of the
snapshot store: snapshots nothing keeps (deleted, resumed, boot images of an old kernel).

Each tier module may define ``collect_garbage() -> list[str]``; ``collect`` runs those of the
tiers whose module imports (a missing optional dependency means that tier left nothing).
The host's snapshot store is collected, and each folder of ``snapshot_dirs``: a store, or a
service's snapshot folder (``serve --snapshot-dir``), whose every tenant's store is collected.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path

from stockade.sandbox._registry import TIERS

_STORE_PARTS = ("objects", "snapshots", "refs", "tmp")


def collect(snapshot_dirs: Iterable[Path] = ()) -> list[str]:
    removed: list[str] = []
    for module_name, _, _ in TIERS.values():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        collector = getattr(module, "collect_garbage", None)
        if collector is not None:
            removed += collector()
    from stockade.sandbox.snapshots import SnapshotStore

    removed += SnapshotStore.default().collect()
    for folder in snapshot_dirs:
        for store in snapshot_stores(folder):
            removed += SnapshotStore(store).collect()
    from stockade.server import scratch  # the service's, in the default temporary folder

    removed += scratch.collect()
    return removed


def snapshot_stores(folder: Path) -> list[Path]:
    """``folder`` if it is a snapshot store, else the stores in it (a service's tenants')."""
    if any((folder / part).is_dir() for part in _STORE_PARTS):
        return [folder]
    children = sorted(folder.iterdir()) if folder.is_dir() else []
    return [child for child in children if any((child / part).is_dir() for part in _STORE_PARTS)]
