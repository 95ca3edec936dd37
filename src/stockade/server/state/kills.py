"""``DatabaseKillSource``: kill switches (``<ns>_kills``) and live marks (``<ns>_live``) in the
service's database, for every worker, and ``database_kill_source``, what ``stockade kill
--target URL`` pulls.

Apart from the store: it implements the runtime's ``KillSource``, which the runtime layer
imports by name only for a database target.
"""

from __future__ import annotations

import threading
import time

from stockade.runtime.kill_sources import LIVE_FOR_S, LiveRun
from stockade.server.state.rows import ENDED, WAITING, as_int
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore


class DatabaseKillSource:
    """Kill switches and live marks in the service's database, for every worker.

    A run's ``KillSwitch`` asks ``reason`` ten times a second; one source serves every run of
    its process and reads the (small) table of pulled switches at most every ``poll_s``, so
    a worker costs the database one query per ``poll_s`` however many runs it holds. Live
    marks are written at most every ``beat_s`` per run (they count for ``LIVE_FOR_S``)."""

    def __init__(self, store: ServiceStore, *, poll_s: float = 0.5, beat_s: float = 4.0) -> None:
        self.store = store
        self.db = store.db
        self.kills = f"{store.ns}_kills"
        self.marks = f"{store.ns}_live"
        self.poll_s = poll_s
        self.beat_s = beat_s
        self._lock = threading.Lock()
        self._read_at = 0.0
        self._pulled: dict[str, str] = {}
        self._beats: dict[str, float] = {}

    def reason(self, run_id: str) -> str | None:
        with self._lock:
            if time.monotonic() - self._read_at >= self.poll_s:
                rows = self.db.query(f"SELECT run_id, reason FROM {self.kills}")
                self._pulled = {str(r[0]): str(r[1]) for r in rows}
                self._read_at = time.monotonic()
            return self._pulled.get(run_id)

    def reason_now(self, run_id: str) -> str | None:
        """``reason`` read now, not from the last read of the table (``KillSwitch.check``)."""
        rows = self.db.query(f"SELECT reason FROM {self.kills} WHERE run_id = ?", (run_id,))
        return str(rows[0][0]) if rows else None

    def kill(self, run_id: str, reason: str) -> None:
        self.pull(run_id, reason)

    def pull(self, run_id: str, reason: str) -> bool:
        """Pull the run's switch; False when it is a run of the service that has ended. Written
        with the run's row locked, as its worker writes its end (``ServiceStore.set_status``,
        ``killed_if_pulled``): that end finds this switch and ends the run "killed", or this
        finds the end and pulls nothing. (A kill answered "running" then saw the run end
        "success".) A run the service does not have (a local one watching its database) is
        pulled all the same."""
        row = (
            f"INSERT INTO {self.kills} VALUES (?, ?, ?) "
            "ON CONFLICT (run_id) DO UPDATE SET reason = excluded.reason",
            [(run_id, reason or "killed", time.time_ns())],
        )
        runs = f"SELECT 1 FROM {self.store.ns}_runs WHERE run_id = ?"
        if self.db.write([row], require=(f"{runs} AND status NOT IN {ENDED}", [run_id])):
            return True
        if self.db.query(runs, (run_id,)):
            return False
        self.db.write([row])
        return True

    def clear(self, run_id: str) -> None:
        """A run's watch is over. The switch of a run of the service that has not ended stays:
        the end its worker writes next turns "killed" by it (a kill that came as the run's last
        step ended was lost with the watch), and its end goes with it (``set_status``)."""
        open_run = f"SELECT 1 FROM {self.store.ns}_runs WHERE run_id = ? AND status NOT IN {ENDED}"
        self.db.write(
            [(f"DELETE FROM {self.kills} WHERE run_id = ? AND NOT EXISTS ({open_run})", [(run_id, run_id)])]
        )
        with self._lock:
            self._pulled.pop(run_id, None)

    def mark_live(self, run_id: str, info: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._beats.get(run_id, -1e9) < self.beat_s:
                return
            self._beats[run_id] = now
        self.db.write(
            [
                (
                    f"INSERT INTO {self.marks} VALUES (?, ?, ?) ON CONFLICT (run_id) DO UPDATE "
                    "SET info = excluded.info, beat_ns = excluded.beat_ns",
                    [(run_id, info, time.time_ns())],
                )
            ]
        )

    def unmark_live(self, run_id: str) -> None:
        with self._lock:
            self._beats.pop(run_id, None)
        self.db.write([(f"DELETE FROM {self.marks} WHERE run_id = ?", [(run_id,)])])

    def live(self, run_id: str) -> str | None:
        rows = self.db.query(f"SELECT info, beat_ns FROM {self.marks} WHERE run_id = ?", (run_id,))
        if not rows or time.time_ns() - as_int(rows[0][1]) > LIVE_FOR_S * 1e9:
            return None
        return str(LiveRun.decode(run_id, str(rows[0][0])))

    def end_waiting(self, reason: str, *, tenant: str | None = None) -> list[LiveRun]:
        """End every run of ``tenant`` (of every tenant, when None) that waits: queued, paused
        for an approval, interrupted or broken. A kill-all pulls the switches of the live runs;
        without this, a worker would take up the queued ones right after. A run a worker took
        meanwhile has its switch pulled instead. Returns them, ``where`` saying what each was."""
        ended = []
        for row in self.store.waiting_runs(tenant):
            if self.store.set_status(row.run_id, "killed", error=reason, only_from=WAITING):
                ended.append(LiveRun(run_id=row.run_id, where=row.status, tenant=row.tenant))
            else:  # taken up meanwhile: its switch stops it
                self.kill(row.run_id, reason)
                ended.append(LiveRun(run_id=row.run_id, where="started meanwhile", tenant=row.tenant))
        # "running" with no fresh mark: its worker died, and the broker will hand the run to
        # another, which resumes it; no live mark lists it, so its switch is pulled here (a
        # kill-all missed it, and the run went on with two more calls)
        known = {run.run_id for run in (*self.live_runs(), *ended)}
        for row in self.store.running_runs(tenant):
            if row.run_id not in known:
                self.kill(row.run_id, reason)
                ended.append(LiveRun(run_id=row.run_id, where="its worker silent", tenant=row.tenant))
        return ended

    def live_runs(self) -> list[LiveRun]:
        """Every run whose mark is fresh, wherever it runs (``kill_all``)."""
        fresh = time.time_ns() - int(LIVE_FOR_S * 1e9)
        rows = self.db.query(
            f"SELECT run_id, info FROM {self.marks} WHERE beat_ns >= ? ORDER BY run_id", (fresh,)
        )
        return [LiveRun.decode(str(r[0]), str(r[1])) for r in rows]


def database_kill_source(url: str) -> DatabaseKillSource:
    """The kill switches of the service whose database is ``url`` (``sqlite:///PATH`` or
    ``postgresql://...``): what ``stockade kill --target URL`` pulls. Its tables are made if
    missing, as the service would."""
    return DatabaseKillSource(ServiceStore(open_database(url)), poll_s=0.0)
