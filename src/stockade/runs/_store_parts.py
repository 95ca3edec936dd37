"""The run store's parts: its database, its tables (made, or checked when opened read-only),
and the collaborators it delegates to, one per concern, with the caps they enforce.

The base of ``RunStore`` (``store``): what a run records (``_store_records``) and what readers
read (``_store_reads``) both act through these parts, so they sit below both. ``check_run_id``
is here for the same reason: every part refuses a run id a store cannot hold, by name.
"""

from __future__ import annotations

import threading

from stockade import exceptions as exc
from stockade._checks import check_id
from stockade.audit._store_sql import check_namespace
from stockade.audit.redact import Redactor
from stockade.runs._db import Database, display_url
from stockade.runs._mac import RowMac
from stockade.runs._schema import MAC_TABLES, schema, tables
from stockade.runs.checkpoints import Checkpoints
from stockade.runs.erasure import Erasure
from stockade.runs.lease import LEASE_S, MAX_LEASE_S, RunLease
from stockade.runs.lease_keeper import LeaseKeeper
from stockade.runs.ledger import CallLedger
from stockade.runs.seeds import MAX_SEED_BYTES
from stockade.runs.workspace import MAX_RUN_BYTES, MAX_WORKSPACE_BYTES, MAX_WORKSPACE_ENTRIES
from stockade.runs.workspace_history import WorkspaceHistory

__all__ = ["StoreParts", "check_run_id"]


class StoreParts:
    """A run store's database, tables and collaborators (see ``RunStore``)."""

    def __init__(
        self,
        db: Database,
        *,
        namespace: str = "runs",
        redactor: Redactor | None = None,
        max_seed_bytes: int = MAX_SEED_BYTES,
        max_workspace_bytes: int = MAX_WORKSPACE_BYTES,
        max_workspace_entries: int = MAX_WORKSPACE_ENTRIES,
        max_run_bytes: int = MAX_RUN_BYTES,
        lease_s: float = LEASE_S,
        lease_wait_s: float = 0.0,
        key: bytes | None = None,
    ) -> None:
        if not 0 < lease_s <= MAX_LEASE_S or lease_wait_s < 0:
            raise exc.ConfigurationError(
                f"RunStore: lease_s must be positive and at most {MAX_LEASE_S:g}, and lease_wait_s >= 0"
            )
        self.db = db
        self.max_seed_bytes = max_seed_bytes
        self.lease_s = lease_s
        self.lease_wait_s = lease_wait_s  # how long ``claim`` waits for a held lease
        # Remembering: an observation is written in a message, a step and the ledger, and an
        # agent reads the same files again and again; each long text is redacted once.
        self.redactor = (redactor if redactor is not None else Redactor()).remembering()
        self.ns = check_namespace(namespace)
        self.url = db.url
        self._where = where = display_url(db)
        # the audit trail's key: the rows a resume acts on are MAC'd under a key derived from it
        self.mac = RowMac(key)
        self._leases = LeaseKeeper(db, self.ns, self.mac)
        self._ahead: dict[str, RunLease] = {}  # leases taken ahead (``claimed_ahead``), by run id
        self._ahead_lock = threading.Lock()
        self._ledger = CallLedger(db, self.ns, self.redactor, self.mac, write=self._leases.write, where=where)
        self._checkpoints = Checkpoints(
            db, self.ns, self.redactor, self._ledger, self.mac, write=self._leases.write, where=where
        )
        self._workspaces = WorkspaceHistory(
            db,
            self.ns,
            self._checkpoints,
            max_bytes=max_workspace_bytes,
            max_entries=max_workspace_entries,
            max_run_bytes=max_run_bytes,
            where=where,
        )
        self._erasure = Erasure(db, self.ns)
        if db.read_only:  # a reader makes nothing: what the store lacks is said, not made
            self._check_schema()
            return
        self.db.create(schema(self.ns, db.serial, db.blob), name=self.ns)
        for table in MAC_TABLES:
            self.db.add_column(f"{self.ns}_{table}", "mac", "TEXT")
        for table in ("blobs", "seeds"):  # shared contents: how many times runs took each
            self.db.add_column(f"{self.ns}_{table}", "uses", "BIGINT NOT NULL DEFAULT 0")

    def _check_schema(self) -> None:
        signed = {f"{self.ns}_{t}" for t in MAC_TABLES}
        missing: list[str] = []
        for table in tables(self.ns):
            have = self.db.columns(table)
            if not have:
                missing.append(table)
            elif table in signed and "mac" not in have:
                missing.append(f"{table}.mac")
        if missing:
            raise exc.RunStoreCorrupt(
                f"run store {self._where} lacks {', '.join(missing)} (made by an earlier stockade, or "
                "damaged); opened read-only, so nothing was added: a writer (a run, a resume) adds "
                "what an earlier stockade did not make"
            )

    # The workspace caps are the workspace history's: set here, they apply to the runs it
    # starts tracking from then on, as they did when they were the store's own.
    @property
    def max_workspace_bytes(self) -> int:
        return self._workspaces.max_bytes

    @max_workspace_bytes.setter
    def max_workspace_bytes(self, value: int) -> None:
        self._workspaces.max_bytes = value

    @property
    def max_workspace_entries(self) -> int:
        return self._workspaces.max_entries

    @max_workspace_entries.setter
    def max_workspace_entries(self, value: int) -> None:
        self._workspaces.max_entries = value

    @property
    def max_run_bytes(self) -> int:
        """What one run's workspace versions may add to the store, all together (compressed)."""
        return self._workspaces.max_run_bytes

    @max_run_bytes.setter
    def max_run_bytes(self, value: int) -> None:
        self._workspaces.max_run_bytes = value


def check_run_id(run_id: object) -> str:
    """A run id a store can be asked about: text that encodes as UTF-8. An int past 2**63 (an
    OverflowError out of SQLite), a lone surrogate (a UnicodeEncodeError), None or a number
    (looked up as they were, never found) are refused by name instead."""
    if isinstance(run_id, str):
        try:
            run_id.encode()
        except UnicodeEncodeError:
            pass
        else:
            return run_id
    return check_id(run_id, argument="run_id")  # raises: says what is wrong with it
