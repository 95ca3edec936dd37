"""Where things are: the API processes (``<ns>_nodes``), the process that holds each sandbox,
the sandboxes that ended (``<ns>_ended``), and the store that keeps each snapshot
(``<ns>_snapshots``), so that a request reaches the process that can answer it.

A part of ``ServiceStore``; ``server/routing.py`` forwards requests by what it says.
"""

from __future__ import annotations

import time

from stockade.runs._db import Database
from stockade.server.state.rows import Node, Placement, SandboxRow, as_int


class PlacementTables:
    """The tables of API processes, and of where each sandbox and snapshot is."""

    db: Database
    ns: str

    # -- API processes: where each sandbox is ---------------------------------------------------

    def register_node(self, owner: str, url: str, hop_key: str) -> None:
        self.db.write(
            [
                (
                    f"INSERT INTO {self.ns}_nodes VALUES (?, ?, ?, ?) ON CONFLICT (owner) DO UPDATE "
                    "SET url = excluded.url, hop_key = excluded.hop_key, beat_ns = excluded.beat_ns",
                    [(owner, url, hop_key, time.time_ns())],
                )
            ]
        )

    def beat(self, owner: str) -> bool:
        """Say ``owner`` is alive; False when its row is gone (a peer found it dead)."""
        table = f"{self.ns}_nodes"
        return self.db.write(
            [(f"UPDATE {table} SET beat_ns = ? WHERE owner = ?", [(time.time_ns(), owner)])],
            require=(f"SELECT 1 FROM {table} WHERE owner = ?", (owner,)),
        )

    def nodes(self) -> list[Node]:
        rows = self.db.query(f"SELECT owner, url, hop_key, beat_ns FROM {self.ns}_nodes")
        return [Node(owner=str(r[0]), url=str(r[1]), hop_key=str(r[2]), beat_ns=as_int(r[3])) for r in rows]

    def owners(self) -> list[str]:
        """Every process that holds a sandbox, or a killed one, or has a row of its own."""
        ns = self.ns
        rows = self.db.query(
            f"SELECT owner FROM {ns}_sandboxes UNION SELECT owner FROM {ns}_ended WHERE reason = 'killed' "
            f"UNION SELECT owner FROM {ns}_nodes"
        )
        return [str(r[0]) for r in rows]

    def bury(self, owner: str) -> int:
        """``owner`` is dead: its sandboxes are lost (their quota freed, each remembered as
        "lost"), and so is its row. Returns how many sandboxes it held."""
        ns, now = self.ns, time.time_ns()
        held = self.db.query(f"SELECT COUNT(*) FROM {ns}_sandboxes WHERE owner = ?", (owner,))
        self.db.write(
            [
                (
                    f"INSERT INTO {ns}_ended SELECT sandbox_id, tenant, owner, 'lost', ? FROM {ns}_sandboxes "
                    "WHERE owner = ? ON CONFLICT (sandbox_id) DO NOTHING",
                    [(now, owner)],
                ),
                (f"UPDATE {ns}_ended SET reason = 'lost' WHERE owner = ?", [(owner,)]),
                (f"DELETE FROM {ns}_sandboxes WHERE owner = ?", [(owner,)]),
                (f"DELETE FROM {ns}_nodes WHERE owner = ?", [(owner,)]),
            ]
        )
        return as_int(held[0][0]) if held else 0

    def forget_node(self, owner: str) -> None:
        """A process stopping cleanly: its row goes (its sandboxes were closed first)."""
        self.db.write(
            [
                (f"DELETE FROM {self.ns}_nodes WHERE owner = ?", [(owner,)]),
                (f"DELETE FROM {self.ns}_ended WHERE owner = ? AND reason = 'killed'", [(owner,)]),
            ]
        )

    def locate(self, sandbox_id: str) -> Placement | None:
        """Where ``sandbox_id`` is, or was; None when the service never had it (or forgot it)."""
        ns = self.ns
        node = "n.owner, n.url, n.hop_key, n.beat_ns"
        for table, reason in ((f"{ns}_sandboxes", "NULL"), (f"{ns}_ended", "s.reason")):
            rows = self.db.query(
                f"SELECT s.tenant, s.owner, {reason}, {node} FROM {table} s "
                f"LEFT JOIN {ns}_nodes n ON n.owner = s.owner WHERE s.sandbox_id = ?",
                (sandbox_id,),
            )
            if rows:
                r = rows[0]
                found = None
                if r[3] is not None:
                    found = Node(owner=str(r[3]), url=str(r[4]), hop_key=str(r[5]), beat_ns=as_int(r[6]))
                return Placement(
                    sandbox_id=sandbox_id, tenant=str(r[0]), owner=str(r[1]), node=found,
                    ended=None if r[2] is None else str(r[2]),
                )  # fmt: skip
        return None

    def tenant_owners(self, tenant: str) -> list[str]:
        """The processes that hold a sandbox of ``tenant`` (live or killed)."""
        ns = self.ns
        rows = self.db.query(
            f"SELECT owner FROM {ns}_sandboxes WHERE tenant = ? UNION "
            f"SELECT owner FROM {ns}_ended WHERE tenant = ? AND reason = 'killed'",
            (tenant, tenant),
        )
        return [str(r[0]) for r in rows]

    def purge_ended(self, before_ns: int) -> None:
        """Forget sandboxes lost before ``before_ns``: after that, they are simply not found."""
        self.db.write(
            [(f"DELETE FROM {self.ns}_ended WHERE reason = 'lost' AND ended_ns < ?", [(before_ns,)])]
        )

    def sandboxes(self, *, owner: str | None = None) -> list[SandboxRow]:
        sql = f"SELECT sandbox_id, tenant, owner, tier, cpus, memory_mb FROM {self.ns}_sandboxes"
        rows = self.db.query(sql + " WHERE owner = ?", (owner,)) if owner else self.db.query(sql)
        return [
            SandboxRow(
                sandbox_id=str(r[0]), tenant=str(r[1]), owner=str(r[2]), tier=str(r[3]),
                cpus=float(str(r[4])), memory_mb=as_int(r[5]),
            )
            for r in rows
        ]  # fmt: skip

    # -- snapshots: which store keeps them -------------------------------------------------------

    def record_snapshot(self, tenant: str, role: str | None, name: str, store_id: str, url: str) -> None:
        """``name`` (a snapshot id, or a paused sandbox's) of ``tenant``, taken by a token of
        ``role``, is kept in the store ``store_id``, written by the process at ``url``."""
        self.db.write(
            [
                (
                    f"INSERT INTO {self.ns}_snapshots (tenant, name, store_id, url, taken_ns, role) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, name) "
                    "DO UPDATE SET store_id = excluded.store_id, url = excluded.url, "
                    "taken_ns = excluded.taken_ns, role = excluded.role",
                    [(tenant, name, store_id, url, time.time_ns(), role)],
                )
            ]
        )

    def snapshot_place(self, tenant: str, role: str | None, name: str) -> tuple[str, str] | None:
        """(store id, url) of a tenant's snapshot or paused sandbox that ``role`` took, or None
        (another role's, or a row from before they named a role seen by a role: None too)."""
        sql = f"SELECT store_id, url FROM {self.ns}_snapshots WHERE tenant = ? AND name = ? AND "
        rows = (
            self.db.query(sql + "role IS NULL", (tenant, name))
            if role is None
            else self.db.query(sql + "role = ?", (tenant, name, role))
        )
        return (str(rows[0][0]), str(rows[0][1])) if rows else None

    def forget_snapshot(self, tenant: str, name: str) -> None:
        self.db.write([(f"DELETE FROM {self.ns}_snapshots WHERE tenant = ? AND name = ?", [(tenant, name)])])
