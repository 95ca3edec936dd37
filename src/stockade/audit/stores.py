"""Where audit events live: one small interface, a store per database.

A store is append-only by construction: its interface has no update or delete, and the SQL
stores also refuse UPDATE/DELETE with triggers (a guard against accidents; an attacker with
the database can drop triggers, which is what ``verify`` and a keyed chain are for).

Each store keeps one chain and a *head* record (last seq, its hash, the chain algorithm and a
MAC over them) updated in the same transaction as every batch. The head is what reveals a
truncated tail; see ``stockade.audit.verify`` for what it can and cannot prove.

Beside the chain, a store keeps the keys of sealed runs (``stockade.audit.sealing``): a table
that is not append-only, so that erasing a data subject can forget them.

The interface and its values are ``_store_base``, what every store does as it appends
``_store_append``, the stores ``_memory_store``, ``_sqlite_store`` and ``postgres``; their
public names are all importable from here, with ``open_store``.
"""

from __future__ import annotations

from stockade import exceptions as exc
from stockade.audit._memory_store import MemoryStore
from stockade.audit._sqlite_store import SQLiteStore
from stockade.audit._store_base import AuditStore, Head, Row

__all__ = ["AuditStore", "Head", "MemoryStore", "Row", "SQLiteStore", "open_store"]


def open_store(url: str, *, namespace: str = "audit", read_only: bool = False) -> AuditStore:
    """A store from a URL: ``sqlite:///path``, a plain file path, ``postgresql://...`` or ``memory:``.
    ``read_only``: a reader's, that creates nothing and writes nothing (``verify``, ``export``)."""
    if url.startswith(("postgresql://", "postgres://")):
        from stockade.audit.postgres import PostgresStore

        return PostgresStore(url, namespace=namespace, read_only=read_only)
    if url == "memory:":
        return MemoryStore()
    if url.startswith("sqlite:///"):
        return SQLiteStore(url[len("sqlite:///") :], namespace=namespace, read_only=read_only)
    if "://" in url:
        raise exc.ConfigurationError(
            f"unknown audit store URL {url!r}: use sqlite:///PATH or postgresql://..."
        )
    return SQLiteStore(url, namespace=namespace, read_only=read_only)
