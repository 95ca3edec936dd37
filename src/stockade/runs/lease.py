"""One owner per run: a lease row in the run store, renewed while the run lives.

    lease = store.claim(run_id, new=False)     # RunLeased if another process holds it
    try: ... run ...
    finally: lease.release()

A lease names its owner (``host boot/pid namespace/pid/start time/random``) and expires
``lease_s`` after its last renewal; a thread renews it every third of that. Its process dying
ends it in one of two ways: a claim from the same machine and pid namespace sees at once that
the owner's process is gone (its pid is free or belongs to a younger process), and any claim
sees it expired once ``lease_s`` has passed. Machines sharing a run store must have clocks
that agree within a few seconds (NTP).

Every write a lease holder makes for its run (checkpoints, the ledger, calls started, the
workspace) checks in its own transaction that the lease is still its own: a process that
stalled past its lease and was replaced cannot write over its successor (``RunLeased``).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stockade import exceptions as exc

if TYPE_CHECKING:
    from stockade.runs.store import RunStore

__all__ = ["LEASE_S", "MAX_LEASE_S", "LeaseHolder", "RunLease", "owner_gone", "owner_token"]

LEASE_S = 15.0
# The longest a lease may run unrenewed: ``audit verify`` believes no lease expiring further
# ahead than this (a run shown live by one would hide its crashed call from it).
MAX_LEASE_S = 300.0


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" when there is no such process)."""
    stat = _read(f"/proc/{pid}/stat")
    # the command name (field 2) may hold spaces and parentheses: count from the last ")"
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else ""


def _machine() -> str:
    boot = _read("/proc/sys/kernel/random/boot_id") or "?"
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = "?"
    return f"{boot}/{pid_ns}"


def owner_token() -> str:
    """Who holds a lease: this process, told apart from any other now or later."""
    pid = os.getpid()
    return f"{_machine()}/{pid}/{_start_time(pid) or '?'}/{uuid.uuid4().hex[:8]}"


def owner_gone(token: str) -> bool:
    """Whether the owner is certainly dead: a process of this machine and pid namespace that
    no longer runs. Owners elsewhere are never judged here (their lease expires)."""
    boot, pid_ns, pid, started, _ = [*token.rsplit("/", 4), "", "", "", ""][:5]
    if "?" in (boot, pid_ns, started) or f"{boot}/{pid_ns}" != _machine() or not pid.isdigit():
        return False
    return _start_time(int(pid)) != started


@dataclass(frozen=True, kw_only=True)
class LeaseHolder:
    """The lease a run had before this claim: whose, and whether it was taken over."""

    owner: str
    expires_ns: int
    reason: str  # why it could be taken: "expired", "owner gone", "released"


class RunLease:
    """A held lease: renewed by a thread until ``release()``; ``lost`` once another owner has it."""

    def __init__(
        self, store: RunStore, run_id: str, owner: str, *, ttl_s: float, previous: LeaseHolder | None,
        unsaved_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.store = store
        self.run_id = run_id
        self.owner = owner
        self.ttl_s = ttl_s
        self.previous = previous  # None for a new run, or a lease nobody held
        # how long a dead predecessor ran past its last checkpoint (to its last renewal)
        self.unsaved_s = unsaved_s
        self.lost = False
        # given by ``claimed_ahead``: its holder's ``release`` leaves it held, and the leaving
        # of ``claimed_ahead`` releases it
        self.kept = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"stockade-lease-{run_id[:12]}", daemon=True)
        self._thread.start()

    @property
    def recovered(self) -> bool:
        """Whether this claim took over a run whose process died while running it."""
        return self.previous is not None and self.previous.reason != "released"

    @property
    def held(self) -> bool:
        """Whether it is still this process's: neither released nor taken over."""
        return not self._stop.is_set() and not self.lost

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.store.renew_lease(self.run_id, self.owner, self.ttl_s):
                    self.lost = True  # the next fenced write raises RunLeased
                    return
            except exc.StockadeError:
                continue  # the store is unreachable now: the writes will say so; try again

    def release(self) -> None:
        """Stop renewing and give the run up (it may be claimed at once). Idempotent; nothing
        while ``kept``."""
        if self.kept or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.store.release_lease(self.run_id, self.owner)
        self.store.forget_lease(self.run_id, self.owner)

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def wait_time(expires_ns: int, now_ns: int | None = None) -> float:
    return max(0.0, (expires_ns - (now_ns if now_ns is not None else time.time_ns())) / 1e9)
