"""Snapshots on every tier: pause, exit, resume in another process; fork from one snapshot;
a modified snapshot refused; collection of what nothing keeps.

Files (workspace, /tmp, the environment) survive on every tier; the memory tiers (the
microVM, gVisor in its default mode here: a Docker runtime, checkpointed by runsc) keep the
interpreter's variables and its threads too (gVisor's both modes: test_snapshots_memory.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import pytest

from stockade import (
    LimitNotEnforceable,
    Limits,
    Sandbox,
    SandboxPool,
    SandboxRules,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotIncompatible,
    SnapshotKind,
    SnapshotNotFound,
    SnapshotStore,
    SnapshotStoreFull,
)
from stockade.audit import AuditedBackend, EventKind, verify
from stockade.sandbox._snapshot_files import MARKER
from stockade.sandbox.process import ProcessBackend
from stockade.testing import capture_audit
from tests.conftest import require_tier
from tests.integration.conftest import TIERS

ROOT = Path(__file__).parents[2]
LIMITS = Limits(memory_mb=256, timeout_s=20, pids=64)
# The tiers whose snapshots keep the memory of the processes too.
MEMORY_TIERS = [t for t in ("gvisor", "microvm") if t in TIERS]
MEMORY_FORKS = 10


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "snapshots")


def _child(code: str, store: SnapshotStore) -> dict[str, object]:
    """Run ``code`` in a new Python process (it prints one JSON line) and return what it said."""
    program = "import json, sys\nfrom pathlib import Path\nfrom stockade import *\n"
    program += f"store = SnapshotStore(Path({str(store.root)!r}))\n" + textwrap.dedent(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("tier", TIERS)
def test_a_paused_sandbox_resumes_in_another_process_with_its_files(tier: str, store: SnapshotStore) -> None:
    require_tier(tier)
    paused = _child(
        f"""
        sbx = Sandbox.create({tier!r}, envs={{"GREETING": "hi"}}, limits=Limits(memory_mb=256, pids=64))
        sbx.files.write("notes/a.txt", "kept\\n")
        sbx.commands.run("echo scratch > /tmp/t && mkdir -p /tmp/.local/lib && echo pkg > /tmp/.local/lib/p")
        snap = sbx.pause(store=store)
        print(json.dumps({{"id": sbx.id, "alive": sbx.alive, "kind": snap.kind}}))
        """,
        store,
    )
    assert paused["alive"] is False
    with Sandbox.resume(str(paused["id"]), store=store) as sbx:
        assert sbx.id == paused["id"]
        out = sbx.commands.run("cat notes/a.txt /tmp/t /tmp/.local/lib/p; echo $GREETING").stdout
        assert out.split() == ["kept", "scratch", "pkg", "hi"]
    with pytest.raises(SnapshotNotFound):
        Sandbox.resume(str(paused["id"]), store=store)


def test_files_snapshots_fork_are_collected_and_are_checked(tier: str, store: SnapshotStore) -> None:
    """One sandbox per tier for the three: ten forks of a files snapshot are copies of their
    own, collection removes the snapshot nothing keeps (and only it), a changed byte is refused."""
    with Sandbox.create(tier, limits=LIMITS) as sbx:
        sbx.files.write("data.txt", "x" * 1000)
        if tier in ("process", "docker"):  # files only
            with pytest.raises(LimitNotEnforceable):
                sbx.snapshot(store=store, memory=True)
        snap = sbx.snapshot(store=store, memory=False)
        sbx.files.write("data.txt", "2")
        dropped = sbx.snapshot(store=store, memory=False)
        assert sbx.alive
    assert snap.kind is SnapshotKind.FILES and snap.tier == tier

    # Ten forks, two of them at once (a change in one is not in the other); the others one at
    # a time: ten microVMs at once would be 2.5 GiB of guest RAM on a shared host.
    ids = []
    with (
        Sandbox.create(snapshot=snap.id, store=store) as first,
        Sandbox.create(snapshot=snap, store=store) as second,
    ):
        first.files.write("data.txt", "changed")
        assert second.files.read("data.txt") == "x" * 1000
        ids += [first.id, second.id]
    for _ in range(8):
        with Sandbox.create(snapshot=snap, store=store) as fork:
            assert fork.tier == tier and fork.files.read("data.txt") == "x" * 1000
            ids.append(fork.id)
    assert len(set(ids)) == 10

    objects = set(os.listdir(store.root / "objects"))
    store.delete(dropped)
    removed = store.collect(grace_s=0)
    assert any("snapshot object" in r for r in removed)
    left = set(os.listdir(store.root / "objects"))
    assert left < objects and set(store.load(snap).blobs.values()) <= left
    assert [s.id for s in store.snapshots()] == [snap.id]
    with pytest.raises(SnapshotNotFound):
        store.load(dropped)

    # a byte changed in a stored object: refused, nothing started
    victim = store.object_path(store.load(snap).blobs["workspace"])
    os.chmod(victim, 0o600)
    data = bytearray(victim.read_bytes())
    data[600] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt):
        Sandbox.create(snapshot=snap, store=store)


# -- memory: the microVM (QEMU migration to a file) ------------------------------------------

COUNTER = """
import threading, time
x = 41
ticks = [0]
def tick():
    while True:
        ticks[0] += 1
        time.sleep(0.05)
threading.Thread(target=tick, daemon=True).start()
time.sleep(0.3)
"""


@pytest.mark.parametrize("tier", MEMORY_TIERS)
def test_a_paused_sandbox_resumes_with_its_memory(tier: str, store: SnapshotStore) -> None:
    """A Python variable and a thread that keeps running survive a pause, a process exit, a resume."""
    require_tier(tier)
    paused = _child(
        f"""
        sbx = Sandbox.create({tier!r}, limits=Limits(memory_mb=256, pids=64))
        sbx.files.write("a.txt", "kept")
        sbx.run_code({COUNTER!r})
        before = int(sbx.run_code("ticks[0]").text)
        snap = sbx.pause(store=store)
        print(json.dumps({{"id": sbx.id, "kind": snap.kind, "before": before}}))
        """,
        store,
    )
    assert paused["kind"] == "memory"
    with Sandbox.resume(str(paused["id"]), store=store) as sbx:
        assert sbx.run_code("x + 1").text == "42"
        first = int(str(sbx.run_code("ticks[0]").text))
        later = int(str(sbx.run_code("import time; time.sleep(0.5); ticks[0]").text))
        assert int(str(paused["before"])) <= first < later  # the thread went on where it was
        assert sbx.files.read("a.txt") == "kept"
        with pytest.raises(SnapshotIncompatible):
            Sandbox.create(snapshot=sbx.snapshot(store=store), store=store, limits=Limits(memory_mb=300))


@pytest.mark.parametrize("tier", MEMORY_TIERS)
def test_forks_of_one_memory_snapshot_are_distinct(tier: str, store: SnapshotStore) -> None:
    """Each guest restored from one snapshot draws its own randomness (the kernel reseeded
    before anything runs): random bytes, temporary names, its boot id, its clock. Ten of
    them, one at a time (0.9-2.7 s each under load); then the image modified is refused."""
    require_tier(tier)
    with Sandbox.create(tier, limits=LIMITS) as sbx:
        # OpenSSL's generators, drawn from before the snapshot: they live in the interpreter's
        # memory and drew the same bytes in every copy (as TLS's secrets would)
        sbx.run_code("import os, random, ssl, tempfile, time, uuid; ssl.RAND_bytes(8)")
        snap = sbx.snapshot(store=store)
    assert snap.kind is SnapshotKind.MEMORY
    probe = (
        "(os.urandom(16).hex(), random.random(), tempfile.mktemp(), uuid.uuid4().hex,"
        " open('/proc/sys/kernel/random/boot_id').read(), round(time.time()))"
    )
    seen, openssl = [], []
    for _ in range(MEMORY_FORKS):  # one at a time: what each draws is its own, whenever it runs
        with Sandbox.create(snapshot=snap, store=store) as fork:
            assert fork.run_code("x = 1").error is None
            seen.append(fork.run_code(probe).text)
            seen.append(fork.commands.run("head -c 16 /dev/urandom | od -An -tx1; mktemp").stdout)
            openssl.append(fork.run_code("ssl.RAND_bytes(8).hex()").text)
    assert len(set(seen)) == len(seen) == 2 * MEMORY_FORKS
    assert len(set(openssl)) == MEMORY_FORKS, openssl
    # a byte of the memory image changed (in place: its size and mtime may stay, its change
    # time cannot): refused before anything runs
    image = store.object_path(store.load(snap).blobs["memory"])
    os.chmod(image, 0o600)
    with open(image, "r+b") as fh:
        fh.seek(image.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 1]))
    with pytest.raises(SnapshotCorrupt):
        Sandbox.create(snapshot=snap, store=store)


def test_taking_and_restoring_are_audited(store: SnapshotStore) -> None:
    require_tier("process")
    with capture_audit() as audit:
        backend = AuditedBackend(ProcessBackend(), audit, run_id="run-1")
        with Sandbox.create(backend=backend, limits=LIMITS) as sbx:
            snap = sbx.snapshot(store=store)
        with Sandbox.create(snapshot=snap, backend=backend):
            pass
        taken = audit.of(EventKind.SNAPSHOT_TAKE)[0]
        assert taken.attributes["snapshot_id"] == snap.id and taken.attributes["kind"] == "files"
        restored = audit.of(EventKind.SNAPSHOT_RESTORE)[0]
        assert restored.attributes["snapshot_id"] == snap.id
        assert restored.attributes["source"] == snap.source
        assert verify(audit.store).ok


def test_a_pool_filled_from_a_snapshot_hands_out_its_files(store: SnapshotStore) -> None:
    require_tier("process")
    with Sandbox.create("process", limits=LIMITS) as sbx:
        sbx.files.write("prepared.txt", "ready")
        snap = sbx.snapshot(store=store)
    with SandboxPool(size=2, snapshot=snap, store=store) as pool:
        for _ in range(3):
            with pool.acquire() as member:
                assert member.files.read("prepared.txt") == "ready"
                member.files.write("prepared.txt", "dirty")


def test_a_pool_filled_from_a_snapshot_runs_on_the_tier_it_was_asked_for(store: SnapshotStore) -> None:
    """As Sandbox.create does: a files snapshot taken on the process tier filled a pool asked
    for Docker with process members, running code under a weaker boundary than asked."""
    require_tier("process")
    require_tier("docker")
    with Sandbox.create("process", limits=LIMITS) as sbx:
        sbx.files.write("prepared.txt", "ready")
        snap = sbx.snapshot(store=store)
    with SandboxPool("docker", size=1, snapshot=snap, store=store) as pool, pool.acquire() as member:
        assert member.tier == "docker" and member.files.read("prepared.txt") == "ready"
    with SandboxPool(size=1, snapshot=snap, store=store) as pool, pool.acquire() as member:
        assert member.tier == "process"  # none given: the snapshot's


def test_a_sparse_file_past_the_store_is_refused_before_it_reaches_the_hosts_disk(tmp_path: Path) -> None:
    # 2 GiB of holes inside (a few KiB of the sandbox's memory) were written out whole to
    # the host's disk at each snapshot, then refused as over the store's limit, and left there.
    require_tier("process")
    small = SnapshotStore(tmp_path / "small", max_bytes=64 << 20)
    with Sandbox.create("process", limits=LIMITS) as sbx:
        sbx.run_code("open('/workspace/holes', 'wb').truncate(2 << 30)")
        with pytest.raises(SnapshotError, match="does not fit the snapshot store"):
            sbx.snapshot(store=small)
        assert small.size() < 1 << 20
        sbx.files.remove("holes")
        assert sbx.snapshot(store=small).id  # the sandbox and the store are as good as before


# The tiers whose files snapshots stream through the store's room (gVisor's, with memory=False, too).
FILES_TIERS = [t for t in ("process", "docker") if t in TIERS]
# What a file's blocks may exceed its bytes by on the host's disk (rounding, extent blocks).
SLACK = 1 << 20


class DiskWatch:
    """The most the store's files ever held on the host's disk at once, sampled while the
    store's room is held still (a sample taken file by file would count a refused file and
    the one growing into its room both)."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            with self.store.locked():
                self.peak = max(self.peak, disk_bytes(self.store.root))


def disk_bytes(folder: Path) -> int:
    """What the snapshots left in a store: its files, but the mark that it is a store."""
    total = 0
    for path in folder.rglob("*"):
        if path.name == MARKER:
            continue
        with contextlib.suppress(FileNotFoundError):
            st = path.lstat()
            total += st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0
    return total


@pytest.mark.parametrize("tier", FILES_TIERS)
def test_a_snapshots_areas_share_the_room_left_in_the_store(tier: str, tmp_path: Path) -> None:
    # Each area was capped at the store's whole size on its own, and written out before the
    # store refused: two sparse files, each under the cap, put both on the host's disk.
    require_tier(tier)
    small = SnapshotStore(tmp_path / "small", max_bytes=64 << 20)
    with Sandbox.create(tier, limits=LIMITS) as sbx:
        # each within its own area (96 and 16 MiB), together past the store's 64
        sbx.commands.run("truncate -s 55M /workspace/holes; truncate -s 15M /tmp/holes")
        with DiskWatch(small) as watch, pytest.raises(SnapshotError, match="does not fit the snapshot store"):
            sbx.snapshot(store=small, memory=False)
        assert watch.peak <= small.max_bytes + SLACK
        assert disk_bytes(small.root) == 0  # nothing half-written stays
        sbx.commands.run("rm /tmp/holes")
        assert sbx.snapshot(store=small, memory=False).size_bytes >= 55 << 20


@pytest.mark.parametrize("tier", FILES_TIERS)
def test_snapshots_taken_at_once_never_together_pass_the_stores_room(tier: str, tmp_path: Path) -> None:
    # Each snapshot saw only the store as it was: three at once wrote three times the room.
    require_tier(tier)
    shared = SnapshotStore(tmp_path / "shared", max_bytes=48 << 20)  # room for two of them
    with contextlib.ExitStack() as stack:
        sandboxes = [stack.enter_context(Sandbox.create(tier, limits=LIMITS)) for _ in range(3)]
        for sbx in sandboxes:
            sbx.commands.run("head -c 20M /dev/urandom > /workspace/data")
        with DiskWatch(shared) as watch, ThreadPoolExecutor(len(sandboxes)) as pool:
            taken = [pool.submit(sbx.snapshot, store=shared, memory=False) for sbx in sandboxes]
            refused = [f.exception() for f in taken if f.exception() is not None]
    assert 1 <= len(refused) <= 2 and all(isinstance(e, SnapshotError) for e in refused)
    assert watch.peak <= shared.max_bytes + SLACK
    assert shared.size() <= shared.max_bytes


@pytest.mark.parametrize("tier", [t for t in ("gvisor",) if t in TIERS])
def test_a_memory_snapshot_writes_no_more_than_the_stores_room(tier: str, tmp_path: Path) -> None:
    # gVisor's areas are tmpfs on this host, packed here: their sparse files were written out
    # whole, then runsc's image beside them, before the store refused the lot. Room for the
    # image (the sandbox's memory) is held first; the areas get what is left.
    require_tier(tier)
    small = SnapshotStore(tmp_path / "small", max_bytes=320 << 20)
    with Sandbox.create(tier, limits=LIMITS) as sbx:
        # Within the areas' own sizes (96 and 16 MiB), past the 64 MiB the image leaves.
        sbx.commands.run("truncate -s 60M /workspace/holes; truncate -s 15M /tmp/holes")
        with DiskWatch(small) as watch, pytest.raises(SnapshotStoreFull, match="is full"):
            sbx.snapshot(store=small, memory=True)
        assert watch.peak <= small.max_bytes + SLACK
        assert disk_bytes(small.root) == 0
        sbx.commands.run("rm /workspace/holes /tmp/holes")
        assert sbx.snapshot(store=small, memory=True).kind is SnapshotKind.MEMORY


# -- restoring a large snapshot ------------------------------------------------------------

BIG = 240 << 20  # the object restored: large next to what a restore may take of the host's memory


@pytest.mark.parametrize("tier", FILES_TIERS)
def test_a_large_snapshot_restores_in_a_few_mib_of_the_hosts_memory(tier: str, store: SnapshotStore) -> None:
    """A restore read the whole object and sent it as one frame: twice its size in the host's
    memory (2 GB for 1 GiB), whatever the sandbox's limits. It streams now, hashed on the
    way: the host's peak grows by a few chunks, and a byte changed anywhere is refused."""
    limits = Limits(memory_mb=768, timeout_s=60, pids=64)  # a workspace of 384 MiB
    with Sandbox.create(tier, limits=limits) as sbx:
        made = sbx.commands.run(f"truncate -s {BIG} big && printf end >> big && echo kept > /tmp/t")
        assert made.exit_code == 0, made.stderr
        snap = sbx.snapshot(store=store)
    digest = store.load(snap).blobs["workspace"]
    assert store.object_path(digest).stat().st_size > BIG

    restored = _child(
        f"""
        import re
        def vm(key):  # kB
            return int(re.search(key + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))
        with Sandbox.create({tier!r}, limits=Limits(memory_mb=256, pids=64)):  # the tier's first start
            pass
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
        before = vm("VmRSS")
        with Sandbox.create(snapshot={snap.id!r}, store=store, limits=Limits(memory_mb=768, pids=64)) as sbx:
            grown = vm("VmHWM") - before
            out = sbx.commands.run("stat -c %s big; tail -c 3 big; echo; cat /tmp/t; ls -A").stdout
        print(json.dumps({{"grown": grown << 10, "out": out.split()}}))
        """,
        store,
    )
    assert restored["out"] == [str(BIG + 3), "end", "kept", "big"]  # no staging folder left
    assert isinstance(restored["grown"], int) and restored["grown"] < BIG // 4, restored

    # A byte changed past the first chunks (the sandbox unpacks it: only the hash can tell),
    # then one in the first header (the sandbox refuses the archive before the hash is done).
    victim = store.object_path(digest)
    os.chmod(victim, 0o600)
    for offset in (BIG // 2, 100):
        with open(victim, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([byte[0] ^ 1]))
        with pytest.raises(SnapshotCorrupt):
            Sandbox.create(snapshot=snap, store=store, limits=limits)


@pytest.mark.parametrize("tier", FILES_TIERS)
def test_a_snapshot_larger_than_the_sandbox_is_refused_at_its_first_header(
    tier: str, store: SnapshotStore
) -> None:
    """1 GiB of holes snapshotted (the store's room allowed it) could not be restored into a
    128 MiB sandbox: its whole object was sent, and the supervisor died of it ("the
    supervisor exited"). The sandbox refuses the file as its header comes, before its data.
    (The snapshot is of a sandbox whose workspace holds it: see the test below.)"""
    with Sandbox.create(tier, limits=Limits(memory_mb=768, timeout_s=20, pids=64)) as sbx:  # 288 MiB
        assert sbx.commands.run("truncate -s 250M holes").exit_code == 0
        snap = sbx.snapshot(store=store)
    with pytest.raises(SnapshotIncompatible, match=r"does not fit this sandbox.*'holes' is 262144000 bytes"):
        Sandbox.create(snapshot=snap, store=store, limits=Limits(memory_mb=128, pids=64))
    with Sandbox.create(snapshot=snap, store=store, limits=Limits(memory_mb=768, pids=64)) as sbx:
        restored = sbx.files.stat("holes")
        assert restored is not None and restored.size == 250 << 20


# The tiers whose pause writes the sandbox's files out (gVisor's areas with its memory).
PAUSE_TIERS = [t for t in ("process", "docker", "gvisor") if t in TIERS]


@pytest.mark.parametrize("tier", PAUSE_TIERS)
def test_files_larger_than_their_own_area_are_refused_at_pause_and_the_sandbox_runs_on(
    tier: str, store: SnapshotStore
) -> None:
    """`truncate -s 1G` in a 128 MiB workspace takes no space: pause wrote the 1 GiB out
    densely (9 s, and one small sandbox could fill the host's store), then every resume
    failed, the sandbox's other files with it (a resume takes no limits). What no restore
    into the sandbox's own limits could put back is refused before anything is kept; the
    sandbox is left running as it was."""
    require_tier(tier)
    with Sandbox.create(tier, limits=LIMITS) as sbx:  # a workspace of 96 MiB, /tmp of 16 MiB
        sbx.files.write("important.txt", "the user's work")
        for path, setting in (("/workspace/.cache-sparse", "disk_mb=96"), ("/tmp/holes", "tmp_mb=16")):
            assert sbx.commands.run(f"truncate -s 200M {path}").exit_code == 0
            with pytest.raises(SnapshotIncompatible) as refused:
                sbx.pause(store=store)
            said = str(refused.value)
            assert PurePosixPath(path).name in said and "remove or shrink" in said, said
            assert setting in said, said
            assert sbx.alive and store.size() == 0
            assert sbx.commands.run(f"rm {path}").exit_code == 0
        sbx.pause(store=store)
    with Sandbox.resume(sbx.id, store=store) as resumed:
        assert resumed.files.read("important.txt") == "the user's work"


def test_a_snapshot_kept_before_files_counted_restores_all_it_holds(store: SnapshotStore) -> None:
    """At memory_mb=64 the workspace held 32 MiB and 65,536 files before a file's kernel memory
    counted (2026-12-06), 24 MiB and 4,096 files today. A snapshot kept then (its manifest
    rewritten here as that stockade wrote it) holding 28 MiB and 5,000 files was refused,
    blaming disk_mb; it restores with the places it had, in the memory that holds them. Files
    past a count given today are refused naming inodes."""
    require_tier("process")
    fill = (
        "head -c 29360128 /dev/zero > big && mkdir many && cd many && for i in $(seq 5000); do : > f$i; done"
    )
    with Sandbox.create("process", limits=Limits(memory_mb=256, timeout_s=20, pids=64)) as sbx:
        assert sbx.commands.run(fill).exit_code == 0
        snap = sbx.snapshot(store=store)
    kept = store.load(snap)
    older = {k: v for k, v in kept.spec.items() if k != "files_counted"}
    older["limits"] = {**older["limits"], "memory_mb": 64, "disk_mb": None, "tmp_mb": None, "inodes": 65536}
    old = store.save(
        kind=kept.snapshot.kind, tier="process", source="older", spec=older, blobs=kept.blobs,
        tier_state=kept.tier_state,
    )  # fmt: skip
    with Sandbox.create(snapshot=old, store=store) as restored:
        found = restored.commands.run(
            "ls many | wc -l; stat -c %s big; df -k --output=size,itotal /workspace"
        )
        assert found.stdout.split() == ["5000", "29360128", "1K-blocks", "Inodes", "32768", "65536"]
    fewer = Limits(memory_mb=256, inodes=4000, timeout_s=20, pids=64)
    with pytest.raises(
        SnapshotIncompatible, match=r"holds more files than the sandbox's \(inodes=4000\)"
    ) as e:
        Sandbox.create(snapshot=snap, store=store, limits=fewer)
    assert "(memory_mb, and inodes)" in str(e.value) and "disk_mb" not in str(e.value)


@pytest.mark.parametrize("tier", TIERS)
def test_a_restore_leaves_out_what_the_restoring_rules_hide(tier: str, store: SnapshotStore) -> None:
    """What the rules do not let the run read never enters the sandbox, from a snapshot
    either: one taken before the operator hid ``secrets/**`` brought the key back, readable
    to code (``files.read`` refused it). The restoring sandbox's rules decide, as for an upload."""
    require_tier(tier)
    with Sandbox.create(tier, limits=LIMITS) as sbx:
        sbx.files.write("secrets/key.txt", "TOPSECRET")
        sbx.files.write("src/app.py", "x = 1")
        sbx.files.write("notes.txt", "n")
        snap = sbx.snapshot(memory=False, store=store)
    hidden = SandboxRules(hide=("secrets/**",))
    with Sandbox.create(snapshot=snap, store=store, rules=hidden) as back:
        assert _entries(back) == "./notes.txt\n./src\n./src/app.py\n"
    only_src = SandboxRules(read=("src/**",))
    with Sandbox.create(snapshot=snap, store=store, rules=only_src) as back:
        assert _entries(back) == "./src\n./src/app.py\n"


@pytest.mark.parametrize("tier", TIERS)
def test_fifos_and_sockets_do_not_come_back_from_a_snapshot(tier: str, store: SnapshotStore) -> None:
    """A Unix socket came back an empty executable file (tar has no type for it): neither it
    nor a FIFO is workspace content, and both are left out, as a download leaves them out."""
    require_tier(tier)
    with Sandbox.create(tier, limits=LIMITS) as sbx:
        bind = "import socket; socket.socket(socket.AF_UNIX).bind('sock')"
        made = sbx.commands.run(f'cd /workspace && mkfifo pipe && python3 -c "{bind}" && echo x > kept.txt')
        assert made.exit_code == 0, made.stderr
        snap = sbx.snapshot(memory=False, store=store)
    with Sandbox.create(snapshot=snap, store=store) as back:
        assert _entries(back) == "./kept.txt\n"


def _entries(sbx: Sandbox) -> str:
    return sbx.commands.run("cd /workspace && find . -mindepth 1 | sort").stdout


@pytest.mark.parametrize("tier", MEMORY_TIERS)
def test_a_memory_snapshot_comes_back_only_under_its_own_rules(tier: str, store: SnapshotStore) -> None:
    """Its supervisor and kernel hold the rules it was taken with: restored under stricter
    ones, a microVM reported them and ran ``whoami`` they deny. Other rules are refused,
    naming what differs; without rules it comes back under its own, and says which."""
    require_tier(tier)
    taken = SandboxRules(deny=("whoami",))
    with Sandbox.create(tier, limits=LIMITS, rules=taken) as sbx:
        snap = sbx.snapshot(memory=True, store=store)
    strict = SandboxRules(deny=("whoami", "touch"))
    with pytest.raises(SnapshotIncompatible, match=r"rules cannot change \(deny \('whoami', 'touch'\), not"):
        Sandbox.create(snapshot=snap, store=store, rules=strict)
    with Sandbox.create(snapshot=snap, store=store) as back:
        assert back.rules == taken
        assert back.commands.run("whoami").exit_code != 0  # masked: denied whatever its arguments
