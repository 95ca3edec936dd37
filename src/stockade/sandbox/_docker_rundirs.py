"""A container's folder on this host (a local engine only): made, released, collected.

``ctr-<sandbox id>`` in the state folder holds the files bound into the container (its
passwd and group, which name its uid) and the host tmpfs mounts gVisor needs, and names its
creator, so that ``collect_garbage`` (``stockade gc``) releases those of a creator that is
gone, without a backend and whether or not the engine answers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stockade.sandbox import _guest, _host, _rules
from stockade.sandbox.base import SandboxSpec


def make_rundir(
    spec: SandboxSpec, sid: str, uid: int, *, state_dir: Path, creator: _guest.Creator, host_tmpfs: bool
) -> tuple[Path, list[Path], dict[str, Path]]:
    """The sandbox's files on this host (a local engine only): its passwd and group,
    which name its uid, and the host tmpfs mounts gVisor needs; root's alone (0700)."""
    rundir = state_dir / f"ctr-{sid}"
    rundir.parent.mkdir(parents=True, exist_ok=True)
    _host.claim_folder(rundir)  # held until released: gc spares it before "creator" is written
    (rundir / "creator").write_text(f"{creator.host}\n{creator.token}\n")
    mounts: list[Path] = []
    binds: dict[str, Path] = {}
    try:
        etc = rundir / "etc"
        etc.mkdir(mode=0o755)
        for name, text in _guest.etc_files(uid).items():
            (etc / name).write_text(text)
            os.chmod(etc / name, 0o644)
            binds[f"/etc/{name}"] = etc / name
        if host_tmpfs:
            noexec = _rules.written_noexec(spec)
            for target, (size, inodes, mode) in _guest.tmpfs_sizes(spec).items():
                path = rundir / _guest.host_folder(target)
                path.mkdir()
                mounts.append(path)  # before the mount: one cut short is undone too
                _guest.mount_tmpfs(path, size=size, inodes=inodes, mode=mode, uid=uid, noexec=noexec)
                binds[target] = path
    except BaseException:
        release_mounts(rundir, mounts)
        raise
    return rundir, mounts, binds


def release_mounts(rundir: Path | None, mounts: list[Path]) -> None:
    for mount in mounts:
        _guest.umount(mount)
    if rundir is not None:
        shutil.rmtree(rundir, ignore_errors=True)
        _host.release_folder(rundir)


def collect_rundirs(state_dir: Path, me: _guest.Creator, live_ids: set[str]) -> list[str]:
    """The host folders (and mounts) of containers whose creator is gone."""
    removed: list[str] = []
    if not state_dir.is_dir():
        return removed
    _host.collect_uid_leases(state_dir)
    _host.collect_staging(state_dir)
    for rundir in state_dir.glob("ctr-*"):
        if _host.claimed(rundir):
            continue
        try:
            host, token = (rundir / "creator").read_text().split("\n")[:2]
        except (OSError, ValueError):
            age = _host.seconds_since_change(rundir)
            if age is None or age < 60:
                continue  # gone, or a previous version's creator writing it
            host, token = me.host, ""
        if rundir.name.removeprefix("ctr-") in live_ids or me.alive_here(host, token):
            continue
        areas = [rundir / name for name in ("workspace", "tmp", "shm")]
        release_mounts(rundir, [p for p in areas if p.is_mount()])
        removed.append(f"mounts {rundir}")
    return removed
