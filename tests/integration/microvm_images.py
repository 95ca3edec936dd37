"""The microVM's boot images, built once per run and copied into the stores of the tests about
what comes after a boot image: ready images, QEMUs started ahead, a modified image refused.

Each of those tests used to build its own boot image first, in a store of its own: a cold boot
of a guest under TCG (15-20 s on a busy host) that none of them is about. Building a boot image
is tested by every microVM sandbox's first start in the run (and here); what those tests check
starts once it exists, in a store no other test shares, as before.

They are built in the session's own store (``SnapshotStore.default()``, the suite's folder),
where the run's sandboxes of the same machine start from them: the default limits' machine and
the egress port's were built there by the tests before (a guest's boot each), and are copied.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stockade import SnapshotStore
from stockade.sandbox import _rules, microvm
from stockade.sandbox._microvm_ready import copy_sparse
from stockade.sandbox.base import SandboxSpec
from stockade.types import NetworkPolicy, SandboxRules, SnapshotKind
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
def microvm_boot_images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootImages]:
    """A function that makes a snapshot store at the path it is given, holding a copy of the
    boot image of each of ``MACHINES`` (and nothing else: no ready image, no snapshot)."""
    require_tier("microvm")
    session = SnapshotStore.default()
    backend = microvm.MicroVMBackend(snapshot_store=session, ready_images=False, start_ahead=False)
    template = SnapshotStore(tmp_path_factory.mktemp("microvm-boot-images") / "store")
    try:
        for spec in MACHINES:
            assert backend.prepare_for(spec) == "boot image", backend._boot_failed
            _copy_boot_image(session, template, _boot_image_name(backend, spec))
    finally:
        backend.close()

    def copy(root: Path) -> SnapshotStore:
        # A copy, not links: a test changes a byte of an image in place to see it refused.
        subprocess.run(["cp", "-a", "--sparse=always", str(template.root), str(root)], check=True)
        return SnapshotStore(root)

    yield copy
    shutil.rmtree(template.root.parent, ignore_errors=True)  # 2 GB a session otherwise kept


def _boot_image_name(backend: microvm.MicroVMBackend, spec: SandboxSpec) -> str:
    """The name the backend keeps ``spec``'s boot image under (``MicroVMBackend._boot_image``)."""
    masks = _rules.plan(
        spec, root=backend.rootfs, can_mask=True, can_confine=True, runs=microvm.GUEST_RUNS
    ).masks
    return "microvm-" + backend._machine_key(spec, masks)[:32]


def _copy_boot_image(source: SnapshotStore, target: SnapshotStore, name: str) -> None:
    """Boot image ``name`` of ``source`` into ``target``: its objects copied (a test changes a
    byte of one in place; the session's stays as it was), its manifest and reference as built."""
    found = source.ref("boot", name)
    assert found is not None, f"no boot image {name} in {source.label}"
    manifest = source.load(found["snapshot"])
    blobs = {}
    for role, digest in manifest.blobs.items():
        copied = target.temp_path(role)
        copy_sparse(source.check_object(digest), copied)
        blobs[role] = target.add_file(copied, digest=digest)
    target.save(
        kind=SnapshotKind.MEMORY,
        tier="microvm",
        source=manifest.snapshot.source,
        spec={},
        blobs=blobs,
        tier_state=manifest.tier_state,
        ref=("boot", name),
    )
