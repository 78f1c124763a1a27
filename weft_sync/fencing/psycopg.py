"""The fence for a host's psycopg 3 ``Connection``: ``connection.transaction()``.

psycopg's own transaction block begins a transaction, or a savepoint when one is open (also the
implicit one of a non-autocommit connection), and commits or rolls back exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from psycopg.rows import tuple_row

__all__ = ["PsycopgTransaction"]


class PsycopgTransaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a psycopg 3 connection."""

    family = "postgresql"

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self._conn = connection
        self._tx: AbstractContextManager[psycopg.Transaction] | None = None

    @property
    def connection_key(self) -> object:
        return self._conn

    @property
    def result(self) -> psycopg.Connection[Any]:
        return self._conn

    def begin(self) -> bool:
        # BEGIN goes alone, not pipelined with the fence's read: psycopg's pipeline mode costs
        # more than a loopback round trip, and a transaction() entered in a pipeline keeps the
        # connection in pipeline mode (the host's statements too) until it ends.
        tx = self._conn.transaction()
        tx.__enter__()
        self._tx = tx
        return True

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        # Tuples whatever row factory the host set; no parameters: several statements may go
        # in one round trip.
        cur = self._conn.cursor(row_factory=tuple_row)
        cur.execute(sql, params or None)
        return cur.fetchall() if cur.description else []

    def end(self, error: BaseException | None) -> None:
        tx, self._tx = self._tx, None
        if tx is None:
            return
        if error is None:
            tx.__exit__(None, None, None)
        else:
            tx.__exit__(type(error), error, error.__traceback__)
