"""The life of a supervised sandbox: its channel and boundary, who owns it (a forked child
does not), whether it is still of use, and its end.

The base of ``SupervisedInstance`` (``_supervised``): every other part of it (the calls,
snapshots, the dispatch) checks here first, and a sandbox nobody closed is torn down here.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox._boundary import Boundary
from stockade.sandbox._channel import Channel, Stream
from stockade.sandbox._transfers import FILE_OP_TIMEOUT_S, MAX_FRAME, FileRequests
from stockade.sandbox.base import Instance, SandboxSpec
from stockade.types import Enforcement

__all__ = ["SupervisedLife"]


class SupervisedLife(Instance):
    """A sandbox's channel, boundary and owner (see ``SupervisedInstance``)."""

    def __init__(
        self,
        *,
        id: str,
        tier: str,
        stream: Stream,
        boundary: Boundary,
        spec: SandboxSpec,
        enforcement: Enforcement,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self.id = id
        self.tier = tier
        self.spec = spec
        self.rules = spec.rules
        self.enforcement = enforcement
        self.boundary = boundary
        self.channel = Channel(stream, max_body=max_frame, name=id, on_stall=boundary.kill)
        self.files = FileRequests(self.channel, close=self.close, alive=lambda: self.alive)
        self._closed = False
        # Calls in flight, and whether a snapshot holds new ones back until it is taken.
        self._gate = threading.Condition()
        self._active = 0
        self._frozen = False
        # A forked child inherits this object, not the sandbox: its calls would write into the
        # parent's channel (whose reader is the parent's) and its close would kill the parent's.
        self._owner = os.getpid()
        # A sandbox nobody closed dies with its last reference, or at interpreter exit (its
        # owner's: a forked child's exit leaves it alone).
        self._finalizer = _exit.finalize(self, _tear_down, self.channel, boundary)

    @property
    def alive(self) -> bool:
        return not self._closed and self.channel.open and self._owner == os.getpid() and self.boundary.alive()

    def close(self) -> None:
        if self._closed or self._owner != os.getpid():  # a forked child's: the parent's to close
            return
        self._closed = True
        self._finalizer()

    def cut_running(self) -> None:
        if self._closed or self._owner != os.getpid() or self.channel.cut is not None:
            return
        # beside the op it cuts: the channel sends and answers calls from any thread
        with contextlib.suppress(TimeoutError, exc.StockadeError):
            self.channel.call({"op": "cut"}).result(time.monotonic() + FILE_OP_TIMEOUT_S)

    def _check_owner(self) -> None:
        if self._owner != os.getpid():
            raise exc.SandboxClosed(
                f"sandbox {self.id} belongs to process {self._owner} (this one's parent before a fork): "
                "a forked child can neither use nor close it; create a sandbox in the child"
            )

    def _check_open(self) -> None:
        self._check_owner()
        cut = self.channel.cut
        if cut is not None:  # a call of ours was interrupted mid-send: the sandbox is no more use
            self.close()
            raise exc.SandboxClosed(f"sandbox {self.id} is closed: {cut}; create a new one")
        if self._closed:
            raise exc.SandboxClosed(f"sandbox {self.id} is closed")

    def _check_egress(self) -> None:
        """A sandbox whose egress port was cut for breaking its protocol runs nothing more: only
        a supervisor that is no longer ours (guest root) sends such frames, and a reset would
        ask that same supervisor to make the sandbox fresh for its next user."""
        egress = self.boundary.egress
        why = egress.violation if egress is not None else None
        if why is not None:
            self.close()
            raise exc.SandboxCrashed(
                f"sandbox {self.id} sent on its egress port what its supervisor never sends ({why}): "
                "the host closed it; create a new one",
                cause="protocol",
            )


def _tear_down(channel: Channel, boundary: Boundary) -> None:
    channel.close()
    boundary.kill()
