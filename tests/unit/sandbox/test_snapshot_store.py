"""The snapshot store on its own: content addresses, checks, refs, room and collection."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from stockade import (
    AsyncSandbox,
    InvalidArgument,
    Sandbox,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotIncompatible,
    SnapshotKind,
    SnapshotNotFound,
    SnapshotStore,
)
from stockade.egress.secrets import EnvSecret
from stockade.sandbox._startup import rules_changed
from stockade.sandbox._supervised import (
    enforcement_from_state,
    enforcement_state,
    spec_from_state,
    spec_state,
)
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.ops import PutArchive
from stockade.testing import FakeBackend, FakeInstance
from stockade.types import (
    Credential,
    Enforcement,
    HostRule,
    HostShare,
    Limits,
    Mechanism,
    NetworkPolicy,
    ReadOnly,
    SandboxRules,
)
from tests.conftest import require


def _snapshot(store: SnapshotStore, data: bytes, *, ref: tuple[str, str] = ("kept", "")) -> str:
    digest = store.add_bytes(data)
    blobs = {"workspace": digest}
    snap = store.save(
        kind=SnapshotKind.FILES, tier="process", source="sbx-0123456789ab", spec={}, blobs=blobs, ref=ref
    )
    return snap.id


def test_objects_are_named_by_their_hash_and_kept_once(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    first = _snapshot(store, b"same bytes")
    second = _snapshot(store, b"same bytes", ref=("paused", "sbx-0123456789ab"))
    assert len(os.listdir(tmp_path / "objects")) == 1
    assert store.verify(first).blobs == store.verify(second).blobs
    assert {s.id for s in store.snapshots()} == {first, second}


def test_a_store_named_by_a_string_is_the_same_store(tmp_path: Path) -> None:
    snap = _snapshot(SnapshotStore(str(tmp_path)), b"bytes")  # type: ignore[arg-type]  # as callers have it
    assert SnapshotStore(tmp_path).verify(snap).blobs
    assert SnapshotStore(str(tmp_path)) == SnapshotStore(tmp_path)  # type: ignore[arg-type]


_WRONG_SETTINGS: list[tuple[dict[str, object], str]] = [
    ({"root": None}, "root"),
    ({"root": 5}, "root"),
    ({"root": b"/var/tmp"}, "root"),
    ({"max_bytes": "10"}, "max_bytes"),
    ({"max_bytes": -1}, "max_bytes"),
    ({"max_bytes": None}, "max_bytes"),
    ({"name": 3}, "name"),
]


@pytest.mark.parametrize(("given", "argument"), _WRONG_SETTINGS)
def test_a_store_given_wrong_settings_is_refused_where_they_are_given(
    tmp_path: Path, given: dict[str, object], argument: str
) -> None:
    settings: dict[str, object] = {"root": tmp_path, **given}
    with pytest.raises(InvalidArgument) as caught:
        SnapshotStore(**settings)  # type: ignore[arg-type]
    assert caught.value.argument == argument


def _save(store: SnapshotStore, **given: object) -> object:
    return store.save(kind=SnapshotKind.FILES, tier="process", source="", spec={}, **given)  # type: ignore[arg-type]


_WRONG_CALLS: list[tuple[str, Callable[[SnapshotStore], object], str]] = [
    ("text for bytes", lambda s: s.add_bytes("abc"), "data"),  # type: ignore[arg-type]
    ("no file", lambda s: s.add_file(None), "path"),  # type: ignore[arg-type]
    ("a number for a digest", lambda s: s.check_object(5), "digest"),  # type: ignore[arg-type]
    ("a negative chunk", lambda s: s.stream_object("0" * 64, -1), "chunk"),
    ("a chunk of text", lambda s: s.stream_object("0" * 64, "4"), "chunk"),  # type: ignore[arg-type]
    ("no snapshot to load", lambda s: s.load(None), "snapshot"),  # type: ignore[arg-type]
    ("no snapshot to delete", lambda s: s.delete(None), "snapshot"),  # type: ignore[arg-type]
    ("a number for a ref's name", lambda s: s.set_ref("kept", 5, "snap-x"), "name"),  # type: ignore[arg-type]
    ("a number for a ref's snapshot", lambda s: s.set_ref("kept", "a", 5), "snapshot"),  # type: ignore[arg-type]
    ("no ref kind", lambda s: s.refs(None), "kind"),  # type: ignore[arg-type]
    ("one kind as a str", lambda s: s.held("paused"), "kinds"),  # type: ignore[arg-type]
    ("room as text", lambda s: s.fits("5"), "more"),  # type: ignore[arg-type]
    ("a grace of text", lambda s: s.collect(grace_s="x"), "grace_s"),  # type: ignore[arg-type]
    ("a negative grace", lambda s: s.collect(grace_s=-1), "grace_s"),
    ("a hint leaving tmp", lambda s: s.temp_path("../x"), "hint"),
    ("no blobs", lambda s: _save(s, blobs=None), "blobs"),
    ("a ref as a str", lambda s: _save(s, blobs={}, ref="kept"), "ref"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "call", "argument"), _WRONG_CALLS, ids=[c[0] for c in _WRONG_CALLS])
def test_a_store_method_given_a_wrong_argument_refuses_it_by_name(
    tmp_path: Path, case: str, call: Callable[[SnapshotStore], object], argument: str
) -> None:
    store = SnapshotStore(tmp_path)
    with pytest.raises(InvalidArgument) as caught:
        call(store)
    assert caught.value.argument == argument, case


def test_a_reservation_refuses_a_negative_size(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path).reserve() as room, pytest.raises(InvalidArgument, match="size"):
        room.expect(-(1 << 30))  # would have held less than nothing, and let others write past the cap


def test_a_modified_manifest_or_object_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    sid = _snapshot(store, b"payload")
    (obj,) = (tmp_path / "objects").iterdir()
    os.chmod(obj, 0o600)
    obj.write_bytes(b"PAYLOAD")
    with pytest.raises(SnapshotCorrupt):
        store.verify(sid)
    (manifest,) = (tmp_path / "snapshots").iterdir()
    os.chmod(manifest, 0o600)
    manifest.write_text(manifest.read_text().replace("process", "docker"))
    with pytest.raises(SnapshotCorrupt):
        store.load(sid)
    with pytest.raises(SnapshotNotFound):
        store.load("snap-" + "0" * 32)
    with pytest.raises(SnapshotNotFound):
        store.load("../../etc/passwd")


def test_a_manifest_that_hashes_to_its_name_but_is_no_object_is_refused_as_corrupt(tmp_path: Path) -> None:
    # Its hash right, a JSON list failed with AttributeError where SnapshotCorrupt is promised.
    store = SnapshotStore(tmp_path)
    _snapshot(store, b"payload")
    text = b"[1, 2]"
    digest = hashlib.sha256(text).hexdigest()
    (tmp_path / "snapshots" / f"{digest}.json").write_bytes(text)
    with pytest.raises(SnapshotCorrupt, match="modified"):
        store.load("snap-" + digest[:32])


def test_an_object_damaged_on_disk_is_made_whole_by_the_next_snapshot_of_its_bytes(tmp_path: Path) -> None:
    # The next snapshot of the same bytes kept the damaged object and stamped it as verified:
    # that snapshot, and every later one of the same bytes, was refused at its restore.
    store = SnapshotStore(tmp_path)
    first = _snapshot(store, b"payload")
    (obj,) = (tmp_path / "objects").iterdir()
    os.chmod(obj, 0o600)
    obj.write_bytes(b"PAYLOAD")  # a bit flipped on disk
    second = _snapshot(store, b"payload", ref=("kept", "again"))
    assert store.verify(second).blobs == store.verify(first).blobs


@pytest.mark.parametrize("swap", ["fifo", "link-to-dev-zero", "folder"])
def test_an_object_that_is_no_regular_file_is_refused_at_once(tmp_path: Path, swap: str) -> None:
    # A FIFO in an object's place hung a restore for good; a link to /dev/zero streamed zeros.
    store = SnapshotStore(tmp_path)
    sid = _snapshot(store, b"payload")
    (obj,) = (tmp_path / "objects").iterdir()
    obj.unlink()
    if swap == "fifo":
        os.mkfifo(obj)
    elif swap == "folder":
        obj.mkdir()
    else:
        obj.symlink_to("/dev/zero")
    (tmp_path / "verified" / obj.name).unlink(missing_ok=True)
    with pytest.raises(SnapshotCorrupt, match="not"):
        store.verify(sid)
    with pytest.raises(SnapshotCorrupt, match="not"):
        store.stream_object(obj.name, 1 << 20)


def test_one_claim_wins_and_a_failed_one_gives_the_ref_back(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    _snapshot(store, b"x", ref=("paused", "sbx-0123456789ab"))
    with pytest.raises(RuntimeError), store.claim("paused", "sbx-0123456789ab"):
        raise RuntimeError("the restore failed")
    with store.claim("paused", "sbx-0123456789ab") as ref:
        assert ref["snapshot"].startswith("snap-")
        with pytest.raises(SnapshotNotFound), store.claim("paused", "sbx-0123456789ab"):
            pass
    assert store.ref("paused", "sbx-0123456789ab") is None


def test_a_claim_whose_process_died_is_put_back(tmp_path: Path) -> None:
    """A resume killed mid-way left its claim: the paused sandbox answered "nothing paused" to
    every resume and to gc for a day (found from outside). The claim names its pid."""
    store = SnapshotStore(tmp_path)
    _snapshot(store, b"x", ref=("paused", "sbx-0123456789ab"))
    said = [sys.executable, "-c", "import os; print(os.getpid())"]
    pid = int(subprocess.run(said, check=True, capture_output=True, text=True).stdout)  # gone now
    ref = tmp_path / "refs" / "paused" / "sbx-0123456789ab"
    ref.rename(ref.with_name(f".sbx-0123456789ab.claimed-{pid}-0123abcd"))
    with store.claim("paused", "sbx-0123456789ab") as taken:  # taken back, and taken
        assert taken["snapshot"].startswith("snap-")
    _snapshot(store, b"y", ref=("paused", "sbx-0123456789ac"))
    ref = ref.with_name("sbx-0123456789ac")
    ref.rename(ref.with_name(f".sbx-0123456789ac.claimed-{pid}-0123abcd"))
    assert any("put back" in r for r in store.collect())
    assert store.ref("paused", "sbx-0123456789ac") is not None


def test_a_full_store_evicts_boot_images_then_refuses(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, max_bytes=64 * 1024)
    boot = _snapshot(store, os.urandom(40 * 1024), ref=("boot", "microvm-shape"))
    for obj in (tmp_path / "objects").iterdir():
        os.utime(obj, (0, 0))  # long written: no longer in the grace period
    kept = _snapshot(store, os.urandom(40 * 1024))
    assert store.ref("boot", "microvm-shape") is None
    with pytest.raises(SnapshotNotFound):
        store.load(boot)
    with pytest.raises(SnapshotError, match="full"):
        _snapshot(store, os.urandom(40 * 1024))
    assert [s.id for s in store.snapshots()] == [kept]


def test_room_reserved_by_one_writer_is_not_given_to_another(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, max_bytes=10 << 20)
    with store.reserve() as first:
        first.grow(6 << 20)
        with store.reserve() as second:
            assert second.room() == 4 << 20
            with pytest.raises(SnapshotError, match="is full"):
                second.grow(6 << 20)
    with store.reserve() as second:
        second.grow(6 << 20)  # the first one's room came back when it ended


def test_what_a_killed_writer_left_is_removed_by_the_next_reservation_and_by_gc(tmp_path: Path) -> None:
    """A writer killed mid-snapshot lost its reservation at once, but its bytes under tmp/
    stayed, counted by no cap, and gc kept them an hour: two kills left 333 MB past a 200 MB
    cap (found from outside). Its name says its pid: once that is gone, so are its bytes."""
    store = SnapshotStore(tmp_path, max_bytes=10 << 20)
    said = [sys.executable, "-c", "import os; print(os.getpid())"]
    pid = int(subprocess.run(said, check=True, capture_output=True, text=True).stdout)  # gone now
    left = store.temp_path("workspace")
    left.write_bytes(os.urandom(1 << 20))
    orphan = left.with_name(f"workspace-{pid}-{'ab' * 6}")
    left.rename(orphan)
    mine = store.temp_path("workspace")  # a live writer's (ours): kept
    mine.write_bytes(b"x")
    with store.reserve() as writer:
        writer.grow(1 << 20)
    assert not orphan.exists() and mine.exists()
    again = mine.with_name(f"manifest-{pid}-{'cd' * 6}")
    again.write_bytes(b"y")
    assert any("unfinished snapshot write" in r for r in store.collect())
    assert not again.exists() and mine.exists()


def test_a_writer_short_of_room_waits_for_one_begun_after_it_to_give_way(tmp_path: Path) -> None:
    # Three snapshots taken at once each grew to a third of the room, then all three were
    # refused: the store kept none. The younger gives way now; the older waits for its room.
    store = SnapshotStore(tmp_path, max_bytes=10 << 20)
    with store.reserve() as older, ThreadPoolExecutor(1) as pool:
        older.grow(3 << 20)
        with store.reserve() as younger:
            younger.grow(6 << 20)
            with pytest.raises(SnapshotError, match="is full"):
                younger.grow(8 << 20)  # nothing begun after it: refused at once
            waiting = pool.submit(older.grow, 8 << 20)
            assert not _done_within(waiting, 0.3)
        waiting.result(timeout=10)  # the younger ended: its room went to the older
        assert older.held == 8 << 20


def test_of_writers_taken_at_once_that_do_not_fit_together_one_is_kept(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, max_bytes=48 << 20)
    start = threading.Barrier(3)

    def write_20_mib(mark: bytes) -> None:
        with store.reserve() as room:
            with room.open("area") as (path, write):
                start.wait()
                for _ in range(20):
                    write(mark * (1 << 20))
            store.add_file(path)  # in the objects, as a snapshot's are before its room goes

    with ThreadPoolExecutor(3) as pool:
        writers = [pool.submit(write_20_mib, mark) for mark in (b"a", b"b", b"c")]
        refused = [w.exception(timeout=60) for w in writers]
    assert 1 <= sum(e is not None for e in refused) <= 2
    assert all(isinstance(e, SnapshotError) for e in refused if e is not None)
    assert store.size() <= store.max_bytes


def _done_within(future: Future[None], seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        future.result(timeout=seconds)
        return True
    return False


def test_a_writer_stops_at_the_chunk_that_would_not_fit_and_leaves_nothing(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, max_bytes=3 << 20)
    with (
        store.reserve() as room,
        pytest.raises(SnapshotError, match="is full"),
        room.open("area") as (path, write),
    ):
        for _ in range(4):
            write(os.urandom(1 << 20))
    assert room.used == 3 << 20 and not path.exists()


def test_the_room_of_a_writer_that_died_is_free_again(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, max_bytes=10 << 20)
    code = (
        "import os, sys; from stockade import SnapshotStore\n"
        f"with SnapshotStore({str(tmp_path)!r}, max_bytes=10 << 20).reserve() as room:\n"
        "    room.grow(8 << 20); print('held', flush=True); sys.stdin.read(); os._exit(9)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-c", code]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) as child:
        assert child.stdout is not None and child.stdout.readline() == b"held\n"
        with store.reserve() as mine:
            assert mine.room() == 2 << 20  # another process's room counts
        child.kill()
    with store.reserve() as mine:
        mine.grow(8 << 20)  # killed mid-snapshot: its reservation is free, and removed
    assert list((tmp_path / "reserved").iterdir()) == []


def test_collection_keeps_what_refs_keep(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    kept = _snapshot(store, b"kept")
    gone = _snapshot(store, b"gone")
    store.delete(gone)
    removed = store.collect(grace_s=0)
    assert removed and all("gone" not in r for r in removed)
    assert len(os.listdir(tmp_path / "objects")) == 1
    store.verify(kept)


def _age(root: Path, seconds: float) -> None:
    """Everything in the store written ``seconds`` ago."""
    then = time.time() - seconds
    for path in root.rglob("*"):
        os.utime(path, (then, then))


def test_a_collection_during_a_resume_keeps_the_paused_snapshot(tmp_path: Path) -> None:
    """`resume` claims the ref (renames it aside) while it reads the snapshot and starts the
    sandbox; `stockade gc` then saw nothing keeping it and deleted the paused sandbox for good
    (2 of 6 resumes lost with gc in a loop)."""
    store = SnapshotStore(tmp_path)
    paused = _snapshot(store, b"precious", ref=("paused", "sbx-0123456789ab"))
    _age(tmp_path, 3600)
    with store.claim("paused", "sbx-0123456789ab") as ref:
        assert ref["snapshot"] == paused
        store.collect()
        store.verify(paused)  # still whole, the resume goes on
    assert store.ref("paused", "sbx-0123456789ab") is None  # the resume took it


def test_a_claim_left_by_a_resume_that_died_is_put_back_after_a_day(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    paused = _snapshot(store, b"precious", ref=("paused", "sbx-0123456789ab"))
    claimed = tmp_path / "refs" / "paused" / ".sbx-0123456789ab.claimed-99999-0000"
    os.rename(tmp_path / "refs" / "paused" / "sbx-0123456789ab", claimed)  # and the process died
    _age(tmp_path, 2 * 24 * 3600)
    removed = store.collect()
    assert "snapshot ref paused/sbx-0123456789ab put back (its resume died)" in removed
    assert store.ref("paused", "sbx-0123456789ab") == {"snapshot": paused}
    store.verify(paused)


def test_a_discarded_snapshot_takes_the_objects_only_it_used_at_once(tmp_path: Path) -> None:
    """``delete`` left the objects to a collection past their grace; a service never ran one
    on its tenants' stores, where deleted snapshots counted against the quota for good."""
    store = SnapshotStore(tmp_path)
    first = _snapshot(store, b"shared")
    second = store.save(
        kind=SnapshotKind.FILES, tier="process", source="sbx-ba9876543210", spec={},
        blobs={"workspace": store.add_bytes(b"shared")}, ref=("kept", ""),
    ).id  # fmt: skip
    alone = _snapshot(store, b"alone")
    alone_object = store.object_path(store.load(alone).blobs["workspace"])
    assert "snapshot object" in " ".join(store.discard(alone))
    assert not alone_object.exists()
    store.discard(second)
    store.verify(first)  # the object it shares stays
    store.discard(first)
    assert store.size() == 0 and store.snapshots() == []


def test_a_discard_leaves_what_a_snapshot_in_the_making_may_name(tmp_path: Path) -> None:
    """A snapshot being written adds its objects before its manifest names them: one with the
    same bytes as the snapshot discarded must not go in between."""
    store = SnapshotStore(tmp_path)
    same = _snapshot(store, b"the same files")
    older = _snapshot(store, b"written before")
    older_object = store.object_path(store.load(older).blobs["workspace"])
    _age(tmp_path, 3600)
    with store.reserve():  # a snapshot in the making, in this process or another
        digest = store.add_bytes(b"the same files")
        store.discard(same)
        store.discard(older)
        assert not older_object.exists()  # written before the writer began: gone at once
        taken = store.save(
            kind=SnapshotKind.FILES, tier="process", source="sbx-0123456789ab", spec={},
            blobs={"workspace": digest}, ref=("kept", ""),
        )  # fmt: skip
    store.verify(taken)


def test_a_discard_during_a_resume_leaves_the_objects_it_reads(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    paused = _snapshot(store, b"being resumed", ref=("paused", "sbx-0123456789ab"))
    memory = store.object_path(store.load(paused).blobs["workspace"])
    with store.claim("paused", "sbx-0123456789ab"):
        store.discard(paused)  # deleted meanwhile, by its tenant
        assert memory.exists()  # the resume reads on


class DeletedWhileRestoring(FakeBackend):
    """A restore that has read its snapshot's manifest when another request deletes the
    snapshot (``DELETE /v1/snapshots/S``), and reads its objects after."""

    def start(self, spec: SandboxSpec) -> FakeInstance:
        assert spec.snapshot is not None
        store = SnapshotStore(Path(spec.snapshot.store))
        blobs = store.load(spec.snapshot).blobs
        store.discard(spec.snapshot)
        instance = super().start(dataclasses.replace(spec, snapshot=None))
        instance.handler(PutArchive(data=store.check_object(blobs["workspace"]).read_bytes()))
        return instance


def test_a_snapshot_deleted_while_it_is_restored_comes_back_whole_and_then_goes(tmp_path: Path) -> None:
    """Its objects were removed under the restore, which failed ``SnapshotCorrupt`` ("object
    ... is missing": found from outside, a DELETE 0.3 s into a create). A restore reading
    them keeps them; the snapshot is gone at once, its bytes once the restore ends."""
    store = SnapshotStore(tmp_path / "snaps")
    with Sandbox.create(backend=FakeBackend()) as sbx:
        sbx.files.write("data.txt", "kept")
        taken = sbx.snapshot(store=store)
    with Sandbox.create(backend=DeletedWhileRestoring(), snapshot=taken, store=store) as back:
        assert back.files.read("data.txt") == "kept"
    with pytest.raises(SnapshotNotFound):
        store.load(taken)
    assert store.size() == 0 and not list((tmp_path / "snaps" / "reading").iterdir())


def test_a_pool_filling_from_a_snapshot_deleted_meanwhile_keeps_what_its_member_reads(tmp_path: Path) -> None:
    """A pool's members start from its snapshot as a create does: the member whose start the
    deletion caught comes up whole; no member starts from the deleted snapshot after it."""
    from stockade import SandboxPool

    store = SnapshotStore(tmp_path / "snaps")
    with Sandbox.create(backend=FakeBackend()) as sbx:
        sbx.files.write("data.txt", "kept")
        taken = sbx.snapshot(store=store)
    pool = SandboxPool(backend=DeletedWhileRestoring(), size=1, snapshot=taken, store=store)
    with pool, pool.acquire(timeout_s=10) as member:
        assert member.files.read("data.txt") == "kept"
    assert store.size() == 0 and not list((tmp_path / "snaps" / "reading").iterdir())


async def test_an_async_restore_keeps_them_too(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps")
    async with await AsyncSandbox.create(backend=FakeBackend()) as sbx:
        await sbx.files.write("data.txt", "kept")
        taken = await sbx.snapshot(store=store)
    async with await AsyncSandbox.create(
        backend=DeletedWhileRestoring(), snapshot=taken, store=store
    ) as back:
        assert await back.files.read("data.txt") == "kept"
    assert store.size() == 0 and not list((tmp_path / "snaps" / "reading").iterdir())


def test_a_store_mounted_read_only_is_still_restored_from(tmp_path: Path) -> None:
    """A snapshot store many hosts share, mounted read-only: restores from it worked until
    each left a mark in it (what it reads, kept from a delete), then failed with the
    mount's "Read-only file system". Nothing through a read-only mount deletes, so nothing
    needs keeping: the restore reads on, and leaves nothing."""
    unshare = shutil.which("unshare")
    require("unshare", os.geteuid() == 0 and unshare is not None, "a read-only mount needs root and unshare")
    assert unshare is not None
    store = SnapshotStore(tmp_path / "snaps")
    with Sandbox.create(backend=FakeBackend()) as sbx:
        sbx.files.write("data.txt", "kept")
        taken = sbx.snapshot(store=store)
    before = sorted(store.root.rglob("*"))
    restore = (
        "import sys\n"
        "from stockade import Sandbox, SnapshotStore\n"
        "from stockade.testing import FakeBackend\n"
        "store = SnapshotStore(sys.argv[1])\n"
        "with Sandbox.create(backend=FakeBackend(), snapshot=sys.argv[2], store=store) as sbx:\n"
        "    print(sbx.files.read('data.txt'))\n"
    )
    mount_ro = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    argv = [unshare, "--mount", "--propagation", "private", "sh", "-c", mount_ro, "sh", str(store.root)]
    done = subprocess.run(
        [*argv, sys.executable, "-c", restore, str(store.root), taken.id],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "kept\n", done.stderr[-2000:]
    assert sorted(store.root.rglob("*")) == before


def test_a_restore_keeps_the_objects_it_reads_from_discard_and_collection(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    sid = _snapshot(store, b"being restored")
    shared = _snapshot(store, b"shared by two")
    digest = store.load(sid).blobs["workspace"]
    _age(tmp_path, 3600)
    with store.reading(sid) as manifest, store.reading(sid):  # two restores of one snapshot
        assert manifest.blobs == {"workspace": digest}
        store.discard(sid)
        store.collect(grace_s=0)  # `stockade gc` meanwhile
        store.check_object(digest)  # both read on
        with pytest.raises(SnapshotNotFound):  # a later one finds none
            store.load(sid)
    assert not store.object_path(digest).exists()  # gone with the last
    with store.reading(shared):  # a snapshot not deleted keeps everything
        pass
    store.verify(shared)
    with pytest.raises(SnapshotNotFound), store.reading(sid):
        pass

    # the mark of a restore whose process died keeps nothing
    other = _snapshot(store, b"its reader died")
    dead = store.load(other).blobs["workspace"]
    (tmp_path / "reading" / f"{other}-{2**22 + 7}-0123456789ab").write_text(json.dumps([dead]))
    store.discard(other)
    assert not store.object_path(dead).exists()
    assert not list((tmp_path / "reading").iterdir())


def test_a_collection_spares_a_stamp_being_written(tmp_path: Path) -> None:
    """It removed every stamp no snapshot named yet, the one an object being added was writing
    included, and the add failed with a bare FileNotFoundError (2 snapshots of 40)."""
    store = SnapshotStore(tmp_path)
    digest = store.add_bytes(b"in the making")
    writing = tmp_path / "verified" / f".{digest}-0000"
    writing.write_text("identity")
    store.collect(grace_s=60)
    assert writing.exists()
    writing.unlink()
    store._stamp(digest, tmp_path / "objects" / digest)  # a stamp that cannot be kept is no error


def test_a_spec_survives_its_manifest() -> None:
    spec = SandboxSpec(
        limits=Limits(memory_mb=300, pids=20),
        envs={"A": "1"},
        rules=SandboxRules(deny=("curl",)),
        labels={"k": "v"},
    )
    back = spec_from_state(spec_state(spec))
    assert (back.limits, back.envs, back.rules, back.labels) == (
        spec.limits,
        spec.envs,
        spec.rules,
        spec.labels,
    )


def kept_before_files_counted(**limits: object) -> dict[str, object]:
    """A spec as a stockade from before 2026-12-06 kept it: Limits whole, inodes=65536 in them."""
    state = {k: v for k, v in spec_state(SandboxSpec()).items() if k != "files_counted"}
    return {**state, "limits": {**dataclasses.asdict(Limits()), "inodes": 65536, **limits}}


def test_a_snapshot_kept_before_files_counted_restores_with_the_places_it_had() -> None:
    # Then the workspace was half of memory_mb with 65,536 files, /tmp and /dev/shm an eighth
    # (at most 64 MiB): the files kept fit those, not today's smaller places. memory_mb grows
    # to the least that holds them by today's rule.
    for memory_mb, places, least in ((64, (32, 8), 384), (512, (256, 64), 832), (2048, (1024, 64), 2048)):
        limits = spec_from_state(kept_before_files_counted(memory_mb=memory_mb)).limits
        assert (limits.workspace_mb, limits.tmp_size_mb, limits.workspace_inodes) == (*places, 65_536)
        assert limits.memory_mb == least
    given = spec_from_state(kept_before_files_counted(memory_mb=64, disk_mb=20, tmp_mb=2)).limits
    assert (given.workspace_mb, given.tmp_size_mb, given.memory_mb) == (20, 2, 352)
    with pytest.raises(SnapshotIncompatible, match="inodes"):  # a count given on purpose is not changed
        spec_from_state(kept_before_files_counted(inodes=200_000))


def test_a_snapshot_kept_today_restores_with_its_limits_as_they_were() -> None:
    for limits in (Limits(memory_mb=64), Limits(memory_mb=1024, inodes=65_536)):
        assert spec_from_state(spec_state(SandboxSpec(limits=limits))).limits == limits


def test_an_enforcement_survives_its_manifest_and_an_unknown_one_is_refused() -> None:
    vm = Mechanism.VM
    enforcement = Enforcement(
        memory=vm, cpus=vm, pids=Mechanism.RLIMIT, disk=Mechanism.TMPFS, network=vm,
        timeout=Mechanism.SUPERVISOR, host=HostShare(memory_mb=400, tasks=64, open_files=256),
        weakened=("cpus: shared",), timeout_margin_s=2.5,
    )  # fmt: skip
    state = enforcement_state(enforcement)
    assert enforcement_from_state(state) == enforcement
    older = {k: v for k, v in state.items() if k != "timeout_margin_s"}  # kept before it was stated
    assert enforcement_from_state(older).timeout_margin_s == 1.0
    with pytest.raises(SnapshotIncompatible):
        enforcement_from_state({**state, "memory": "telepathy"})
    with pytest.raises(SnapshotIncompatible):
        enforcement_from_state({**state, "a_setting_from_the_future": "vm"})


def test_a_network_policy_survives_its_manifest_but_its_credentials_are_never_written() -> None:
    network = NetworkPolicy(
        allow_hosts=("pypi.org",),
        rules=(HostRule(host="api.example.com", ports=(443, 8443), methods=("GET",)),),
        allow_addresses=("10.1.0.0/16",),
        resolve={"api.example.com": ("10.1.0.5",)},
        max_requests_per_minute=30,
        credentials=(
            Credential(name="gh", hosts=("api.example.com",), source=EnvSecret("S3CRET_OF_A_TEST")),
        ),
    )
    state = spec_state(SandboxSpec(network=network))
    assert "S3CRET" not in json.dumps(state) and "credentials" not in state["network"]
    back = spec_from_state(state).network
    assert back == dataclasses.replace(network, credentials=())


def test_a_memory_snapshot_refuses_other_rules_and_reports_its_own(tmp_path: Path) -> None:
    """A memory snapshot's supervisor, masks and kernel confinement are those it was taken
    with: restored under stricter rules, a microVM ran ``whoami`` they deny and wrote outside
    their ``write``, while ``Sandbox.rules`` reported them. Other rules are refused, naming
    each difference; none given (or the same) start it under its own, and it says so."""
    store = SnapshotStore(tmp_path / "snaps")
    backend = FakeBackend(tier="microvm")
    taken = SandboxRules(deny=("curl",))
    with Sandbox.create(backend=backend, rules=taken) as sbx:
        files = sbx.snapshot(store=store)
    kept = store.load(files)
    memory = store.save(
        kind=SnapshotKind.MEMORY, tier="microvm", source=files.source, spec=kept.spec, blobs=kept.blobs
    )
    strict = SandboxRules(deny=("whoami", "curl"), write=("out/**",))
    changed = r"rules cannot change \(deny \('whoami', 'curl'\), not \('curl',\); write \('out/\*\*',\), not"
    with pytest.raises(SnapshotIncompatible, match=changed):
        Sandbox.create(backend=backend, snapshot=memory, store=store, rules=strict)
    for rules in (None, SandboxRules(deny=("curl",))):
        with Sandbox.create(backend=backend, snapshot=memory, store=store, rules=rules) as back:
            assert back.rules == taken
    # its files alone come back under any rules
    with Sandbox.create(backend=backend, snapshot=files, store=store, rules=strict) as fresh:
        assert fresh.rules == strict


def test_a_memory_snapshot_comes_back_under_its_rules_in_another_order(tmp_path: Path) -> None:
    """Rules are sets: a command is judged by any pattern that matches, a path by any glob.
    A policy that only reordered (or repeated) its ``commands.deny`` or ``paths.deny`` made
    every paused memory sandbox incompatible; it comes back, under the rules it kept."""
    store = SnapshotStore(tmp_path / "snaps")
    backend = FakeBackend(tier="microvm")
    taken = SandboxRules(deny=("curl", "wget"), approve=("rm -r", "git push"), hide=("secrets/**", ".env"))
    with Sandbox.create(backend=backend, rules=taken) as sbx:
        files = sbx.snapshot(store=store)
    kept = store.load(files)
    memory = store.save(
        kind=SnapshotKind.MEMORY, tier="microvm", source=files.source, spec=kept.spec, blobs=kept.blobs
    )
    reordered = SandboxRules(
        deny=("wget", "curl", "curl"), approve=("git push", "rm -r"), hide=(".env", "./secrets/**")
    )
    with Sandbox.create(backend=backend, snapshot=memory, store=store, rules=reordered) as back:
        assert back.rules == taken
    with pytest.raises(SnapshotIncompatible, match=r"deny \('wget',\), not \('curl', 'wget'\)"):
        Sandbox.create(backend=backend, snapshot=memory, store=store, rules=SandboxRules(deny=("wget",)))

    # a data class read but not written: its globs, and the classes, in any order
    a, b = ReadOnly(paths=("records/**", "notes/**"), setting="restricted"), ReadOnly(paths=("keys/**",))
    assert rules_changed(SandboxRules(read_only=(a, b)), SandboxRules(read_only=(b, a))) == []
    swapped = ReadOnly(paths=("notes/**", "records/**"), setting="restricted")
    assert rules_changed(SandboxRules(read_only=(a,)), SandboxRules(read_only=(swapped,))) == []
    other = ReadOnly(paths=("records/**", "notes/**"), setting="secret")
    assert rules_changed(SandboxRules(read_only=(a,)), SandboxRules(read_only=(other,))) != []
