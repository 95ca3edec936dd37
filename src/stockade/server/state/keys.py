"""The service's own random keys (``<ns>_keys``: the viewer's sessions are signed with one,
approval requests are keyed with another) and the viewer sessions signed out
(``<ns>_signouts``).

A part of ``ServiceStore``: secrets, apart from the tables of runs and sandboxes.
"""

from __future__ import annotations

import secrets
import time

from stockade.runs._db import Database


class KeyTables:
    """The tables of the service's keys and of viewer sign-outs."""

    db: Database
    ns: str

    # -- the service's keys and viewer sign-outs --------------------------------------------

    def key(self, name: str) -> bytes:
        """The service's key ``name``: made once, at random, by whichever process asks first."""
        table = f"{self.ns}_keys"
        made = secrets.token_hex(32)
        self.db.write([(f"INSERT INTO {table} VALUES (?, ?) ON CONFLICT (name) DO NOTHING", [(name, made)])])
        rows = self.db.query(f"SELECT value FROM {table} WHERE name = ?", (name,))
        return bytes.fromhex(str(rows[0][0]))

    def sign_out(self, nonce: str, expires_ns: int) -> None:
        """Remember a viewer session as signed out until it would have expired anyway."""
        table = f"{self.ns}_signouts"
        self.db.write(
            [
                (f"DELETE FROM {table} WHERE expires_ns < ?", [(time.time_ns(),)]),
                (f"INSERT INTO {table} VALUES (?, ?) ON CONFLICT (nonce) DO NOTHING", [(nonce, expires_ns)]),
            ]
        )

    def signed_out(self, nonce: str) -> bool:
        return bool(self.db.query(f"SELECT 1 FROM {self.ns}_signouts WHERE nonce = ?", (nonce,)))
