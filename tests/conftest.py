"""Shared test helpers.

A test that needs a real backend (bubblewrap, dockerd, runsc, redis, postgres) asks for it
with ``require(name, available, why)``: on a laptop without it the test skips; in CI
(``CI=true``) a missing backend is a failure, never a silent skip.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(name: str, available: bool, why: str = "") -> None:
    """Skip (locally) or fail (in CI) when ``name`` is not available."""
    if available:
        return
    message = f"{name} is not available{': ' + why if why else ''}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: missing backends fail instead of skipping)")
    pytest.skip(message)


def tier_available(tier: str) -> tuple[bool, str]:
    from stockade.sandbox import _registry

    report = _registry.probe(tier)
    return report.available, report.detail


def require_tier(tier: str) -> None:
    ok, detail = tier_available(tier)
    require(f"tier {tier!r}", ok, detail)


def host_processes(matching: bytes) -> list[int]:
    """Pids of host processes whose command line contains ``matching`` (NULs between args)."""
    from pathlib import Path

    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue  # gone meanwhile
            if matching in cmdline:
                found.append(int(name))
    return found


def processes_of_uid(uid: int) -> list[int]:
    """Pids of live host processes running as ``uid`` (a zombie only waits for its reaper,
    which for a sandbox's orphans is the host's init)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:
                    continue
                with open(f"/proc/{name}/stat", "rb") as fh:
                    state = fh.read().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue  # gone meanwhile
            if state not in (b"Z", b"X"):
                found.append(int(name))
    return found
