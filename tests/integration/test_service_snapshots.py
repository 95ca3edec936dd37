"""Snapshots through ``stockade serve`` (real uvicorn, SQLite, the process tier) and the
Python client: a snapshot forks sandboxes that each see its files, a paused sandbox frees its
place and comes back under its id through another client, and another tenant finds none of
it (404, as for an id that never was)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import Limits
from stockade import exceptions as exc
from stockade.client import Client, RemoteSandbox
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
