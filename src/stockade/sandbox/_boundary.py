"""``Boundary``: what a tier provides around the supervisor (how to kill the whole sandbox,
and what it can tell of its death). Everything inside it is ``SupervisedInstance``'s."""

from __future__ import annotations

import abc
import threading
from typing import Any

__all__ = ["Boundary"]

# Guards only the flip of a boundary's ``_dead`` flag, never a kill itself: one for all is enough.
_KILLING = threading.Lock()


class Boundary(abc.ABC):
    """What a tier provides around the supervisor."""

    _dead = False  # set by the first kill()
    # The sandbox's egress proxy (stockade.egress), when it has one: closed first on kill,
    # so its connections and credentials are gone before anything else is torn down.
    egress: Any = None

    def kill(self) -> None:
        """Kill every process of the sandbox, now. Idempotent: ``_kill`` runs once, in the
        first caller's thread (close, the finalizer and a timed-out call may race here)."""
        with _KILLING:
            if self._dead:
                return
            self._dead = True
        if self.egress is not None:
            self.egress.close()
        self._kill()

    @abc.abstractmethod
    def _kill(self) -> None:
        """Kill every process of the sandbox and release what the tier holds for it."""

    def oom_kills(self) -> int | None:
        """How many processes the sandbox's memory limit has killed so far, if known."""
        return None

    def alive(self) -> bool:
        return True

    def death_cause(self) -> str:
        """Why the sandbox is gone, when the tier can tell (a ``SandboxCrashed`` cause)."""
        return "unknown"
