"""A memory snapshot holds its own user's memory only, on the tiers that take one.

A pooled (or reset) sandbox empties /tmp, /dev/shm, the workspace and the interpreter between
users; the memory that held them goes back to the guest's kernel. A memory snapshot copies all
of the guest's memory into the snapshot store, freed pages too: the next user's snapshot must
not carry the last user's bytes (their quota would pay for them, their retention keep them,
erasing the last user would leave them in the next one's copy).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from stockade import Limits, Sandbox, SnapshotKind, SnapshotStore
from stockade.sandbox import microvm
from stockade.sandbox.pool import SandboxPool
from tests.conftest import require_tier
from tests.integration.microvm_images import BootImages

COPIES = 100_000  # ~2 MB of each marker: many pages, in every place the user left it


def _leave_marks(sbx: Sandbox, mark: str) -> None:
    """The user's bytes in a file of /tmp, of /dev/shm, the interpreter's heap and an upload."""
    result = sbx.run_code(
        f"m = {mark!r}\n"
        f"open('/tmp/a.txt', 'w').write((m + '-file-') * {COPIES})\n"
        f"open('/dev/shm/a', 'w').write((m + '-shm-') * {COPIES})\n"
        f"held = (m + '-heap-') * {COPIES}\n"
        "len(held)"
    )
    assert result.error is None, result.error
    sbx.files.write("up.bin", (mark + "-upload-").encode() * COPIES)
    assert sbx.commands.run("grep -c -- -upload- up.bin").stdout == "1\n"


KINDS = ("file", "shm", "heap", "upload")


def _holding(root: Path, mark: str) -> dict[str, int]:
    """For each kind of the user's marks, how many files under ``root`` hold it."""
    needles = {kind: f"{mark}-{kind}-".encode() for kind in KINDS}
    found = dict.fromkeys(KINDS, 0)
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        seen: set[str] = set()
        with path.open("rb") as fh:
            tail = b""
            while chunk := fh.read(1 << 24):
                seen.update(kind for kind, needle in needles.items() if needle in tail + chunk)
                tail = chunk[-64:]
        for kind in seen:
            found[kind] += 1
    return {kind: n for kind, n in found.items() if n}


def _backend(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> microvm.MicroVMBackend | None:
    """The microVM's in a store of its own, from the session's boot images (a cold boot under
    TCG is not what this is about); the tier's default on gVisor."""
    if tier != "microvm":
        return None
    boot_images: BootImages = request.getfixturevalue("microvm_boot_images")
    return microvm.MicroVMBackend(snapshot_store=boot_images(tmp_path / "boot"))


@pytest.mark.parametrize("tier", ["microvm", "gvisor"])
def test_the_next_users_memory_snapshot_holds_nothing_of_the_last(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    require_tier(tier)
    mark = f"LAST-USER-{secrets.token_hex(8)}"
    own, store = SnapshotStore(tmp_path / "last-users"), SnapshotStore(tmp_path / "next-users")
    backend = _backend(tier, tmp_path, request)
    try:
        with SandboxPool(tier, size=1, backend=backend, limits=Limits(memory_mb=256, timeout_s=60)) as pool:
            with pool.acquire() as last:
                _leave_marks(last, mark)
                first = last.id
                last.snapshot(memory=True, store=own)  # the scan finds the marks where they are
            with pool.acquire() as nxt:
                assert nxt.id == first, f"replaced, not recycled: {pool.stats().last_replaced_why}"
                snap = nxt.snapshot(memory=True, store=store)
                assert snap.kind is SnapshotKind.MEMORY
        assert set(_holding(own.root, mark)) == set(KINDS)
        assert _holding(store.root, mark) == {}
    finally:
        if backend is not None:
            backend.close()
