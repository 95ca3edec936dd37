"""The process tier's run folders: each sandbox's, under the state folder, claimed by its
creator until the sandbox is gone, and collected (``collect_garbage``: ``stockade gc``, and once
when a backend prepares) when that creator is gone.

Apart from the backend because the collection runs without one: it reads only the folders,
their claims and the masked copies they list.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from stockade.sandbox import _builds, _cgroups, _rules_copies
from stockade.sandbox._host import (
    claim_folder,
    claimed,
    collect_staging,
    collect_uid_leases,
    start_time,
    umount,
)

__all__ = ["claim_rundir", "collect_garbage", "default_state_dir"]

OWNER_FILE = "owner"  # a run folder's claim (_host.claim_folder): its text is "pid start-time"
OWNERLESS_GRACE_S = 60.0  # a previous version's creator writes its owner just after the folder


def default_state_dir(is_root: bool) -> Path:
    if is_root:
        return Path("/run/stockade")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path(tempfile.gettempdir())
    return base / f"stockade-{os.getuid()}"


def claim_rundir(state_dir: Path, sid: str) -> Path:
    """The sandbox's run folder, held (``release_folder``) until the sandbox is gone: gc of
    any process takes a held claim for a live creator. Its claim is the owner file, whose
    text stays the previous versions' "pid start-time": their gc reads it."""
    rundir = state_dir / sid
    pid = os.getpid()
    claim_folder(rundir, file=OWNER_FILE, text=f"{pid} {start_time(pid)}")
    return rundir


def _owner_alive(rundir: Path) -> bool | None:
    """Whether the creator of ``rundir`` lives: it holds the claim (this version's creators),
    or its owner file names a process that runs (a previous version's, which never lock).
    None: the folder has no owner file."""
    if claimed(rundir, OWNER_FILE):
        return True
    try:
        with open(rundir / OWNER_FILE, "rb") as fh:
            text = fh.read(256).decode(errors="replace")
    except FileNotFoundError:
        return None
    except OSError:
        return False
    pid_text, _, started = text.partition(" ")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    return start_time(pid) == started and started != ""


def _abandoned(rundir: Path, grace_s: float) -> bool:
    """Whether the creator of a run folder is gone. A folder without an owner file is a
    previous version's creator between its folder and its owner (this version's folders
    appear with theirs): it is left for ``grace_s``."""
    alive = _owner_alive(rundir)
    if alive is not None:
        return not alive
    try:
        return time.time() - rundir.stat().st_mtime > grace_s
    except OSError:
        return False


def collect_garbage(state_dir: Path | None = None) -> list[str]:
    """Remove sandboxes (mounts, run folders, cgroups) whose creating process is gone."""
    base = state_dir or default_state_dir(os.geteuid() == 0)
    removed: list[str] = []
    dead: set[str] = set()
    if base.is_dir():
        collect_staging(base)  # a crash before its rename: no mounts yet
        for rundir in sorted(base.glob("sbx-*")):
            if not _abandoned(rundir, OWNERLESS_GRACE_S):
                continue
            dead.add(rundir.name)
            for name in ("workspace", "tmp", "shm"):
                umount(rundir / name)
            shutil.rmtree(rundir, ignore_errors=True)
            removed.append(f"process sandbox {rundir.name}")
        collect_uid_leases(base)
        removed += _builds.collect(base)  # after the dead sandboxes' folders: what they used may go
    removed += _cgroups.collect("sbx-", lambda name: (base / name).exists(), dead.__contains__)
    if os.geteuid() == 0:
        # what the live sandboxes of every tier bind (the dead process ones' folders are gone)
        removed += _rules_copies.collect_masked(
            _rules_copies.masked_folders(), _rules_copies.masks_in_use(base)
        )
    return removed
