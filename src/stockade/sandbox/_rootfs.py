"""The offline root filesystem the gVisor (without Docker) and microVM tiers boot from.

``scripts/build-image.sh`` (``stockade image build --offline``) builds it into the cache and
writes ``ROOTFS_MARKER`` last, so a folder with the marker is a finished build.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ROOTFS_MARKER", "cache_root", "find_rootfs"]

ROOTFS_MARKER = "etc/stockade-rootfs"


def cache_root() -> Path:
    """Where stockade keeps what it builds: ``STOCKADE_CACHE``, else ``~/.cache/stockade``."""
    return Path(os.environ.get("STOCKADE_CACHE") or Path.home() / ".cache" / "stockade")


def find_rootfs() -> Path | None:
    """The offline root filesystem: ``STOCKADE_ROOTFS``, else the newest one built in the cache."""
    explicit = os.environ.get("STOCKADE_ROOTFS")
    if explicit:
        return Path(explicit)
    built = [p for p in (cache_root() / "rootfs").glob("*") if (p / ROOTFS_MARKER).is_file()]
    return max(built, key=lambda p: (p / ROOTFS_MARKER).stat().st_mtime) if built else None
