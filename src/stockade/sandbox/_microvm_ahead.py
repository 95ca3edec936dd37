"""The microVM tier's QEMU started ahead: one QEMU per backend, started in the background on
the image the last sandbox started from (a boot image or a ready image), its state loaded and
its guest stopped where the image was taken, never run. The next sandbox of that shape takes
it: its guest runs for the first time then, reseeded first, as a guest started at create.

What it trades: one idle QEMU per backend (its own memory, not the guest's RAM, which is the
image's file until written) and its start (~40 ms of CPU) in the background after each start,
for the time QEMU takes to start and load the image's state (~60 ms on 2 cores).

Apart from ``microvm.py``, which plans and starts guests, because this is what is held
between starts, and must end with the backend (its finalizer closes it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stockade.sandbox._microvm_instance import SocketStream, VMBoundary
from stockade.sandbox._slot import Slot
from stockade.sandbox._supervised_config import sandbox_id
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.spare import in_background, on_background_thread

__all__ = ["GuestOrder", "Launcher", "StartedAhead", "Waiting", "files_identity"]

# How the backend starts QEMU on an image: (spec, sandbox id, masks, RAM file, device state's
# fd) -> the boundary and the stream, QEMU waiting for the state to load.
Launcher = Callable[[SandboxSpec, str, tuple[str, ...], Path, int], tuple[VMBoundary, SocketStream]]


@dataclass(frozen=True)
class GuestOrder:
    """A guest to start on an image: how (``launch``), for which sandbox's ``spec``, with which
    ``masks``, on which ``image`` (RAM file, device state); ``shape`` says which QEMU started
    ahead serves it."""

    launch: Launcher
    spec: SandboxSpec
    masks: tuple[str, ...]
    image: tuple[Path, Path]
    shape: tuple[str, ...]


@dataclass(frozen=True)
class Waiting:
    """A QEMU holding an image's state, its guest stopped and never run since the image
    was taken: no sandbox's yet (no reseed, no configuration); ``files``: the identities of
    the image's RAM file and device state when QEMU opened them."""

    sid: str
    boundary: VMBoundary
    stream: SocketStream
    files: tuple[tuple[int, ...], ...]

    def alive(self) -> bool:
        return self.boundary.alive()

    def discard(self) -> None:
        self.boundary.kill()


def _discard(held: tuple[tuple[str, ...], Waiting]) -> None:
    held[1].discard()


class StartedAhead:
    """The QEMU started ahead (at most one, for the shape last asked for; ``shape`` says
    which image and machine it holds). ``enabled``: False, every start starts its own."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.slot: Slot[tuple[tuple[str, ...], Waiting]] = Slot(_discard)

    def waiting_guest(self, order: GuestOrder) -> Waiting:
        """A QEMU holding the order's image's state, its guest not yet run: the one started ahead for
        this shape when there is one (and the image is still the one it loaded), else one
        started now. Then the next is started ahead, in the background."""
        waiting = None
        if self.enabled and order.spec.sandbox_id is None:  # a sandbox named by the caller is started for it
            held = self.slot.take()
            if held is not None and held[0] == order.shape:
                waiting = held[1]
            elif held is not None:  # another shape is asked for now
                held[1].discard()
            if waiting is not None and not (waiting.files == files_identity(order.image) and waiting.alive()):
                waiting.discard()  # the image changed (or was replaced) since, or QEMU died
                waiting = None
        if waiting is None:
            waiting = start_waiting(order)
        self._start_next(order)
        return waiting

    def start_for(self, order: GuestOrder, *, timeout_s: float) -> None:
        """Have the QEMU held ahead be one of the order's shape (a configuration just prepared, whose
        first start then takes it), started in the background unless one is held; one of
        another shape is stopped (after waiting up to ``timeout_s`` for one being started)."""
        if not self.enabled:
            return
        self.slot.wait(timeout_s)
        held = self.slot.peek()
        if held is not None and held[0] == order.shape:
            return
        self.slot.drop()
        self._start_next(order)

    def _start_next(self, order: GuestOrder) -> None:
        if self.enabled and self.slot.begin():
            neutral = dataclasses.replace(order.spec, envs={}, rules=None, snapshot=None, sandbox_id=None)
            ahead = dataclasses.replace(order, spec=neutral)
            slot = self.slot  # not self: the job holds what it needs only
            in_background(lambda: _fill(slot, ahead))

    def wait(self, timeout_s: float) -> str | None:
        """Wait for the QEMU being started ahead; the id of the sandbox it will be, or None."""
        held = self.slot.peek() if self.slot.wait(timeout_s) else None
        return None if held is None else held[1].sid

    def drop(self) -> None:
        """Stop the one held (its image was refused, say)."""
        self.slot.drop()

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the one held, and start no other; with ``wait_s``, wait that long for one
        being started to be stopped too (not on the thread that starts them). Idempotent."""
        self.slot.close()
        if wait_s > 0 and not on_background_thread():
            self.slot.wait(wait_s)


def start_waiting(order: GuestOrder) -> Waiting:
    """Start QEMU for the order's sandbox on its image: its RAM the image's file, mapped copy
    on write; its device state loaded; its guest stopped where the image was taken."""
    ram, device = order.image
    sid = sandbox_id(order.spec)
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # Before QEMU opens them: a write, or another file at either path, changes these.
        files = files_identity(order.image)
        boundary, stream = order.launch(order.spec, sid, order.masks, ram, fd)
        try:
            boundary.monitor().load(fd, ignore_shared=True, run=False)
        except BaseException:
            boundary.kill()
            raise
    finally:
        os.close(fd)
    return Waiting(sid=sid, boundary=boundary, stream=stream, files=files)


def _fill(slot: Slot[tuple[tuple[str, ...], Waiting]], order: GuestOrder) -> None:
    try:
        waiting = start_waiting(order)
    except BaseException:  # the next start starts its own QEMU, and says why if that fails
        slot.done()
        raise
    slot.put((order.shape, waiting))  # refused: discarded by the slot


def files_identity(paths: tuple[Path, ...]) -> tuple[tuple[int, ...], ...]:
    """Which files ``paths`` are, and their state: device, inode, size, modification and
    change times (any write changes the change time, which only the clock can set back)."""
    out: list[tuple[int, ...]] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            out.append(())
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)
