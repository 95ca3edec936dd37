"""Snapshots through ``stockade serve`` (real uvicorn, SQLite, the process tier) and the
Python client: a snapshot forks sandboxes that each see its files, a paused sandbox frees its
place and comes back under its id through another client, and another tenant finds none of
it (404, as for an id that never was)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import Limits
from stockade import exceptions as exc
from stockade.client import Client, RemoteSandbox
from stockade.sandbox._snapshot_files import MARKER, MiB
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import SnapshotKind
from tests.conftest import require_tier
from tests.integration.service_env import Server, Tokens, write_tenants

pytestmark = [pytest.mark.process]

LIMITS = Limits(memory_mb=256, timeout_s=20)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path]]:
    require_tier("process")
    folder = tmp_path_factory.mktemp("service")
    tenants, tokens = write_tenants(folder, sandboxes=2)
    snapshots = folder / "snapshots"
    server = Server(
        tenants, f"sqlite:///{folder / 'service.db'}", folder, extra=["--snapshot-dir", str(snapshots)]
    )
    try:
        yield server, tokens, snapshots
    finally:
        server.stop()
    assert server.proc.returncode in (0, -15), server.output()[-3000:]
    assert "Traceback" not in server.output(), server.output()[-3000:]


def test_a_snapshot_forks_and_a_pause_resumes_through_another_client(
    service: tuple[Server, Tokens, Path],
) -> None:
    server, tokens, snapshots = service
    with Client(server.url, tokens.acme) as acme, Client(server.url, tokens.other) as other:
        with RemoteSandbox.create("process", limits=LIMITS, client=acme) as prepared:
            prepared.files.write("data/input.txt", "prepared")
            prepared.commands.run("echo cached > /tmp/cache.txt")
            snap = prepared.snapshot()
        assert snap.kind is SnapshotKind.FILES and snap.tier == "process" and snap.source == prepared.id
        assert (snapshots / "acme").is_dir() and not (snapshots / "other").exists()  # a store per tenant

        forks = [RemoteSandbox.create(client=acme, snapshot=snap) for _ in range(2)]  # the quota: two
        try:
            for number, fork in enumerate(forks):
                assert fork.id != prepared.id and fork.tier == "process"
                assert fork.files.read("data/input.txt") == "prepared"
                assert fork.commands.run("cat /tmp/cache.txt").stdout == "cached\n"
                fork.files.write("mine.txt", str(number))
            assert [f.files.read("mine.txt") for f in forks] == ["0", "1"]  # each its own
            with pytest.raises(exc.SnapshotNotFound):  # another tenant's snapshot: not found
                RemoteSandbox.create(client=other, snapshot=snap.id)

            paused_id = forks[0].id
            paused = forks[0].pause()
            assert paused.source == paused_id
            # paused, it holds no place: the quota of two has room for a new sandbox
            with RemoteSandbox.create("process", limits=LIMITS, client=acme) as meanwhile:
                assert not meanwhile.files.exists("mine.txt")
            with pytest.raises(exc.SnapshotNotFound):
                RemoteSandbox.resume(paused_id, client=other)
            # its id still answers, paused; another tenant's look finds nothing, as for no id
            shown = acme.http.request("GET", f"/v1/sandboxes/{paused_id}").json()
            assert (shown["id"], shown["state"], shown["tier"]) == (paused_id, "paused", "process")
            assert shown["limits"]["memory_mb"] == LIMITS.memory_mb
            with pytest.raises(exc.ResourceNotFound):
                other.http.request("GET", f"/v1/sandboxes/{paused_id}")
        finally:
            for fork in forks:
                fork.close()

        with Client(server.url, tokens.acme) as second:  # another client object, as another program
            back = RemoteSandbox.resume(paused_id, client=second)
            try:
                assert back.id == paused_id
                assert acme.http.request("GET", f"/v1/sandboxes/{paused_id}").json()["state"] == "running"
                assert back.files.read("mine.txt") == "0"
                assert back.files.read("data/input.txt") == "prepared"
                assert back.commands.run(["python3", "-c", "print(6 * 7)"]).stdout == "42\n"
            finally:
                back.close()
        with pytest.raises(exc.SnapshotNotFound):  # resumed once: no longer paused
            RemoteSandbox.resume(paused_id, client=acme)
        assert [s["id"] for s in acme.snapshots()] == [snap.id]
        assert other.snapshots() == []
        acme.delete_snapshot(snap)
        assert acme.snapshots() == [] and acme.sandboxes() == []
        assert acme.verify_audit()["ok"] is True


@pytest.fixture
def small_quota(tmp_path: Path) -> Iterator[tuple[Server, Tokens, Path]]:
    """A service whose tenant acme keeps 40 MiB of snapshots at most."""
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path, sandboxes=2, acme_quotas={"snapshot_mb": 40})
    snapshots = tmp_path / "snapshots"
    server = Server(
        tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path, extra=["--snapshot-dir", str(snapshots)]
    )
    try:
        yield server, tokens, snapshots
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


def on_disk(store: Path) -> float:
    """The MiB a tenant's store holds (what counts against its snapshot_mb)."""
    return SnapshotStore(store).size() / MiB


def test_deleted_and_resumed_snapshots_give_their_room_back(small_quota: tuple[Server, Tokens, Path]) -> None:
    server, tokens, snapshots = small_quota
    with Client(server.url, tokens.acme) as acme:
        with RemoteSandbox.create("process", limits=LIMITS, client=acme) as sbx:
            # 4 x 15 MiB taken and deleted in a 40 MiB quota: each delete gives its room back
            # (they stayed on disk, and the third was refused with nothing listed)
            for _ in range(4):
                sbx.commands.run("head -c 15M /dev/urandom > /workspace/blob")
                acme.delete_snapshot(sbx.snapshot())
                assert acme.snapshots() == [] and on_disk(snapshots / "acme") == 0
            # what the quota counts is what is listed: two kept, the third refused
            kept = [sbx.snapshot()]
            sbx.commands.run("rm /workspace/blob; head -c 15M /dev/urandom > /workspace/other")
            kept.append(sbx.snapshot())
            sbx.commands.run("rm /workspace/other; head -c 15M /dev/urandom > /workspace/third")
            with pytest.raises(exc.QuotaExceeded) as refused:
                sbx.snapshot()
            listed = sum(s["size_bytes"] for s in acme.snapshots()) / MiB
            assert [s["id"] for s in acme.snapshots()] == [k.id for k in reversed(kept)]
            assert refused.value.used == pytest.approx(on_disk(snapshots / "acme"), abs=0.01)
            assert listed == pytest.approx(refused.value.used, abs=0.1)
            for snap in kept:
                acme.delete_snapshot(snap)
            assert on_disk(snapshots / "acme") == 0
            paused = sbx.id
            sbx.pause()
        assert on_disk(snapshots / "acme") > 14  # the paused sandbox's files
        with RemoteSandbox.resume(paused, client=acme) as back:
            assert back.files.exists("third")
            # consumed by the resume: its bytes are gone with it
            assert acme.snapshots() == [] and on_disk(snapshots / "acme") == 0


def test_the_service_collects_its_tenants_stores_at_start(tmp_path: Path) -> None:
    require_tier("process")
    tenants, _ = write_tenants(tmp_path)
    snapshots = tmp_path / "snapshots"
    # a predecessor's deleted snapshot: an object nothing keeps, written an hour ago
    store = SnapshotStore(snapshots / "acme")
    digest = store.add_bytes(os.urandom(MiB))
    an_hour_ago = time.time() - 3600
    os.utime(store.object_path(digest), (an_hour_ago, an_hour_ago))
    server = Server(
        tenants, f"sqlite:///{tmp_path / 'svc.db'}", tmp_path, extra=["--snapshot-dir", str(snapshots)]
    )
    try:
        assert not store.object_path(digest).exists() and on_disk(snapshots / "acme") == 0
    finally:
        server.stop()


def test_gc_collects_a_service_snapshot_folder(tmp_path: Path) -> None:
    left, held = {}, {}
    for tenant in ("acme", "other"):
        store = SnapshotStore(tmp_path / tenant)
        left[tenant] = store.object_path(store.add_bytes(os.urandom(1024)))
        kept = store.add_bytes(os.urandom(1024))
        store.save(
            kind=SnapshotKind.FILES, tier="process", source="sbx-1", spec={}, blobs={"workspace": kept},
            ref=("kept", ""),
        )  # fmt: skip
        held[tenant] = store.object_path(kept)
        for path in (left[tenant], held[tenant]):
            os.utime(path, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "store-id").write_text("0" * 32)
    (tmp_path / "other" / MARKER).unlink()  # a store an older version made, before the mark
    gc = _gc(tmp_path)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert "removed snapshot object" in gc.stdout
    assert not any(path.exists() for path in left.values())
    assert all(path.exists() for path in held.values())  # a kept snapshot's object stays


def _gc(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stockade.cli.main", "gc", "--snapshot-dir", str(folder)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_gc_given_a_folder_of_projects_removes_none_of_their_files(tmp_path: Path) -> None:
    """A folder that holds a tmp/ or an objects/ is no store: gc given their parent (or a
    home) removed projA/tmp/notes.txt, projA/tmp/build/out.o, projA/objects/abc123, and
    followed a link to another folder's tmp/."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    project = home / "projA"
    for root in (project, elsewhere):
        (root / "tmp" / "build").mkdir(parents=True)
        (root / "objects").mkdir()
        for path in (
            root / "tmp" / "notes.txt",
            root / "tmp" / "build" / "out.o",
            root / "objects" / "abc123",
        ):
            path.write_text("data")
            os.utime(path, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    (home / "tenantX").symlink_to(elsewhere)
    before = sorted(tmp_path.rglob("*"))
    for folder in (home, project):
        gc = _gc(folder)
        assert gc.returncode == 0, gc.stdout + gc.stderr
        assert f"no snapshot store in {folder}" in gc.stdout
        assert "unfinished snapshot write" not in gc.stdout
    assert sorted(tmp_path.rglob("*")) == before
