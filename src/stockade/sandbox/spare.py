"""A pre-started spare sandbox behind ``start``: a cold start that is a hand-over.

``SpareBackend(ProcessBackend())`` starts one sandbox ahead of need for the spec it was
last asked for; ``start`` with an equal spec hands that one over and starts the next in a
background thread. The spare is a whole sandbox, started exactly as ``start`` would start
it (its own namespaces, cgroup, uid, supervisor and interpreter process to come), so every
guarantee and fresh randomness (``os.urandom``, ``random``'s seed, the hash seed, temporary
file names) come with it: nothing is forked from a warm process shared by sandboxes.

With ``warm_interpreter`` (the default) the spare's interpreter process is started too (by
running no code), so the first ``run_code`` is a warm one; its ``random`` is seeded when code
imports it, and its hash seed is its own supervisor's, as in any sandbox.

What it trades: one idle sandbox per backend (~8 MB with its interpreter, ~4 MB without, a
uid, three tmpfs mounts) while nobody asks, and the CPU to start it in the background. A
``start`` that comes before the spare is ready, or with another spec, is an ordinary cold
start: creating back to back is no faster, only a create after a pause is. Specs naming a
snapshot or a sandbox id are never served from a spare (they describe one sandbox), nor
specs with egress credentials: a spare's proxy read the secret when the spare started, and a
secret rotated meanwhile would reach the create that took it as the old one.
"""

from __future__ import annotations

from collections.abc import Callable

from stockade import _exit
from stockade.sandbox._lasting import LastingThread
from stockade.sandbox._slot import Slot
from stockade.sandbox.base import Backend, Instance, SandboxSpec
from stockade.sandbox.ops import RunCode
from stockade.types import TierReport

__all__ = ["SpareBackend", "in_background", "on_background_thread"]


def _discard(held: tuple[SandboxSpec, Instance]) -> None:
    held[1].close()


def _close(spare: Slot[tuple[SandboxSpec, Instance]]) -> None:
    """Close the spare, and the one being started (refused by the closed slot) before we
    return, unless we are the thread starting it (a job that dropped the last reference)."""
    spare.close()
    if not on_background_thread():
        spare.wait()


class SpareBackend(Backend):
    """``wrapped``, with one sandbox started ahead for the spec last asked for.

    Not a ``WrapperBackend``: what it starts is the tier's own sandbox, unwrapped."""

    def __init__(self, wrapped: Backend, *, warm_interpreter: bool = True) -> None:
        self.wrapped = wrapped
        self.tier = wrapped.tier
        self.warm_interpreter = warm_interpreter
        # Apart from the backend, so that a backend nobody holds any more can be collected,
        # and its finalizer close the spare.
        self._spare: Slot[tuple[SandboxSpec, Instance]] = Slot(_discard)
        _exit.finalize(self, _close, self._spare)  # a spare nobody takes dies with us, or at exit

    def probe(self) -> TierReport:
        return self.wrapped.probe()

    def unwalled_network(self) -> str | None:
        return self.wrapped.unwalled_network()

    def start(self, spec: SandboxSpec) -> Instance:
        if spec.snapshot is not None or spec.sandbox_id is not None or spec.network.credentials:
            return self.wrapped.start(spec)
        held = self._spare.take()
        instance: Instance | None = None
        if held is not None:
            if held[0] == spec and held[1].alive:
                instance = held[1]
            else:  # another spec asked for now, or dead: handed to nobody
                held[1].close()
        if instance is None:
            instance = self.wrapped.start(spec)
        self._refill(spec)
        return instance

    def prepare_for(self, spec: SandboxSpec) -> str:
        return self.wrapped.prepare_for(spec)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the spare being started; whether one is ready (for benchmarks and tests)."""
        return self._spare.wait(timeout)

    def close(self) -> None:
        """Close the spare and start no other. Idempotent."""
        _close(self._spare)

    def _refill(self, spec: SandboxSpec) -> None:
        spare = self._spare
        if not spare.begin():
            return
        backend, warm = self.wrapped, self.warm_interpreter  # not self: the job must not hold us
        _starter.submit(lambda: _fill(backend, spare, spec, warm))


def _fill(backend: Backend, spare: Slot[tuple[SandboxSpec, Instance]], spec: SandboxSpec, warm: bool) -> None:
    try:
        instance = backend.start(spec)
    except Exception:  # the next start is then a cold one, and says why if it fails
        spare.done()
        return
    try:
        if warm:  # its interpreter process started too: the first run_code is a warm one
            instance.execute(RunCode(code=""))
    except Exception:
        instance.close()
        spare.done()
        return
    spare.put((spec, instance))  # refused: closed by the slot


# Spares are started by one thread that lives as long as the process: a sandbox may die
# with the thread that started it (bwrap's --die-with-parent is the parent *thread*'s death
# signal), and a spare handed over outlives the backend that started it.
_starter = LastingThread("stockade-spare")


def on_background_thread() -> bool:
    """Whether this is the thread ``in_background`` runs jobs on (which must not wait for one)."""
    return _starter.current


def in_background(job: Callable[[], None]) -> None:
    """Run ``job`` on the thread that starts spares: it lives as long as the process, so what
    a job starts (a sandbox, the microVM tier's QEMU started ahead) never dies with the
    thread that asked for it."""
    _starter.submit(job)
