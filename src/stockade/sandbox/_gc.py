"""Garbage collection of what a crashed process left behind, for every tier, and of the
snapshot store: snapshots nothing keeps (deleted, resumed, boot images of an old kernel).

Each tier module may define ``collect_garbage() -> list[str]``; ``collect`` runs those of the
tiers whose module imports (a missing optional dependency means that tier left nothing).
"""

from __future__ import annotations

import importlib

from stockade.sandbox._registry import TIERS


def collect() -> list[str]:
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
    from stockade.server import scratch  # the service's, in the default temporary folder

    removed += scratch.collect()
    return removed
