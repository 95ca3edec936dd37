"""Who a sandbox is on the host: a uid of its own, folders nobody else can enter, no name in ``ps``.

The kernel counts many limits per user (processes, inotify instances, pipe buffers): two
sandboxes with one host uid, or a sandbox with a real account's uid, would share them.
"""

from __future__ import annotations

import os
import pwd
import secrets
import subprocess
import threading
from pathlib import Path

import pytest

from stockade import Limits, Sandbox
from tests.conftest import host_processes, wait_for

# Tiers whose code runs as host processes (gVisor's and the microVM's run inside their kernel).
HOST_PROCESS_TIERS = ["process", "docker"]
LIMITS = Limits(memory_mb=256, timeout_s=30, pids=64)


def _host_uid_of(sbx: Sandbox, marker: str) -> set[int]:
    """Host uids of a command of ``sbx`` (``sleep <marker>``), seen from the host while it runs."""
    sleeper = threading.Thread(target=sbx.commands.run, args=(["sleep", marker],))
    sleeper.start()
    try:
        pids = wait_for(
            lambda: host_processes(f"sleep\0{marker}".encode()), what="the command on the host", timeout_s=20
        )
        return {os.stat(f"/proc/{pid}").st_uid for pid in pids}
    finally:
        sleeper.join()


@pytest.fixture(params=HOST_PROCESS_TIERS)
def host_tier(request: pytest.FixtureRequest) -> str:
    from tests.conftest import require_tier

    require_tier(str(request.param))
    return str(request.param)


def test_each_sandbox_runs_as_a_host_uid_of_its_own_that_no_account_has(host_tier: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("as another user, sandboxes run as that user")
    with Sandbox.create(host_tier, limits=LIMITS) as a, Sandbox.create(host_tier, limits=LIMITS) as b:
        # markers of this test alone: the other tier's run of it may sleep beside it (CI run 92)
        first = 1 + secrets.randbelow(10**6) / 10**7
        uids = [_host_uid_of(a, f"{first:.7f}"), _host_uid_of(b, f"{first + 1e-7:.7f}")]
        assert all(len(u) == 1 for u in uids), uids
        (uid_a,), (uid_b,) = uids
        assert uid_a != uid_b
        for uid in (uid_a, uid_b):
            assert uid >= 65536
            with pytest.raises(KeyError):
                pwd.getpwuid(uid)


INOTIFY_HOG = r"""
import ctypes, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
libc = ctypes.CDLL(None, use_errno=True)
held = []
while len(held) < 100000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    held.append(fd)
(len(held), ctypes.get_errno())
"""


def test_one_sandbox_holding_every_inotify_instance_leaves_others_theirs(host_tier: str) -> None:
    with Sandbox.create(host_tier, limits=LIMITS) as hog, Sandbox.create(host_tier, limits=LIMITS) as other:
        held = hog.run_code(INOTIFY_HOG)
        assert held.error is None, held.error
        result = other.run_code(
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.inotify_init1(0) >= 0"
        )
        assert result.text == "True", f"the hog held {held.text} (count, errno)"


def test_other_host_users_cannot_enter_a_process_sandbox_nor_see_its_name() -> None:
    from tests.conftest import require_tier

    require_tier("process")
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as another host user")
    with Sandbox.create("process", limits=LIMITS) as sbx:
        sbx.files.write("private.txt", "only mine")
        rundir = Path("/run/stockade") / sbx.id
        assert (rundir / "workspace" / "private.txt").exists()
        nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]
        secret, planted = rundir / "workspace" / "private.txt", rundir / "tmp" / "planted"
        read = subprocess.run([*nobody, "cat", str(secret)], check=False, capture_output=True)
        plant = subprocess.run([*nobody, "touch", str(planted)], check=False, capture_output=True)
        assert read.returncode != 0 and b"only mine" not in read.stdout
        assert plant.returncode != 0
        assert sbx.commands.run("ls /tmp").stdout == ""
        assert host_processes(sbx.id.encode()) == [], "the sandbox's id shows in ps"
