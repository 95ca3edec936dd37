"""The process tier's garbage collection never takes a live creator's sandbox, at any instant
of its start: several processes of one host (an evaluation pipeline's workers) create
sandboxes while any of them, or ``stockade gc``, collects."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.sandbox import _cgroups
from stockade.sandbox._process_rundirs import OWNER_FILE, OWNERLESS_GRACE_S, collect_garbage
from stockade.types import Mechanism
from tests.conftest import require, require_tier


@pytest.fixture(autouse=True)
def _process_tier() -> None:
    require_tier("process")


class Creator:
    """A second process of this host that runs ``code`` and waits, as a creator stopped at
    one instant of its sandbox's start."""

    def __init__(self, code: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.said = self.proc.stdout.readline().strip()
        assert self.said, "the creator did not get there"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def creators() -> Iterator[list[Creator]]:
    started: list[Creator] = []
    yield started
    for creator in started:
        creator.stop()


BEFORE_THE_OWNER = """
import os, sys
folder = os.path.join(sys.argv[1], sys.argv[2])
os.mkdir(folder, 0o700)  # a previous version's start(): the folder, then its owner file
print(folder, flush=True)
sys.stdin.read()
"""

CLAIMED = """
import sys
from pathlib import Path
from stockade.sandbox._process_rundirs import claim_rundir
rundir = claim_rundir(Path(sys.argv[1]), sys.argv[2])
print(rundir, flush=True)
sys.stdin.read()
"""

GROUP_MADE = """
import sys
from stockade.sandbox import _cgroups
_cgroups.Cgroup(_cgroups.detect().mechanism, sys.argv[1])
print("made", flush=True)
sys.stdin.read()
"""


def test_gc_spares_a_previous_versions_creator_between_its_folder_and_its_owner(
    tmp_path: Path, creators: list[Creator]
) -> None:
    # Before, gc took a folder without an owner file for a crashed creator's, and removed it
    # under the creator (FileNotFoundError: .../owner).
    sid = f"sbx-{uuid.uuid4().hex[:12]}"
    creators.append(Creator(BEFORE_THE_OWNER, str(tmp_path), sid))
    folder = Path(creators[0].said)
    assert collect_garbage(tmp_path) == [] and folder.is_dir()
    # Ownerless for longer than any start takes: a crash's leftover.
    old = time.time() - 2 * OWNERLESS_GRACE_S
    os.utime(folder, (old, old))
    assert collect_garbage(tmp_path) == [f"process sandbox {sid}"]


def test_a_run_folder_appears_with_its_owner_locked_and_gc_spares_it_while_the_creator_lives(
    tmp_path: Path, creators: list[Creator]
) -> None:
    sid = f"sbx-{uuid.uuid4().hex[:12]}"
    creators.append(Creator(CLAIMED, str(tmp_path), sid))
    creator = creators[0]
    rundir = Path(creator.said)
    assert rundir == tmp_path / sid and [p.name for p in tmp_path.iterdir()] == [sid]
    # The format every installed version's gc reads: "pid start-time".
    pid, started = (rundir / OWNER_FILE).read_text().split()
    assert int(pid) == creator.proc.pid and started
    os.kill(creator.proc.pid, signal.SIGSTOP)  # a creator the scheduler left behind
    try:
        assert collect_garbage(tmp_path) == [] and rundir.is_dir()
    finally:
        os.kill(creator.proc.pid, signal.SIGCONT)
    creator.stop()
    assert collect_garbage(tmp_path) == [f"process sandbox {sid}"]
    assert list(tmp_path.iterdir()) == []


def test_gc_of_another_state_folder_spares_a_group_whose_sandbox_has_not_entered_it(
    tmp_path: Path, creators: list[Creator]
) -> None:
    # Between a sandbox's cgroup and its first process the group is empty; the gc of another
    # state folder (another worker's, the suite's closing `stockade gc`) removed it, and the
    # sandbox failed to start (cgroup .../tasks: Directory nonexistent).
    require(
        "cgroups", _cgroups.detect().mechanism is not Mechanism.NONE, "no cgroup hierarchy to manage here"
    )
    name = f"sbx-{uuid.uuid4().hex[:12]}"
    creators.append(Creator(GROUP_MADE, name))
    assert name in _cgroups.leftover_groups()
    assert not any(name in line for line in collect_garbage(tmp_path / "another-state-folder"))
    assert name in _cgroups.leftover_groups()
    creators[0].stop()  # crashed before its sandbox started: the group is garbage now
    collected = collect_garbage(tmp_path / "another-state-folder")
    # gone, by this gc or by another test's meanwhile (a parallel run's: CI run 89)
    assert name not in _cgroups.leftover_groups(), collected


WORKER = """
import json, sys, time
from pathlib import Path
from stockade import Sandbox
from stockade.sandbox.process import ProcessBackend

backend = ProcessBackend(state_dir=Path(sys.argv[1]))
deadline = time.monotonic() + float(sys.argv[2])
made, failures = [], []
while time.monotonic() < deadline:
    try:
        with Sandbox.create(backend=backend) as sbx:
            assert sbx.commands.run("echo ok").stdout == "ok\\n"
        made.append(sbx.id)
    except Exception as err:
        failures.append(repr(err))
print(json.dumps({"made": made, "failures": failures}), flush=True)
"""


@pytest.mark.parametrize("seconds", [8.0])
def test_workers_create_while_gc_runs_over_and_over(tmp_path: Path, seconds: float) -> None:
    # Two workers of one host create and close sandboxes in one state folder; meanwhile gc
    # runs in a loop over that folder and over another (whose gc sees the workers' groups).
    # Not the other folder's on a shared host: its gc sees every sandbox group of the host,
    # and an older version's creator holds no lock on its group while it starts.
    # The state where the sandboxes' uids can reach it (pytest's folders are root's alone).
    with tempfile.TemporaryDirectory(prefix="stockade-gcrace-") as shared:
        os.chmod(shared, 0o711)
        shared_host = os.environ.get("STOCKADE_TEST_SHARED_HOST", "") not in ("", "0")
        another = None if shared_host else tmp_path / "another-state-folder"
        _race(Path(shared) / "state", another, seconds)


def _race(state: Path, another: Path | None, seconds: float) -> None:
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(state), str(seconds)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    collected: list[str] = []
    try:
        while any(w.poll() is None for w in workers):
            collected += collect_garbage(state)
            if another is not None:
                collected += collect_garbage(another)
    finally:
        outputs = [w.communicate(timeout=60)[0] for w in workers]
    made: list[str] = []
    for out in outputs:
        report = json.loads(out)
        assert report["failures"] == [], (report["failures"][:3], collected)
        assert report["made"], "a worker made no sandbox"
        made += report["made"]
    # Only the workers' count: other sandboxes of a shared host come and go meanwhile.
    assert [line for line in collected if any(sid in line for sid in made)] == []


CLAIMED_FOLDER = """
import sys
from pathlib import Path
from stockade.sandbox import _host
_host.claim_folder(Path(sys.argv[1]))
print(sys.argv[1], flush=True)
sys.stdin.read()
"""


def _tier_gc(tier: str) -> list[str]:
    if tier == "docker":
        from stockade.sandbox.docker import collect_garbage as docker_gc

        return docker_gc()
    if tier == "gvisor":
        from stockade.sandbox.gvisor import collect_garbage as gvisor_gc

        return gvisor_gc()
    from stockade.sandbox.microvm import collect_garbage as microvm_gc

    return microvm_gc()


@pytest.mark.parametrize(("tier", "prefix"), [("docker", "ctr-"), ("gvisor", "gv-"), ("microvm", "vm-")])
def test_the_other_tiers_gc_spares_a_folder_its_creator_holds_before_it_names_the_creator(
    tier: str, prefix: str, creators: list[Creator]
) -> None:
    # Their folders say who created them only later (a container's "creator", a bundle's
    # config.json, a microVM's owner.json written after QEMU started); gc spared such a folder
    # for 60 s only, and a start stalled longer (a restore unpacking memory on a loaded host)
    # lost it. Now the creator holds the folder's claim from the instant it appears.
    from stockade.sandbox._guest import default_state_dir

    state = default_state_dir()
    state.mkdir(parents=True, exist_ok=True, mode=0o711)
    folder = state / f"{prefix}sbx-{uuid.uuid4().hex[:12]}"
    creators.append(Creator(CLAIMED_FOLDER, str(folder)))
    assert folder.is_dir()
    old = time.time() - 120
    os.utime(folder, (old, old))  # a start stalled for two minutes
    assert not any(folder.name.removeprefix(prefix) in line for line in _tier_gc(tier))
    assert folder.is_dir()
    creators[0].stop()
    _tier_gc(tier)
    assert not folder.exists()


def test_gc_removes_a_previous_versions_build_a_week_unused(tmp_path: Path) -> None:
    # Each upgrade left its shared folder (and supervisor folders, initramfs) in the state
    # folder, on tmpfs for root: host memory until a reboot.
    old = tmp_path / "shared-0123456789abcdef"
    (old / "etc").mkdir(parents=True)
    week_ago = time.time() - 8 * 86400
    os.utime(old, (week_ago, week_ago))
    assert "build shared-0123456789abcdef" in collect_garbage(tmp_path)
    assert not old.exists()
