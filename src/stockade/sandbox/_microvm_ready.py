"""The microVM tier's ready images: a boot image configured as a sandbox is (its limits, its
rules), its interpreter started, kept in the snapshot store. Built in the background after a
first start of that configuration; the next sandboxes of that configuration start from it:
no handshake, no interpreter start, only the guest's reseed and what differs per sandbox.

An image is kept on disk and shared by every sandbox of its configuration, so it holds only
configuration: nothing of a caller's. The caller's variables (a variable may be a secret) are
never in an image: it is made without them, and a sandbox started from it hands them to its
guest after the resume (``resume_args``), with its egress relay, as a cold start's
configuration would have: the shell, the interpreter (``os.environ``) and their children see
them as there. Rules are configuration: the image holds them, configured (see ``name`` for
what makes two images differ).

Apart from ``microvm.py``, which plans and starts guests, because building and choosing
images is its own concern, done between starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stockade import exceptions as exc
from stockade.sandbox._rules import RulesPlan
from stockade.sandbox._supervised import enforcement_state
from stockade.sandbox._supervised_config import sandbox_id
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.ops import RunCode
from stockade.sandbox.snapshots import SnapshotStore
from stockade.sandbox.spare import in_background
from stockade.types import Enforcement, SnapshotKind

if TYPE_CHECKING:
    from stockade.sandbox.microvm import MicroVMBackend

__all__ = ["LATE", "ReadyBuild", "ReadyImage", "ReadyImages", "image_config", "resume_args"]

MiB = 1024 * 1024
REF = "boot"  # the store's references: boot images and ready images, by name
PREFIX = "microvm-ready-"


@dataclass(frozen=True)
class ReadyImage:
    """One ready image, checked: its RAM file, its device state, and what its supervisor
    said of the rules (each sandbox holds them against it, as at a handshake)."""

    ram: Path
    device: Path
    rules_report: dict[str, Any] | None


@dataclass(frozen=True)
class ReadyBuild:
    """What building one ready image takes: the sandbox it is made as (nothing of the
    caller's: see ``of``), its rules, its configuration frame as the image holds it
    (``image_config``), the boot image it is made from, its name, and each step's bound."""

    spec: SandboxSpec
    rules: RulesPlan
    config: dict[str, Any]
    boot: tuple[Path, Path]
    name: str
    timeout_s: float

    @classmethod
    def of(
        cls,
        spec: SandboxSpec,
        *,
        rules: RulesPlan,
        config: dict[str, Any],
        boot: tuple[Path, Path],
        name: str,
        timeout_s: float,
    ) -> ReadyBuild:
        # Nothing of the caller's: no variables, labels, approver (it answers for one sandbox),
        # observer; the image's guest gets the rules' configuration all the same.
        template = dataclasses.replace(
            spec, envs={}, labels={}, approver=None, egress_observer=None, snapshot=None, sandbox_id=None
        )
        return cls(template, rules, config, boot, name, timeout_s)


# What of the configuration frame the supervisor only reads when it serves a request (the
# default timeout, the output cap): sent with the reseed, never part of an image, so sandboxes
# that differ only there share one.
LATE = ("timeout", "output_cap")


def image_config(config: dict[str, Any], base_env: dict[str, str]) -> dict[str, Any]:
    """What of a sandbox's configuration frame goes into its image: all of it but the egress
    relay (the sandbox's own proxy) and the ``LATE`` settings, and its environment as it is
    without the caller's variables and the proxy's (``base_env``)."""
    kept = {k: v for k, v in config.items() if k != "egress" and k not in LATE}
    kept["env"] = dict(base_env)
    return kept


def resume_args(config: dict[str, Any], image: dict[str, Any]) -> dict[str, Any]:
    """What a sandbox started from an image made with ``image`` sends its guest after the
    resume, to be configured by ``config``: its environment where it differs, its relay, its
    ``LATE`` settings."""
    args: dict[str, Any] = {k: config[k] for k in LATE if k in config}
    if config["env"] != image["env"]:
        args["env"] = config["env"]
    if "egress" in config:
        args["egress"] = config["egress"]
    return args


class ReadyImages:
    """Which ready images this backend has built, is building, or refused."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._building: dict[str, threading.Event] = {}  # name -> set when its build ends
        self.refused: dict[str, str] = {}  # name -> why (never used again by this backend)

    def serves(self, spec: SandboxSpec) -> bool:
        """Whether sandboxes like ``spec`` start from a ready image: a fresh sandbox (no
        snapshot to seed, no id to resume under)."""
        return self.enabled and spec.snapshot is None and spec.sandbox_id is None

    @property
    def building(self) -> bool:
        with self._lock:
            return bool(self._building)

    @staticmethod
    def name(machine_key: str, config: dict[str, Any], rules: RulesPlan, planned: Enforcement) -> str:
        """Everything that makes two guests differ: the machine (kernel, images, QEMU, RAM,
        vCPUs, the command line with the masks of the denied programs), the configuration
        frame as the image holds it (limits, caps, rlimits, the rules as the supervisor
        gets them: the judge's patterns, the write paths, whether an approver is asked), and
        what the host enforces (weakened settings included)."""
        parts = (
            machine_key,
            json.dumps(config, sort_keys=True),
            json.dumps(rules.config, sort_keys=True),
            json.dumps(enforcement_state(planned), sort_keys=True, default=str),
        )
        return PREFIX + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]

    def find(self, store: SnapshotStore, name: str, *, refused: Callable[[], None]) -> ReadyImage | None:
        """The ready image ``name``, checked, if one was built: None otherwise, or when it is
        refused (then never used again by this backend, and ``refused`` is called)."""
        with self._lock:
            if name in self.refused:
                return None
        try:
            found = store.ref(REF, name)
            if found is None:
                return None
            manifest = store.load(found["snapshot"])
            blobs = manifest.blobs
            ram, device = store.check_object(blobs["ram"]), store.check_object(blobs["device"])
            report = manifest.tier_state.get("rules")
        except (exc.SnapshotError, KeyError) as err:
            self.refuse(name, str(err))
            refused()
            return None
        return ReadyImage(ram, device, dict(report) if isinstance(report, dict) else None)

    def refuse(self, name: str, why: str) -> None:
        with self._lock:
            self.refused[name] = why

    def build_soon(self, backend: MicroVMBackend, build: ReadyBuild) -> None:
        """Build ready image ``build.name`` in the background, unless built, being built or
        refused."""
        if self._claim(build.name):
            in_background(lambda: self._build(backend, build))

    def build_now(self, backend: MicroVMBackend, build: ReadyBuild) -> None:
        """Build ready image ``build.name`` in this thread, or wait for the build under way
        (``MicroVMBackend.prepare_for``: an operator's or a pool's start pays the boot ahead)."""
        if self._claim(build.name):
            self._build(backend, build)
            return
        with self._lock:
            done = self._building.get(build.name)
        if done is not None:
            done.wait(build.timeout_s * 2)  # a build is a start and a save, each bounded

    def _claim(self, name: str) -> bool:
        with self._lock:
            if name in self._building or name in self.refused:
                return False
            self._building[name] = threading.Event()
            return True

    def _build(self, backend: MicroVMBackend, build: ReadyBuild) -> None:
        """A guest of its own, from the boot image (its RAM a copy of the image's, written
        through), configured with ``build.config`` and its interpreter started by running
        nothing, then stopped and its device state saved: the ready image ``build.name``.
        Never handed out."""
        store, spec, rules, boot = backend.snapshot_store, build.spec, build.rules, build.boot
        ram, device = store.temp_path("ram"), store.temp_path("device")
        try:
            if store.ref(REF, build.name) is not None:
                return
            copy_sparse(boot[0], ram)
            sid = sandbox_id(spec)
            fd = os.open(boot[1], os.O_RDONLY | os.O_CLOEXEC)
            try:
                boundary, stream = backend._launch_on_image(spec, sid, rules.masks, ram, fd, build=True)
                instance = backend._instance(
                    sid, spec=spec, enforcement=backend._plan(spec), boundary=boundary, stream=stream,
                    masks=rules.masks,
                )  # fmt: skip
                try:
                    boundary.monitor().load(fd, ignore_shared=True)
                    boundary.reseed()
                    # The rules as the supervisor gets them; what it says of them is kept, and
                    # each sandbox holds its own spec against it (``allow_weaker`` is its own).
                    config = build.config
                    frame = config if rules.config is None else {**config, "rules": rules.config}
                    header = instance.handshake(frame, build.timeout_s)
                    instance.execute(RunCode(code=""))  # its interpreter process started
                    with open(device, "wb") as out:
                        boundary.monitor().save(out, ignore_shared=True)
                finally:
                    instance.close()
            finally:
                os.close(fd)
            blobs = {"ram": store.add_file(ram), "device": store.add_file(device)}
            report = header.get("rules") if isinstance(header.get("rules"), dict) else None
            store.save(
                kind=SnapshotKind.MEMORY, tier=backend.tier, source=sid, spec={}, blobs=blobs,
                tier_state={"boot": True, "ready": True, "rules": report},
                ref=(REF, build.name),
            )  # fmt: skip
        except (exc.StockadeError, OSError, TimeoutError) as err:
            self.refuse(build.name, str(err))  # sandboxes of this configuration start as before
        finally:
            ram.unlink(missing_ok=True)
            device.unlink(missing_ok=True)
            with self._lock:
                done = self._building.pop(build.name, None)
            if done is not None:
                done.set()


def copy_sparse(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` (a new file, 0600), writing only its data: a guest's RAM
    file is mostly holes (pages the guest never touched), which stay holes."""
    with open(source, "rb") as src:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(src.fileno()).st_size
            os.ftruncate(fd, size)
            offset = 0
            while offset < size:
                try:
                    start = os.lseek(src.fileno(), offset, os.SEEK_DATA)
                except OSError:  # no data past offset
                    break
                end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
                while start < end:
                    copied = os.copy_file_range(src.fileno(), fd, min(end - start, 64 * MiB), start, start)
                    if copied <= 0:
                        raise OSError(f"cannot copy {source}: it ended early")
                    start += copied
                offset = end
        finally:
            os.close(fd)
