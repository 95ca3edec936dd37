"""The microVM's boot images, built once per run and copied into the stores of the tests about
what comes after a boot image: ready images, QEMUs started ahead, a modified image refused.

Each of those tests used to build its own boot image first, in a store of its own: a cold boot
of a guest under TCG (15-20 s on a busy host) that none of them is about. Building a boot image
is tested by every microVM sandbox's first start in the run (and here); what those tests check
starts once it exists, in a store no other test shares, as before.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from stockade import SnapshotStore
from stockade.sandbox.base import SandboxSpec
from stockade.types import NetworkPolicy, SandboxRules
from tests.conftest import require_tier

# The machines those tests start first (what makes one machine another: the RAM, the vCPUs, the
# programs masked, an egress port; not the rules judged, the variables or the rlimits).
MACHINES = (
    SandboxSpec(),  # the default limits
    SandboxSpec(rules=SandboxRules(deny=("uname",))),  # `uname` masked
    SandboxSpec(network=NetworkPolicy(allow_hosts=("pkg.test",))),  # an egress port
)

BootImages = Callable[[Path], SnapshotStore]


@pytest.fixture(scope="session")
def microvm_boot_images(tmp_path_factory: pytest.TempPathFactory) -> BootImages:
    """A function that makes a snapshot store at the path it is given, holding a copy of the
    boot image of each of ``MACHINES`` (and nothing else: no ready image, no snapshot)."""
    require_tier("microvm")
    from stockade.sandbox import microvm

    template = tmp_path_factory.mktemp("microvm-boot-images") / "store"
    backend = microvm.MicroVMBackend(
        snapshot_store=SnapshotStore(template), ready_images=False, start_ahead=False
    )
    try:
        for spec in MACHINES:
            assert backend.prepare_for(spec) == "boot image", backend._boot_failed
    finally:
        backend.close()

    def copy(root: Path) -> SnapshotStore:
        # A copy, not links: a test changes a byte of an image in place to see it refused.
        subprocess.run(["cp", "-a", "--sparse=always", str(template), str(root)], check=True)
        return SnapshotStore(root)

    return copy
