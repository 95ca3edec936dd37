"""Boot images, and sandboxes restored from a memory snapshot, on the microVM tier.

A part of ``MicroVMBackend``: a boot image is a guest booted once to its supervisor's hello
and saved (its RAM a file, its device state), built by one process at a time and named by
the machine key; a guest it refused is never tried again by this backend, which boots cold
instead. A memory snapshot is restored only on the machine it was taken on, then reseeded.
Taking a snapshot is the running guest's (``_microvm_instance``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from stockade import exceptions as exc
from stockade.sandbox._microvm_instance import VMInstance
from stockade.sandbox._microvm_launch import Launch, MicroVMLaunch, seal_written
from stockade.sandbox._microvm_settings import START_TIMEOUT_S
from stockade.sandbox._supervised import SupervisedInstance, enforcement_from_state
from stockade.sandbox._supervised_config import sandbox_id
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import SnapshotKind


class MicroVMSnapshots(MicroVMLaunch):
    """The boot images and restores part of ``MicroVMBackend``."""

    def _boot_image(self, spec: SandboxSpec, masks: tuple[str, ...]) -> tuple[Path, Path] | None:
        """The boot image for sandboxes shaped like ``spec`` (its RAM file and device state,
        checked), built on first use: a guest booted to its supervisor, which said hello and
        waits for its configuration. None (boot cold) if it cannot be built here."""
        key = self._machine_key(spec, masks)
        name = "microvm-" + key[:32]
        with self._lock:
            if key in self._boot_failed:
                return None
            lock = self._boot_locks.setdefault(key, threading.Lock())
        store = self.snapshot_store
        with lock:
            try:
                found = store.ref("boot", name)
                if found is None:
                    with _flock(store.temp_path(f"boot-{key[:16]}").with_name(f"boot-{key[:16]}.lock")):
                        found = store.ref("boot", name) or self._build_boot_image(spec, masks, name)
                manifest = store.load(found["snapshot"])
                blobs = manifest.blobs
                return store.check_object(blobs["ram"]), store.check_object(blobs["device"])
            except exc.SnapshotError as err:
                with self._lock:
                    self._boot_failed[key] = str(err)
                self._ahead.drop()  # it may hold what was refused
                return None

    def _build_boot_image(self, spec: SandboxSpec, masks: tuple[str, ...], name: str) -> dict[str, str]:
        store = self.snapshot_store
        ram = store.temp_path("ram")
        device = store.temp_path("device")
        # A guest of its own, never handed out: its RAM is the file, written through.
        template = dataclasses.replace(spec, envs={}, rules=None, snapshot=None, sandbox_id=None)
        sid = sandbox_id(template)
        try:
            plan = Launch(ram=ram, ram_shared=True, attach_egress=False)
            boundary, stream = self._launch(template, sid, masks, plan)
            instance = SupervisedInstance(
                id=sid,
                tier=self.tier,
                stream=stream,
                boundary=boundary,
                spec=template,
                enforcement=self._plan(spec),
            )
            try:
                header, _ = instance.channel.call({"op": "hello"}).result(time.monotonic() + START_TIMEOUT_S)
                if header.get("ev") != "hello":
                    raise exc.SnapshotError(f"the boot image's supervisor answered {header!r}")
                boundary.wait_up(START_TIMEOUT_S)
                with open(device, "wb") as out:
                    boundary.monitor().save(out, ignore_shared=True)
            finally:
                instance.close()
            blobs = {"ram": store.add_file(ram), "device": store.add_file(device)}
        except (TimeoutError, exc.SandboxError) as err:
            raise exc.SnapshotError(f"cannot build the microVM boot image: {err}") from None
        finally:
            ram.unlink(missing_ok=True)
            device.unlink(missing_ok=True)
        snapshot = store.save(
            kind=SnapshotKind.MEMORY,
            tier=self.tier,
            source=sid,
            spec={},
            blobs=blobs,
            tier_state={"boot": True},
            ref=("boot", name),
        )
        return {"snapshot": snapshot.id}

    def _restore(self, spec: SandboxSpec) -> VMInstance:
        """A sandbox from a memory snapshot: the same machine, its memory loaded, then reseeded."""
        assert spec.snapshot is not None
        store = SnapshotStore(Path(spec.snapshot.store))
        manifest = store.verify(spec.snapshot)
        state = manifest.tier_state
        masks = tuple(str(m) for m in state.get("masks") or ())
        if state.get("machine") != self._machine_key(spec, masks):
            raise exc.SnapshotIncompatible(
                f"snapshot {spec.snapshot.id} was taken with another kernel, kernel command line, initramfs, "
                "root image, QEMU or machine than this host has now: its memory cannot be restored"
            )
        enforcement = enforcement_from_state(dict(state.get("enforcement") or {}))
        # this host's statement, not the snapshot's (one taken before it was kept has none)
        enforcement = dataclasses.replace(enforcement, timeout_margin_s=self._timeout_margin())
        sid = sandbox_id(spec)
        memory = store.check_object(manifest.blobs["memory"])
        fd = os.open(memory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            boundary, stream = self._launch(spec, sid, masks, Launch(incoming=True, fds=(fd,)))
            instance = self._instance(
                sid, spec=spec, enforcement=enforcement, boundary=boundary, stream=stream, masks=masks
            )
            instance.started_from = "memory snapshot"
            try:
                boundary.monitor().load(fd)
                boundary.reseed()
                seal_written(boundary, spec)
                instance.reseed()  # the kernel's generator is new; the interpreter's are the snapshot's
            except BaseException:
                instance.close()
                raise
        finally:
            os.close(fd)
        return instance


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """One process at a time builds a boot image (another waits, then finds it built)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
