"""``DatabaseApprovals``: the approval book (``<ns>_approvals``) in the service's database, so
that a decision made through the API reaches the run on whichever worker resumes it.

Apart from the store: it is the policy layer's ``ApprovalBook``, over the store's database.
"""

from __future__ import annotations

import time

from stockade import exceptions as exc
from stockade.audit.redact import Redactor
from stockade.policy.approval_book import SPENT, ApprovalRequest, Choice, keyed, not_pending, redacted
from stockade.server.state.rows import ENDED, as_int
from stockade.server.state.store import ServiceStore


class DatabaseApprovals:
    """``ApprovalBook`` in the service's database: a decision made through the API reaches the
    run on whichever worker resumes it."""

    def __init__(self, store: ServiceStore, *, redactor: Redactor | None = None) -> None:
        self.db = store.db
        self.table = f"{store.ns}_approvals"
        self.redactor = redactor if redactor is not None else Redactor()  # actions, reasons
        self.store = store
        self._key = b""  # the service's key "approvals", read at its first use

    def keyed(self, request: ApprovalRequest) -> ApprovalRequest:
        self._key = self._key or self.store.key("approvals")
        return keyed(request, self.redactor, self._key)

    def submit(self, request: ApprovalRequest) -> None:
        kept = redacted(request, self.redactor)
        self.db.write(
            [
                (
                    # a request whose yes was spent is asked anew (ApprovalBook.submit)
                    f"INSERT INTO {self.table} VALUES (?, ?, ?, ?, ?, 'pending', '', ?) "
                    "ON CONFLICT (run_id, request_id) DO UPDATE SET status = 'pending', decided_by = '', "
                    f"updated_ns = excluded.updated_ns WHERE {self.table}.status = '{SPENT}'",
                    [
                        (
                            request.run_id,
                            request.id,
                            kept["action"],
                            request.rule,
                            kept["reason"],
                            time.time_ns(),
                        )
                    ],
                )
            ]
        )

    def decide(self, run_id: str, request_id: str, choice: Choice, *, by: str = "") -> None:
        """Record a decision for a pending request: ``RunConflict`` once its run has ended (a
        kill that ended it between the API's look at the run and this write left a decision
        accepted for nothing), ``ApprovalDecided`` once the request was decided."""
        where = "WHERE run_id = ? AND request_id = ?"
        ended = f"SELECT status FROM {self.store.ns}_runs WHERE run_id = ? AND status IN {ENDED}"
        if self.db.write(
            [
                (
                    f"UPDATE {self.table} SET status = ?, decided_by = ?, updated_ns = ? {where}",
                    [(choice.value, by, time.time_ns(), run_id, request_id)],
                )
            ],
            require=(
                f"SELECT 1 FROM {self.table} {where} AND status = 'pending' AND NOT EXISTS ({ended})",
                (run_id, request_id, run_id),
            ),
        ):
            return
        rows = self.db.query(f"SELECT status FROM {self.table} {where}", (run_id, request_id))
        if not rows:
            raise exc.ResourceNotFound(
                f"no approval request {request_id!r} for run {run_id!r}", kind="approval", id=request_id
            )
        if str(rows[0][0]) == "pending" and (run := self.db.query(ended, (run_id,))):
            raise exc.RunConflict(f"run {run_id!r} ended ({run[0][0]}): its requests wait for no decision")
        raise not_pending(run_id, request_id, str(rows[0][0]))

    def decision(self, request: ApprovalRequest) -> Choice | None:
        rows = self.db.query(
            f"SELECT status FROM {self.table} WHERE run_id = ? AND request_id = ?",
            (request.run_id, request.id),
        )
        status = str(rows[0][0]) if rows else None
        return Choice(status) if status in (Choice.APPROVED, Choice.DENIED) else None

    def spend(self, run_id: str, request_id: str) -> bool:
        where = "WHERE run_id = ? AND request_id = ?"
        return self.db.write(
            [
                (
                    f"UPDATE {self.table} SET status = '{SPENT}', updated_ns = ? {where}",
                    [(time.time_ns(), run_id, request_id)],
                )
            ],
            # locked (FOR UPDATE) until the update: two workers never both apply one yes
            require=(f"SELECT 1 FROM {self.table} {where} AND status = 'approved'", (run_id, request_id)),
        )

    def requests(self, run_id: str, *, offset: int = 0, limit: int | None = None) -> list[dict[str, str]]:
        """The run's requests, oldest first; ``offset`` and ``limit`` page them (the API's)."""
        return self._select(run_id, "", "ORDER BY updated_ns, request_id", offset=offset, limit=limit)

    def pending(self, run_id: str | None = None, *, limit: int | None = None) -> list[dict[str, str]]:
        """The run's pending requests, the latest first; ``limit``: that many at most."""
        if run_id is None:
            return []  # the service asks by run: a tenant sees only its own
        latest = "ORDER BY updated_ns DESC, request_id"
        return self._select(run_id, "AND status = 'pending'", latest, limit=limit)

    def count_pending(self, run_id: str) -> int:
        """How many requests of the run wait, counted where they are kept (not read)."""
        rows = self.db.query(
            f"SELECT COUNT(*) FROM {self.table} WHERE run_id = ? AND status = 'pending'", (run_id,)
        )
        return as_int(rows[0][0]) if rows else 0

    def _select(
        self, run_id: str, where: str, order: str, *, offset: int = 0, limit: int | None = None
    ) -> list[dict[str, str]]:
        page = "" if limit is None else f" LIMIT {int(limit)} OFFSET {int(offset)}"
        rows = self.db.query(
            f"SELECT request_id, action, rule, reason, status, decided_by FROM {self.table} WHERE run_id = ? "
            f"{where} {order}{page}",
            (run_id,),
        )
        keys = ("id", "action", "rule", "reason", "status", "by")
        return [{**dict(zip(keys, map(str, r), strict=True)), "run_id": run_id} for r in rows]
