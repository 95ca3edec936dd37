"""The layout of a gVisor container of Docker that a memory snapshot keeps: its mounts in
order, each bind by role (never a host path), read back checked, bound again to a new
sandbox's own sources; a container with any other mount is refused before a checkpoint; the
runsc state root read from the container's kernel is checked before it is used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stockade import LimitNotEnforceable, SnapshotCorrupt, SnapshotError
from stockade.sandbox._gvisor_docker_memory import ContainerMemory, DockerLayout, container_mounts
from stockade.sandbox.snapshots import SnapshotStore
from tests.conftest import require


def _sources(root: Path) -> dict[str, Path]:
    names = ("workspace", "tmp", "supervisor", "passwd", "group", "unreadable")
    sources = {name: root / name for name in names}
    for path in sources.values():
        path.touch()
    return {**sources, "null": Path("/dev/null")}


def _config(root: Path) -> dict[str, Any]:
    return {
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["size=65536k"]},
            {
                "destination": "/workspace",
                "type": "bind",
                "source": str(root / "workspace"),
                "options": ["rbind"],
            },
            {
                "destination": "/etc/hostname",
                "type": "bind",
                "source": "/dev/null",
                "options": ["rbind", "ro"],
            },
            {"destination": "/usr/bin/curl", "source": str(root / "unreadable"), "options": ["bind", "ro"]},
        ]
    }


def test_a_containers_mounts_are_kept_by_role_and_bound_again(tmp_path: Path) -> None:
    layout = container_mounts(_config(tmp_path), _sources(tmp_path))
    kept = DockerLayout(image="sha256:ab", uid=1_900_000_000, mounts=layout.mounts)
    assert [m[2] for m in kept.mounts] == ["proc", "shm", "workspace", "null", "unreadable"]
    again = DockerLayout.from_state(kept.state())
    assert again == kept
    assert again.masks() == ("/usr/bin/curl",)
    new = {role: tmp_path / "new" / role for role in ("workspace", "null", "unreadable")}
    mounts = again.oci_mounts(new)
    assert [m["destination"] for m in mounts] == [
        "/proc",
        "/dev/shm",
        "/workspace",
        "/etc/hostname",
        "/usr/bin/curl",
    ]
    assert mounts[2] == {
        "destination": "/workspace",
        "type": "bind",
        "source": str(tmp_path / "new/workspace"),
        "options": ["rbind"],
    }
    assert mounts[0]["source"] == "proc"


def test_a_container_with_another_bind_or_mount_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path)
    config["mounts"].append({"destination": "/data", "type": "bind", "source": "/srv", "options": ["rbind"]})
    with pytest.raises(LimitNotEnforceable, match="/srv at /data"):
        container_mounts(config, _sources(tmp_path))
    config = _config(tmp_path)
    config["mounts"].append({"destination": "/n", "type": "nfs", "source": "h:/x", "options": []})
    with pytest.raises(LimitNotEnforceable, match="'nfs'"):
        container_mounts(config, _sources(tmp_path))


@pytest.mark.parametrize(
    "change",
    [
        {"mounts": [["/etc", "bind", "/etc", []]]},  # a host path, not a role
        {"mounts": [["/x", "overlay", "o", []]]},
        {"mounts": [["relative", "tmpfs", "t", []]]},
        {"uid": 0},
        {"uid": "many"},
        {"image": None, "uid": None},
        {"mounts": 3},
    ],
)
def test_a_layout_read_back_is_checked(change: dict[str, Any]) -> None:
    state = {"image": "sha256:ab", "uid": 1_900_000_000, "mounts": [["/proc", "proc", "proc", []]], **change}
    if change.get("image", "") is None:
        del state["image"]
    with pytest.raises(SnapshotCorrupt):
        DockerLayout.from_state(state)


class _Engine:
    """What ``ContainerMemory`` asks of the engine: the container's kernel pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def inspect_container(self, cid: str) -> dict[str, Any]:
        return {"State": {"Pid": self.pid}}


@pytest.mark.parametrize("mode", [0o777, 0o755])
def test_a_state_root_others_may_write_or_no_runsc_state_is_refused(tmp_path: Path, mode: int) -> None:
    """The root comes from the command line of the container's kernel, the sandbox's side: one
    that others may write is refused; one root's alone is used only if runsc's state there
    names the container (here it has none)."""
    if mode == 0o755:
        require("root", os.geteuid() == 0, "a state root root's alone is made by root")
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, mode)
    kernel = subprocess.Popen(
        [sys.executable, "-c", "print(1, flush=True); import time; time.sleep(60)", f"--root={root}"],
        stdout=subprocess.PIPE,
    )
    try:
        assert kernel.stdout is not None and kernel.stdout.readline() == b"1\n"  # its command line is set
        memory = ContainerMemory(
            _Engine(kernel.pid),
            "c" * 64,
            tmp_path,
            runtime={"path": "runsc", "runtimeArgs": ["--platform=systrap"]},
            platform="systrap",
            image="sha256:ab",
            folder=tmp_path,
            masks=(),
            mask_binds=(),
            uid=1_900_000_000,
            state_dir=tmp_path,
        )
        refused = pytest.raises(SnapshotError, match="root writes" if mode == 0o777 else "runsc state")
        with refused, SnapshotStore(tmp_path / "store").reserve() as room:
            memory.save(room, stop=False)
    finally:
        kernel.kill()
        kernel.wait()
        if kernel.stdout is not None:
            kernel.stdout.close()


def _memory(tmp_path: Path, mask_binds: tuple[tuple[str, str], ...]) -> ContainerMemory:
    return ContainerMemory(
        _Engine(0),
        "c" * 64,
        tmp_path,
        runtime={"path": "runsc"},
        platform="systrap",
        image="sha256:ab",
        folder=tmp_path,
        masks=tuple(dest for _, dest in mask_binds),
        mask_binds=mask_binds,
        uid=1_900_000_000,
        state_dir=tmp_path,
    )


def test_programs_masked_one_by_one_leave_the_memory_to_be_kept(tmp_path: Path) -> None:
    cover = str(tmp_path / "unreadable")
    assert _memory(tmp_path, ((cover, "/usr/bin/curl"), (cover, "/usr/bin/wget"))).refusal() is None


def test_a_masked_copy_of_a_folder_keeps_files_only_known_before_any_checkpoint(tmp_path: Path) -> None:
    """A restore binds again only the container's roles: a masked copy of /usr/bin is none."""
    copy = tmp_path / "masked-0123-291"
    copy.mkdir()
    said = _memory(tmp_path, ((str(copy), "/usr/bin"),)).refusal()
    assert said is not None and "masked copy of /usr/bin" in said
