"""The run store's leases: who may write a run now, and the runs whose owner is gone.

``LeaseKeeper`` remembers the leases this process holds (run id -> owner token) and fences
every write made for such a run: the write happens, in its own transaction, only while the
lease row still names this process (``RunLeased`` otherwise). A run written without a lease
(a plain checkpointer's use) is not fenced. See ``lease`` for the lease itself, its owner
token and the thread that renews it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

from stockade import exceptions as exc
from stockade.agent.state import RunStatus
from stockade.runs._db import Database, Requirement, Statement
from stockade.runs._mac import RowMac, select
from stockade.runs._schema import SIGNED, as_int
from stockade.runs.lease import MAX_LEASE_S, LeaseHolder, owner_gone, owner_token, wait_time

__all__ = ["STALE_WHY", "LeaseKeeper", "held"]

# How far apart the clocks of machines sharing a run store may be (``lease``: NTP).
CLOCK_SKEW_S = 5.0

# The error of a run marked ``interrupted`` because its process stopped.
STALE_WHY = (
    "the process running it stopped (its lease in the run store expired); "
    "resume it: stockade agent --resume RUN_ID"
)


class LeaseKeeper:
    """The ``<namespace>_leases`` table, and the leases of it this process holds."""

    def __init__(self, db: Database, ns: str, mac: RowMac) -> None:
        self.db = db
        self.ns = ns
        self.mac = mac  # a swept run's row is signed again (only where it was the store's own)
        self._lock = threading.Lock()
        self._held: dict[str, str] = {}  # run id -> our owner token, while we hold its lease

    def fence(self, run_id: str) -> Requirement | None:
        owner = self._held.get(run_id)
        if owner is None:
            return None  # no lease taken here (a plain checkpointer's use): nothing to check
        return (f"SELECT 1 FROM {self.ns}_leases WHERE run_id = ? AND owner = ?", (run_id, owner))

    def write(self, run_id: str, statements: Sequence[Statement]) -> None:
        """One transaction for ``run_id``, only while this process still holds its lease."""
        if not self.db.write(statements, require=self.fence(run_id)):
            raise exc.RunLeased(
                f"run {run_id} is no longer this process's: its lease expired and another process "
                "took the run over; this process must stop running it"
            )

    def take(
        self,
        run_id: str,
        *,
        new: bool,
        lease_s: float,
        wait_s: float,
        check: Callable[[], None] | None = None,
    ) -> tuple[str, LeaseHolder | None]:
        """Take the run's lease for this process: the owner token, and whose lease it was.

        A live lease of another process: wait up to ``wait_s``, then ``RunLeased`` (for a
        ``new`` run at once ``RunConflict``). ``check`` runs before each look at the lease
        (it raises when the run may not be claimed)."""
        ns = self.ns
        owner = owner_token()
        deadline = time.monotonic() + wait_s
        while True:
            now = time.time_ns()
            if check is not None:
                check()
            rows = self.db.query(f"SELECT owner, expires_ns FROM {ns}_leases WHERE run_id = ?", (run_id,))
            previous: LeaseHolder | None = None
            take: Statement
            if rows:
                held_by, expires = str(rows[0][0]), as_int(rows[0][1])
                if expires == 0:
                    reason = "released"
                elif expires < now:
                    reason = "expired"
                elif owner_gone(held_by):
                    reason = "owner gone"
                else:
                    if new:
                        raise exc.RunConflict(f"another process is starting a run {run_id!r}")
                    if time.monotonic() < deadline:
                        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                        continue
                    raise exc.RunLeased(
                        f"run {run_id} is running in another process ({_where_owner(held_by)}); "
                        f"its lease runs {wait_time(expires, now):.1f} s more unless renewed: wait for "
                        "it to stop, or stop it (stockade kill)",
                        retry_after=wait_time(expires, now),
                    )
                previous = LeaseHolder(owner=held_by, expires_ns=expires, reason=reason)
                until = now + round(lease_s * 1e9)
                take = (
                    f"UPDATE {ns}_leases SET owner = ?, expires_ns = ?, acquired_ns = ?, mac = ? "
                    "WHERE run_id = ? AND owner = ? AND expires_ns = ?",
                    [(owner, until, now, self._sign(run_id, owner, until), run_id, held_by, expires)],
                )
            else:
                until = now + round(lease_s * 1e9)
                take = (
                    f"INSERT INTO {ns}_leases (run_id, owner, expires_ns, acquired_ns, mac) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id) DO NOTHING",
                    [(run_id, owner, until, now, self._sign(run_id, owner, until))],
                )
            self.db.write([take])
            got = self.db.query(f"SELECT owner FROM {ns}_leases WHERE run_id = ?", (run_id,))
            if got and str(got[0][0]) == owner:
                break
            if new:
                raise exc.RunConflict(f"another process has just started a run {run_id!r}")
            # another claim won the race: look again (it holds the lease now)
        with self._lock:
            self._held[run_id] = owner
        return owner, previous

    def renew(self, run_id: str, owner: str, ttl_s: float) -> bool:
        """Push the lease's end ``ttl_s`` ahead; False when it is no longer ``owner``'s."""
        expires = time.time_ns() + round(ttl_s * 1e9)
        return self.db.write(
            [
                (
                    f"UPDATE {self.ns}_leases SET expires_ns = ?, mac = ? WHERE run_id = ? AND owner = ?",
                    [(expires, self._sign(run_id, owner, expires), run_id, owner)],
                )
            ],
            require=(f"SELECT 1 FROM {self.ns}_leases WHERE run_id = ? AND owner = ?", (run_id, owner)),
        )

    def release(self, run_id: str, owner: str) -> None:
        self.db.write(
            [
                (
                    f"UPDATE {self.ns}_leases SET expires_ns = 0, mac = ? WHERE run_id = ? AND owner = ?",
                    [(self._sign(run_id, owner, 0), run_id, owner)],
                )
            ]
        )

    def _sign(self, run_id: str, owner: str, expires_ns: int) -> str | None:
        return self.mac.sign("leases", (run_id, owner, expires_ns))

    def live(self, run_ids: Collection[str]) -> set[str]:
        """Those of ``run_ids`` a live process holds the lease of now, as ``audit verify``
        takes it: a lease row the store signed (when it has the key), not released, expiring
        in the future but no further than ``MAX_LEASE_S`` (and a few seconds of clock skew)
        ahead, of an owner not known to be gone. A run whose lease row is missing is not live."""
        wanted, now, live = sorted(set(run_ids)), time.time_ns(), set[str]()
        for at in range(0, len(wanted), 500):  # bound the statement's parameters
            chunk = wanted[at : at + 500]
            rows = self.db.query(
                f"{select(self.ns, 'leases')} WHERE run_id IN ({', '.join('?' * len(chunk))})", chunk
            )
            for row in rows:
                if self.mac.unauthentic(self.ns, "leases", row) is None and held(row, now):
                    live.add(str(row[0]))
        return live

    def forget(self, run_id: str, owner: str) -> None:
        with self._lock:
            if self._held.get(run_id) == owner:
                del self._held[run_id]

    def stale(self) -> list[str]:
        """The runs still ``running`` whose lease expired or whose process is gone (``sweep``
        marks them; a reader shows them so, writing nothing)."""
        ns, now = self.ns, time.time_ns()
        rows = self.db.query(
            f"SELECT l.run_id, l.owner, l.expires_ns FROM {ns}_leases l JOIN {ns}_runs r "
            "ON r.run_id = l.run_id WHERE r.status = ?",
            (RunStatus.RUNNING.value,),
        )
        return [str(r[0]) for r in rows if as_int(r[2]) < now or owner_gone(str(r[1]))]

    def sweep(self) -> list[str]:
        """Mark ``interrupted`` the ``stale`` runs; returns their ids."""
        stale = self.stale()
        if not stale:
            return stale
        columns = SIGNED["runs"][0]
        status, error, updated = (columns.index(c) for c in ("status", "error", "updated_ns"))
        marks = ", ".join("?" * len(stale))
        rows = self.db.query(f"{select(self.ns, 'runs')} WHERE run_id IN ({marks})", stale)
        swept = []
        for row in rows:
            *fields, mac = row
            authentic = self.mac.unauthentic(self.ns, "runs", row) is None
            fields[status], fields[error] = RunStatus.INTERRUPTED.value, STALE_WHY
            if authentic:
                mac = self.mac.sign("runs", fields)
            # else its MAC stays as wrong as it was: signing it now would vouch for the edit
            swept.append((fields[status], STALE_WHY, mac, row[0], RunStatus.RUNNING.value, row[updated]))
        self.db.write(
            [
                (
                    f"UPDATE {self.ns}_runs SET status = ?, error = ?, mac = ? "
                    "WHERE run_id = ? AND status = ? AND updated_ns = ?",
                    swept,
                )
            ]
        )
        return stale


def live_expiry(db: Database, ns: str, run_id: str, now_ns: int) -> int | None:
    """When the run's live lease expires; None when it has none (never claimed, released,
    expired, or its owner's process is gone from this machine)."""
    rows = db.query(f"SELECT owner, expires_ns FROM {ns}_leases WHERE run_id = ?", (run_id,))
    if not rows:
        return None
    owner, expires_ns = str(rows[0][0]), as_int(rows[0][1])
    return expires_ns if expires_ns > now_ns and not owner_gone(owner) else None


def held(lease: Sequence[object], now_ns: int) -> bool:
    """Whether a lease row (``run_id, owner, expires_ns, ...``) is held by a live process:
    expiring in the future, no further ahead than a lease may run (``MAX_LEASE_S``, and the
    clocks' skew), of an owner not known to be gone."""
    expires = as_int(lease[2])
    horizon = now_ns + round((MAX_LEASE_S + CLOCK_SKEW_S) * 1e9)
    return now_ns < expires <= horizon and not owner_gone(str(lease[1]))


def _where_owner(owner: str) -> str:
    parts = owner.split("/")
    return f"pid {parts[2]}" if len(parts) == 5 else "unknown owner"
