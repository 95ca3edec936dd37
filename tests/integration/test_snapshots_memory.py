"""Memory snapshots on gVisor (``runsc checkpoint``/``restore``), run by stockade's own runsc
and as a Docker runtime (each test in both modes): the interpreter's variables, a thread that
keeps running in the interpreter's process survive a pause, the exit of the process that paused,
and a resume in another; forks of one snapshot draw their own randomness; a modified snapshot
is refused; nothing is left behind (bundles, containers, runsc state, host folders).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import (
    LimitNotEnforceable,
    Limits,
    NetworkPolicy,
    Sandbox,
    SandboxRules,
    SnapshotCorrupt,
    SnapshotIncompatible,
    SnapshotKind,
    SnapshotNotFound,
    SnapshotStore,
)
from stockade.sandbox._guest import LABEL_CREATOR, LABEL_ID, current_creator, default_state_dir
from stockade.sandbox._host import claimed
from stockade.sandbox.gvisor import GVisorBackend, RunscBackend
from tests.conftest import require, require_tier

ROOT = Path(__file__).parents[2]
LIMITS = Limits(memory_mb=256, timeout_s=20, pids=64)
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
# So many programs masked that gVisor gets whole folders as masked copies (_rules_binds).
ALLOWLIST = SandboxRules(allow=("python3", "sh", "ls", "cat"))


@pytest.fixture(scope="module", params=["runsc", "docker"])
def gvisor(request: pytest.FixtureRequest) -> GVisorBackend:
    """gVisor run by stockade's own runsc, then as a Docker runtime (this host's default)."""
    require_tier("gvisor")
    if request.param == "runsc":
        report = RunscBackend().probe()
        require("gVisor run by stockade's own runsc", report.available, report.detail)
    else:
        report = GVisorBackend(mode="docker").probe()
        require("gVisor as a Docker runtime", report.available, report.detail)
        require("memory snapshots under Docker", "keep memory" in report.detail, report.detail)
    return GVisorBackend(mode=request.param)


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "snapshots")


def _left() -> set[str]:
    """What this process's gVisor sandboxes left: bundles and host folders, runsc's state
    (of its own sandboxes, and any whose bundle is gone) and containers. Other sandboxes of
    this shared host come and go meanwhile: only this process's (its creator token) count."""
    token = current_creator().token
    folder = default_state_dir()
    found: set[str] = set()
    for bundle in folder.glob("gv-sbx-*"):
        try:
            notes = json.loads((bundle / "config.json").read_text()).get("annotations", {})
        except (OSError, ValueError):
            # No annotations yet: a sandbox being made, held by its live creator, which is
            # another process when this one looks (its own are made and closed by then).
            if claimed(bundle):
                continue
            notes = {}
        if notes.get(LABEL_CREATOR) in (token, None):
            found.add(bundle.name)
    for rundir in folder.glob("ctr-sbx-*"):
        try:
            mine = (rundir / "creator").read_text().split("\n")[1] == token
        except (OSError, IndexError):
            # Its creator not written yet: as above, another live process's sandbox being made
            # (CI 158's teardown error: a folder whose creator was written a moment later).
            if claimed(rundir):
                continue
            mine = True
        if mine:
            found.add(rundir.name)
    listed = subprocess.run(
        ["runsc", "--root", str(folder / "runsc"), "list", "-quiet"],
        capture_output=True,
        text=True,
        check=False,
    )
    for sid in listed.stdout.split():
        if f"gv-{sid}" in found or not (folder / f"gv-{sid}").is_dir():
            found.add(f"runsc:{sid}")
    containers = subprocess.run(
        ["docker", "ps", "-aq", "--no-trunc", "--filter", f"label={LABEL_CREATOR}={token}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return found | {f"container:{cid}" for cid in containers.stdout.split()}


def _traces(sid: str) -> list[str]:
    """Anything left of sandbox ``sid`` (made by another process): folders, runsc state, containers."""
    folder = default_state_dir()
    found = [p.name for p in (folder / f"gv-{sid}", folder / f"ctr-{sid}") if p.exists()]
    listed = subprocess.run(
        ["runsc", "--root", str(folder / "runsc"), "list", "-quiet"],
        capture_output=True,
        text=True,
        check=False,
    )
    found += [f"runsc:{s}" for s in listed.stdout.split() if s == sid]
    containers = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label={LABEL_ID}={sid}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return found + containers.stdout.split()


@pytest.fixture
def no_sandbox_left() -> Iterator[None]:
    before = _left()
    yield
    assert _left() <= before


def _child(code: str, store: SnapshotStore, mode: str) -> dict[str, object]:
    """Run ``code`` in a new Python process whose gVisor runs in ``mode``; it prints one
    JSON line, returned here."""
    program = "import json, sys\nfrom pathlib import Path\nfrom stockade import *\n"
    program += f"store = SnapshotStore(Path({str(store.root)!r}))\n" + textwrap.dedent(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "STOCKADE_GVISOR_MODE": mode}
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_paused_gvisor_sandbox_resumes_with_its_memory(
    gvisor: GVisorBackend, store: SnapshotStore, no_sandbox_left: None
) -> None:
    """A variable, the interpreter's process with a thread that keeps counting, and the files
    (the workspace's, /tmp's and /dev/shm's) survive a pause, the exit of the process that
    paused, and a resume in this one (whatever mode its gVisor tier has). (A run's own
    processes end with the run on every tier: the processes that live between calls are the
    supervisor's, the zygote and the interpreter.)"""
    paused = _child(
        f"""
        sbx = Sandbox.create("gvisor", limits=Limits(memory_mb=256, pids=64))
        sbx.files.write("a.txt", "kept")
        sbx.commands.run("echo scratch > /tmp/t && echo shared > /dev/shm/s && ln -s /usr/bin/python3 py")
        sbx.run_code({COUNTER!r})
        before = int(sbx.run_code("ticks[0]").text)
        pid = sbx.run_code("import os; os.getpid()").text
        snap = sbx.pause(store=store)
        out = {{"id": sbx.id, "kind": snap.kind, "before": before, "pid": pid, "alive": sbx.alive}}
        print(json.dumps(out))
        """,
        store,
        gvisor.mode,
    )
    assert paused["kind"] == "memory" and paused["alive"] is False
    with Sandbox.resume(str(paused["id"]), store=store) as sbx:
        assert sbx.id == paused["id"]
        assert sbx.run_code("x + 1").text == "42"
        first = int(str(sbx.run_code("ticks[0]").text))
        later = int(str(sbx.run_code("import time; time.sleep(0.5); ticks[0]").text))
        assert int(str(paused["before"])) <= first < later  # the thread went on where it was
        assert sbx.run_code("os.getpid()").text == paused["pid"]  # the same interpreter process
        assert sbx.files.read("a.txt") == "kept"
        assert (
            sbx.commands.run("cat /tmp/t /dev/shm/s; echo more >> /tmp/t; ./py -c 'print(6 * 7)'").stdout
            == "scratch\nshared\n42\n"
        )
        assert sbx.files.read("a.txt") == "kept"
        again = sbx.snapshot(store=store)  # a restored sandbox snapshots like any other
        assert again.kind is SnapshotKind.MEMORY
        with pytest.raises(SnapshotIncompatible):
            Sandbox.create(snapshot=again, store=store, limits=Limits(memory_mb=300))
    with pytest.raises(SnapshotNotFound):
        Sandbox.resume(str(paused["id"]), store=store)
    assert _traces(str(paused["id"])) == []


def test_forks_of_one_gvisor_memory_snapshot_are_distinct(
    gvisor: GVisorBackend, store: SnapshotStore, no_sandbox_left: None
) -> None:
    """Each sandbox restored from one snapshot has its own randomness, in the kernel (gVisor's
    comes from the host) and in the interpreter (``random``, ``tempfile``: reseeded), and its
    own state from then on."""
    with Sandbox.create(backend=gvisor, limits=LIMITS) as sbx:
        sbx.run_code("import os, random, tempfile, uuid\nx = 1\nrandom.random(); tempfile.mktemp()")
        snap = sbx.snapshot(store=store)
        assert sbx.run_code("x").text == "1"  # the sandbox snapshotted runs on
    assert snap.kind is SnapshotKind.MEMORY and snap.tier == "gvisor"
    probes = {
        "urandom": "os.urandom(16).hex()",
        "random": "random.random()",
        "mktemp": "tempfile.mktemp()",
        "uuid4": "uuid.uuid4().hex",
    }
    seen: dict[str, list[str]] = {name: [] for name in (*probes, "shell")}
    forks = [Sandbox.create(snapshot=snap, store=store, backend=gvisor) for _ in range(2)]
    try:
        for i, fork in enumerate(forks):
            assert fork.run_code(f"x += {i + 1}; x").text == str(2 + i)  # each goes on alone
            for name, expr in probes.items():
                seen[name].append(str(fork.run_code(expr).text))
            seen["shell"].append(fork.commands.run("head -c 16 /dev/urandom | od -An -tx1; mktemp").stdout)
    finally:
        for fork in forks:
            fork.close()
    for name, values in seen.items():
        assert len(set(values)) == len(values), f"{name} repeats across forks: {values}"


def test_a_modified_gvisor_memory_snapshot_is_refused(
    gvisor: GVisorBackend, store: SnapshotStore, no_sandbox_left: None
) -> None:
    with Sandbox.create(backend=gvisor, limits=LIMITS) as sbx:
        sbx.run_code("x = 1")
        sbx.files.write("a.txt", "kept")
        snap = sbx.snapshot(store=store)
    manifest = store.load(snap)
    assert {"memory", "workspace", "tmp"} <= set(manifest.blobs)
    for role in ("memory", "workspace"):
        victim = store.object_path(manifest.blobs[role])
        original = victim.read_bytes()
        os.chmod(victim, 0o600)
        data = bytearray(original)
        data[len(data) // 2] ^= 1
        victim.write_bytes(bytes(data))
        with pytest.raises(SnapshotCorrupt):
            Sandbox.create(snapshot=snap, store=store, backend=gvisor)
        victim.write_bytes(original)
    with Sandbox.create(snapshot=snap, store=store, backend=gvisor) as fork:  # made whole again
        assert fork.run_code("x").text == "1"


def test_a_gvisor_memory_snapshot_gives_its_files_to_another_tier(
    gvisor: GVisorBackend, store: SnapshotStore, no_sandbox_left: None
) -> None:
    require_tier("process")
    with Sandbox.create(backend=gvisor, limits=LIMITS) as sbx:
        sbx.files.write("notes/a.txt", "kept")
        sbx.commands.run("ln -s notes/a.txt link && echo t > /tmp/t")
        snap = sbx.snapshot(store=store)
    with Sandbox.create("process", snapshot=snap, store=store) as other:
        assert other.commands.run("cat link /tmp/t").stdout == "keptt\n"


def test_gvisor_under_docker_says_it_keeps_memory(store: SnapshotStore, no_sandbox_left: None) -> None:
    """Under Docker (a local engine, as root): the probe says so, and a snapshot is of the
    memory unless files are asked for."""
    require_tier("gvisor")
    docker = GVisorBackend(mode="docker")
    report = docker.probe()
    require("gVisor as a Docker runtime", report.available, report.detail)
    assert "snapshots keep memory" in report.detail
    with Sandbox.create(backend=docker, limits=LIMITS) as sbx:
        sbx.run_code("x = 1")
        assert sbx.snapshot(store=store).kind is SnapshotKind.MEMORY
        assert sbx.snapshot(store=store, memory=False).kind is SnapshotKind.FILES


def test_a_containers_image_restores_without_the_offline_rootfs(
    store: SnapshotStore, tmp_path: Path, no_sandbox_left: None
) -> None:
    """A snapshot taken under Docker restores on its image's own files: a host without the
    offline root filesystem (which a direct-mode sandbox needs) restores it all the same."""
    require_tier("gvisor")
    docker = GVisorBackend(mode="docker", rootfs=tmp_path / "no-rootfs")
    report = docker.probe()
    require("memory snapshots under Docker", "keep memory" in report.detail, report.detail)
    with Sandbox.create(backend=docker, limits=LIMITS) as sbx:
        sbx.run_code("x = 7")
        snap = sbx.snapshot(store=store)
    with Sandbox.create(snapshot=snap, store=store, backend=docker) as fork:
        assert fork.run_code("x").text == "7"
        assert fork.commands.run("id -un").stdout == "sandbox\n"  # its uid named in /etc/passwd


def test_a_gvisor_sandbox_with_an_allowlist_keeps_files_only(
    gvisor: GVisorBackend, store: SnapshotStore
) -> None:
    """Its relay's connections end in this process's egress proxy: no image can hold them."""
    network = NetworkPolicy(allow_hosts=("example.com",))
    with Sandbox.create(backend=gvisor, limits=LIMITS, network=network) as sbx:
        with pytest.raises(LimitNotEnforceable, match="allowlist"):
            sbx.snapshot(store=store, memory=True)
        assert sbx.snapshot(store=store).kind is SnapshotKind.FILES


def test_a_container_with_a_commands_allowlist_keeps_files_and_says_so_up_front(
    store: SnapshotStore, no_sandbox_left: None
) -> None:
    """Under Docker an allowlist's masked copies of program folders are bound into the
    container, and a restore cannot bind them again: the default snapshot keeps the files,
    and one that must keep memory is refused before the store holds anything, with a fix
    that works (memory=None is what asks for memory where it can be kept)."""
    require_tier("gvisor")
    docker = GVisorBackend(mode="docker")
    report = docker.probe()
    require("memory snapshots under Docker", "keep memory" in report.detail, report.detail)
    with Sandbox.create(backend=docker, limits=LIMITS, rules=ALLOWLIST, allow_weaker=True) as sbx:
        sbx.run_code("x = 3")
        with pytest.raises(LimitNotEnforceable, match="masked copy of /usr/bin") as refused:
            sbx.snapshot(store=store, memory=True)
        assert refused.value.fix == "pass memory=False to keep the files only"
        assert not [p for p in store.root.rglob("*") if p.is_file() and p.name != "lock"]
        assert sbx.snapshot(store=store).kind is SnapshotKind.FILES
        assert sbx.run_code("x").text == "3"  # the sandbox runs on


def test_a_gvisor_sandbox_run_by_runsc_keeps_its_memory_under_a_commands_allowlist(
    store: SnapshotStore, no_sandbox_left: None
) -> None:
    """Run by stockade's own runsc, a restore makes the same masked copies again (the masks
    are part of the machine key): memory is kept, and the restored sandbox is as confined,
    its written places noexec and memfds refused (a snapshot of before they were is refused:
    SNAPSHOT_VERSION)."""
    require_tier("gvisor")
    report = RunscBackend().probe()
    require("gVisor run by stockade's own runsc", report.available, report.detail)
    runsc = GVisorBackend(mode="runsc")
    with Sandbox.create(backend=runsc, limits=LIMITS, rules=ALLOWLIST, allow_weaker=True) as sbx:
        sbx.run_code("x = 3")
        snap = sbx.snapshot(store=store)
    assert snap.kind is SnapshotKind.MEMORY
    with Sandbox.create(snapshot=snap, store=store, backend=runsc) as fork:
        assert fork.run_code("x").text == "3"
        assert fork.commands.run("cat /etc/hostname").exit_code == 0
        assert fork.commands.run("head -1 /etc/hostname").exit_code != 0  # still masked
        # a checkpoint keeps its mounts' flags: the written places are noexec still
        copy = fork.commands.run(
            'python3 -c \'import shutil; shutil.copy("/usr/bin/ls", "/tmp/ls")\'; /tmp/ls'
        )
        assert copy.exit_code == 126 and "Permission denied" in copy.stderr, copy
        # and so its processes' seccomp filters: no memfd, where no noexec would hold
        memfd = fork.commands.run(["python3", "-c", "import os; os.memfd_create('program')"])
        assert memfd.exit_code == 1 and "Operation not permitted" in memfd.stderr, memfd
        denied = fork.run_code("import os\nos.memfd_create('program')")
        assert denied.error is not None and denied.error.name == "PermissionError", denied
