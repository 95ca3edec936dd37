"""``Boundary``: what a tier provides around the supervisor (how to kill the whole sandbox,
and what it can tell of its death). Everything inside it is ``SupervisedInstance``'s."""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["Boundary", "EgressHandle"]

# Guards only the flip of a boundary's ``_dead`` flag, never a kill itself: one for all is enough.
_KILLING = threading.Lock()


class EgressHandle(Protocol):
    """What a boundary needs of its sandbox's egress proxy (``stockade.egress.Attachment``).

    Stated here, on the boundary's side, because ``stockade.egress`` is imported only when a
    sandbox has an allowlist (its parser is an extra): the tiers depend on these, not on the
    proxy."""

    @property
    def env(self) -> Mapping[str, str]:
        """The variables that point the sandbox's programs at the proxy and its trust bundle."""
        ...

    @property
    def relay(self) -> Mapping[str, Any]:
        """The supervisor's relay configuration (the ``egress`` of its ``init`` frame)."""
        ...

    @property
    def preload(self) -> str | None:
        """The connect shortcut's path in the sandbox, preloaded into its programs (gVisor)."""
        ...

    @property
    def violation(self) -> str | None:
        """Why the sandbox's end of a byte-stream way out (the microVM's egress port) was cut:
        it sent what no honest supervisor sends. None while it keeps to the protocol."""
        ...

    def renew(self) -> None:
        """For the sandbox's next user (a reset): the last user's connections and requests
        in flight cut, the connections kept to servers closed, the budgets afresh, the
        credentials read again (raises when one cannot be: the sandbox is not handed on)."""
        ...

    def close(self) -> None:
        """End the proxy now: its connections cut, its credentials dropped. Idempotent."""
        ...


class Boundary(abc.ABC):
    """What a tier provides around the supervisor."""

    _dead = False  # set by the first kill()
    _killing = False  # a kill under way, or done: a kill cut short clears it, to be run again
    # The sandbox's egress proxy (stockade.egress), when it has one: closed first on kill,
    # so its connections and credentials are gone before anything else is torn down.
    egress: EgressHandle | None = None

    def kill(self) -> None:
        """Kill every process of the sandbox, now. Idempotent: ``_kill`` runs once, in the
        first caller's thread (close, the finalizer and a timed-out call may race here). One
        that raised (a Ctrl-C mid-removal) runs again at the next kill: ``_kill`` may run twice."""
        with _KILLING:
            if self._killing:
                return
            self._dead = self._killing = True
        try:
            if self.egress is not None:
                self.egress.close()
            self._kill()
        except BaseException:
            with _KILLING:
                self._killing = False
            raise

    @abc.abstractmethod
    def _kill(self) -> None:
        """Kill every process of the sandbox and release what the tier holds for it."""

    def oom_kills(self) -> int | None:
        """How many processes the sandbox's memory limit has killed so far, if known."""
        return None

    def lock_kills(self) -> int:
        """How many processes the host killed so far for holding more file locks than a
        sandbox may (``_locks``)."""
        return 0

    def alive(self) -> bool:
        return True

    def death_cause(self) -> str:
        """Why the sandbox is gone, when the tier can tell (a ``SandboxCrashed`` cause)."""
        return "unknown"

    def last_words(self) -> str:
        """What the sandbox's own kernel said last, where the tier keeps it (a microVM's
        console: a panic, an OOM kill), for a death no cause explains; empty elsewhere."""
        return ""
