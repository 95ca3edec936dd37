"""What both SQL stores (SQLite, PostgreSQL) share: the namespace their tables are named by
(``check_namespace``, also the run store's), the columns of a stored event and the query of one
window of a run (``window_sql``). Apart from either store: PostgreSQL's imports none of SQLite's.
"""

from __future__ import annotations

import re

from stockade import exceptions as exc
from stockade.audit._store_base import after

__all__ = ["ROW_COLUMNS", "check_namespace", "window_sql"]

_NAMESPACE = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")

ROW_COLUMNS = "seq, run_id, kind, body, hash, step, timestamp_ns"


def window_sql(
    ns: str, mark: str, run_id: str, *, after_seq: int, before_seq: int | None, limit: int, newest: bool
) -> tuple[str, tuple[object, ...]]:
    """``AuditStore.window`` in SQL: the run's index read from one end, ``limit`` rows."""
    sql = f"SELECT {ROW_COLUMNS} FROM {ns}_events WHERE run_id = {mark} AND seq > {mark}"
    params: tuple[object, ...] = (run_id, after(after_seq))
    if before_seq is not None:
        sql += f" AND seq < {mark}"
        params += (after(before_seq),)
    sql += f" ORDER BY seq {'DESC' if newest else 'ASC'} LIMIT {mark}"
    return sql, (*params, max(0, limit))


def check_namespace(namespace: str) -> str:
    if not _NAMESPACE.match(namespace):
        raise exc.ConfigurationError(f"audit namespace {namespace!r} must match {_NAMESPACE.pattern}")
    return namespace
