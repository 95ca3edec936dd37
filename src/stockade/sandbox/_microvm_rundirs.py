"""The microVMs a killed process left behind: their QEMU, run folders and cgroups.

Apart from the backend because it runs without one (``stockade gc``, and once when a
backend prepares its first start): a run folder names its QEMU and the process that
created it (``owner.json``), and whatever of a dead creator is left is ended here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

from stockade.sandbox import _cgroups, _guest, _host


def collect_garbage() -> list[str]:
    """Kill the QEMU of every microVM whose creating process is gone, and remove its folder."""
    me = _guest.current_creator()
    removed: list[str] = []
    dead: set[str] = set()
    state_dir = _guest.default_state_dir()
    if not state_dir.is_dir():
        return removed
    _host.collect_staging(state_dir)
    for rundir in state_dir.glob("vm-sbx-*"):
        if _host.claimed(rundir):
            continue
        try:
            owner = json.loads((rundir / "owner.json").read_text())
        except (OSError, ValueError):
            age = _host.seconds_since_change(rundir)
            if age is None or age < 60:
                continue  # gone, or a previous version's creator starting it
            owner = {}
        if me.alive_here(str(owner.get("host", me.host)), str(owner.get("creator", ""))):
            continue
        pid = owner.get("pid")
        sid = rundir.name.removeprefix("vm-")
        if isinstance(pid, int):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                cmdline = b""
            if f"stockade-{sid}".encode() in cmdline:  # the pid was not reused
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(rundir, ignore_errors=True)
        dead.add(rundir.name)
        removed.append(f"microvm {sid}")
    removed += _cgroups.collect("vm-sbx-", lambda name: (state_dir / name).exists(), dead.__contains__)
    return removed
