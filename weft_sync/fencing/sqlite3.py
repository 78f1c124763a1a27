"""The fence for a host's ``sqlite3.Connection``: ``BEGIN IMMEDIATE``, or a savepoint.

Python's transaction attributes decide how the block begins and ends:

- ``isolation_level`` ``None`` or any legacy level (``""``, ``"DEFERRED"``, …; Python 3.12's
  ``autocommit`` left at its legacy default, or ``True``): outside a transaction the block runs
  ``BEGIN IMMEDIATE`` itself, so the module issues no implicit ``BEGIN`` of its own, and ends with
  ``COMMIT`` or ``ROLLBACK``. Inside an open transaction it uses a savepoint and takes the write
  lock with a no-op ``UPDATE`` of the epoch row before reading it.
- ``autocommit=False`` (Python 3.12+): the module keeps a transaction open at all times, so the
  block takes the write lock the same way, and ends with ``commit()`` or ``rollback()`` — which
  also commits or discards what the host ran on the connection since its last commit.

The host must not commit or roll back the connection inside the block.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from ..storage.fence_target import FenceBinding
from .base import savepoint_name

__all__ = ["Sqlite3Transaction"]

# Python 3.12+ only; before it every connection is in the legacy transaction mode.
_HAS_AUTOCOMMIT = hasattr(sqlite3.Connection, "autocommit")


class Sqlite3Transaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a ``sqlite3.Connection``."""

    family = "sqlite"
    # sqlite3.Connection takes no weak references: the last proof is only a guess, re-checked
    # by every block (FenceBinding.recheck).
    connection_key = None

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._conn = connection
        self._savepoint: str | None = None

    @property
    def result(self) -> sqlite3.Connection:
        return self._conn

    def _module_managed(self) -> bool:
        # Python 3.12+: autocommit False means the module owns BEGIN/COMMIT on this connection.
        return _HAS_AUTOCOMMIT and getattr(self._conn, "autocommit", None) is False

    def begin_reading(
        self, binding: FenceBinding, params: Sequence[str]
    ) -> list[tuple[Any, ...]] | None:
        """``BEGIN IMMEDIATE``, the binding's re-check and the epoch read in one call; ``None``
        (nothing begun) inside an open transaction, where the module owns the transaction, or
        when the re-check finds the connection no longer on the proven file."""
        conn = self._conn
        if conn.in_transaction or self._module_managed():
            return None
        conn.execute("BEGIN IMMEDIATE")
        recheck, confirm = binding.recheck, binding.confirm
        if (
            recheck is not None
            and confirm is not None
            and not confirm(conn.execute(recheck).fetchall())
        ):
            conn.execute("ROLLBACK")
            return None
        return conn.execute(binding.read_epoch, params).fetchall()

    def begin(self) -> bool:
        conn = self._conn
        if self._module_managed():
            return False
        if conn.in_transaction:
            self._savepoint = savepoint_name()
            conn.execute(f"SAVEPOINT {self._savepoint}")
            return False
        conn.execute("BEGIN IMMEDIATE")
        return True

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, tuple(params)).fetchall()

    def end(self, error: BaseException | None) -> None:
        conn = self._conn
        if self._savepoint is not None:
            if not conn.in_transaction:
                return  # SQLite rolled the whole transaction back (e.g. SQLITE_FULL)
            if error is not None:
                conn.execute(f"ROLLBACK TO {self._savepoint}")
            conn.execute(f"RELEASE {self._savepoint}")
        elif self._module_managed():
            if error is None:
                conn.commit()
            else:
                conn.rollback()
        elif conn.in_transaction:
            conn.execute("COMMIT" if error is None else "ROLLBACK")
        elif error is None:
            raise sqlite3.OperationalError(
                "the fenced transaction was ended inside the block (commit() or rollback() on "
                "the connection); nothing after that point was fenced"
            )
