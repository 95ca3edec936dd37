"""When a run nobody holds is sent to a worker again: ``svc_wakes``, a timer in the database.

On Celery, a run that must wait (its tenant's window or quota is full, the store failed for a
moment, another process holds it) used to go back as a countdown message, which the worker
that received it holds, unacknowledged, until its time: a worker SIGKILLed meanwhile left the
run ``queued`` until the broker's visibility timeout (an hour by default). And a run whose
worker died mid-run waited as long for its message to come back. Now the time is a row here,
and every worker and API process runs a ``Waker`` that sends the runs whose time has come:

- a waiting run (``queued``) writes the time it goes again (``Wakes.set``), and its task
  ends (acknowledged): nothing of it is held by a process that can die;
- a run that starts (``running``) gets a wake ``START_GRACE_S`` on (written with its status);
  a waker that finds its lease live moves it past the lease's expiry, one that finds none
  (the process died: seen at once on the same machine, else once its lease expired) sends it
  again, and the worker that takes it resumes it where it stopped (a copy that no worker has
  taken is sent once more only ``RESEND_S`` on, as a waiting run's);
- a run that pauses or ends loses its row; one sent on from paused or broken (a decision,
  POST /resume) gets it back (``RESEND_S`` on) with its ``queued`` status, so that a send that
  fails or never comes (its process died) leaves it to a waker, not queued for ever;
- a run is created with its wake (``RESEND_S`` on): a process that died between recording
  the run and sending it leaves it to a waker, not queued for ever; a send that fails (the
  broker away) brings its wake to ``SEND_RETRY_S`` on.

A run is given again only so often: a delivery that finds it ``running`` and no process
holding it (its worker died) counts a failed attempt, as a retryable error does
(``svc_tries``); at ``ServiceConfig.max_attempts`` (``MAX_ATTEMPTS``, the embedded
executor's cap too) it ends "error", "gave up after N attempts", in its tenant's trail.

A row is sent by the waker whose move of its time commits (one transaction that finds it at
the time it read): two wakers never send the same wake. A copy of a run that arrives anyway
(the broker gives back a dead worker's message, a waker's message sat behind a backlog)
starts nothing: the runner leaves an ended run as it is, a paused or broken one to a person
(a decision or POST /resume queues it first), a held one to its holder, and a waiting one
that is early goes back to waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from stockade.runs._db import Database, Statement
from stockade.runs.lease_keeper import live_expiry

__all__ = ["START_GRACE_S", "Due", "Waker", "Wakes", "wake_statement"]

log = logging.getLogger("stockade.wakes")

# When a waker first looks at a run that started (the runner holds its lease by then: taken
# before it marks the run running); a missing lease then is a dead worker's. Short: a worker
# that died in a run's first seconds left it ~32 s at 30 s, not the ~20 s of one that died
# later; a look is one query, which a run that ends sooner never costs.
START_GRACE_S = 5.0
# A run sent that is still waiting this long after (its message lost with a process that died
# right after the send, or behind a long backlog) is sent once more.
RESEND_S = 300.0
# A run whose send failed (the broker away) is tried again this soon.
SEND_RETRY_S = 5.0
# Past a live lease's expiry, when a waker looks again (its holder renews it every 5 s).
LEASE_GRACE_S = 2.0
BATCH = 200  # rows a waker handles per look
SENT = 2  # a wake's ``misses`` once its run was sent again for a dead worker


@dataclass(frozen=True, kw_only=True)
class Due:
    """A wake whose time has come."""

    run_id: str
    wake_ns: int
    misses: int  # looks in a row that found the running run without a live lease
    status: str  # the run's, in the service's table


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def wake_statement(ns: str, run_id: str, at_ns: int) -> Statement:
    """The run goes again at ``at_ns`` (an earlier time it had is replaced)."""
    return (
        f"INSERT INTO {ns}_wakes VALUES (?, ?, 0) ON CONFLICT (run_id) "
        "DO UPDATE SET wake_ns = excluded.wake_ns, misses = 0",
        [(run_id, at_ns)],
    )


class Wakes:
    """The ``<ns>_wakes`` rows (the table is made with the service's others, ``state/schema.py``)."""

    def __init__(self, db: Database, *, namespace: str = "svc", runs_namespace: str = "runs") -> None:
        self.db = db
        self.ns = namespace
        self.runs_ns = runs_namespace

    def set(self, run_id: str, after_s: float) -> None:
        self.db.write([wake_statement(self.ns, run_id, time.time_ns() + _ns(after_s))])

    def at(self, run_id: str) -> int | None:
        rows = self.db.query(f"SELECT wake_ns FROM {self.ns}_wakes WHERE run_id = ?", (run_id,))
        return int(str(rows[0][0])) if rows else None

    def due(self, now_ns: int) -> list[Due]:
        """The rows whose time has come, oldest first."""
        ns = self.ns
        rows = self.db.query(
            f"SELECT w.run_id, w.wake_ns, w.misses, r.status FROM {ns}_wakes w "
            f"JOIN {ns}_runs r ON r.run_id = w.run_id WHERE w.wake_ns <= ? ORDER BY w.wake_ns LIMIT {BATCH}",
            (now_ns,),
        )
        return [
            Due(run_id=str(r[0]), wake_ns=int(str(r[1])), misses=int(str(r[2])), status=str(r[3]))
            for r in rows
        ]

    def move(self, run_id: str, seen_ns: int, to_ns: int, *, misses: int = 0) -> bool:
        """Move the wake from ``seen_ns`` to ``to_ns``: False when another waker moved it first."""
        table = f"{self.ns}_wakes"
        return self.db.write(
            [
                (
                    f"UPDATE {table} SET wake_ns = ?, misses = ? WHERE run_id = ? AND wake_ns = ?",
                    [(to_ns, misses, run_id, seen_ns)],
                )
            ],
            require=(f"SELECT 1 FROM {table} WHERE run_id = ? AND wake_ns = ?", (run_id, seen_ns)),
        )

    def drop(self, run_id: str, seen_ns: int) -> None:
        self.db.write(
            [(f"DELETE FROM {self.ns}_wakes WHERE run_id = ? AND wake_ns = ?", [(run_id, seen_ns)])]
        )

    def lease_expiry(self, run_id: str, now_ns: int) -> int | None:
        """When the run's live lease expires (None: it has none)."""
        return live_expiry(self.db, self.runs_ns, run_id, now_ns)


class Waker:
    """Sends the runs whose time has come, every ``poll_s``, on a thread of its own."""

    def __init__(self, wakes: Wakes, send: Callable[[str, str], None], *, poll_s: float = 0.5) -> None:
        self.wakes = wakes
        self.send = send  # (run id, reason): the executor's submit
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Waker:
        self._thread = threading.Thread(target=self._loop, name="stockade-waker", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        said = 0.0  # when a failure was last logged: once a minute while the database is away
        while not self._stop.wait(self.poll_s):
            try:
                self.tick()
            except Exception as error:  # the database or the broker is away for now: look again
                if time.monotonic() - said > 60.0:
                    said = time.monotonic()
                    log.warning(
                        "waker: %s: %s (looking again every %.1f s)", type(error).__name__, error, self.poll_s
                    )

    def tick(self, now_ns: int | None = None) -> list[tuple[str, str]]:
        """One look: the (run, reason) pairs it sent."""
        now = now_ns if now_ns is not None else time.time_ns()
        sent: list[tuple[str, str]] = []
        for due in self.wakes.due(now):
            reason = self._judge(due, now)
            if reason is not None:
                try:
                    self.send(due.run_id, reason)
                except Exception:  # the broker is away: its wake comes again soon, not in RESEND_S
                    self.wakes.set(due.run_id, SEND_RETRY_S)
                    raise
                sent.append((due.run_id, reason))
        return sent

    def _judge(self, due: Due, now: int) -> str | None:
        """Why the run is sent now (None: not sent), its row moved or dropped."""
        wakes, run_id, seen = self.wakes, due.run_id, due.wake_ns
        if due.status == "queued":
            return "wake" if wakes.move(run_id, seen, now + _ns(RESEND_S)) else None
        if due.status != "running":  # paused or ended: nothing to wake
            wakes.drop(run_id, seen)
            return None
        expires = wakes.lease_expiry(run_id, now)
        if expires is not None:  # its process holds it: look again after the lease would end
            wakes.move(run_id, seen, expires + _ns(LEASE_GRACE_S))
            return None
        if due.misses == 0:
            # No live lease: its process died, or it has just released the lease and is about
            # to write how the run stopped. A second look tells them apart.
            wakes.move(run_id, seen, now + _ns(LEASE_GRACE_S), misses=1)
            return None
        # Its process died without a word: to a worker, to be resumed where it stopped. Once
        # more only after RESEND_S, as a waiting run: a worker that takes the copy claims the
        # lease or writes the run (either clears ``misses``), so a copy still out is unconsumed
        # (every worker down) or lost. Sent every START_GRACE_S, a 130 s outage of every
        # worker queued 4 copies of the run, and each started a sandbox once they came back.
        if not wakes.move(run_id, seen, now + _ns(RESEND_S), misses=SENT):
            return None
        if due.misses >= SENT:
            log.warning("run %s: its worker is gone and no worker took it up; sent once more", run_id)
        else:
            log.warning("run %s: its worker is gone; sent again", run_id)
        return "orphaned"

    def close(self) -> None:
        """Stop looking; its database connection is closed with it (it owns it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.wakes.db.close()
