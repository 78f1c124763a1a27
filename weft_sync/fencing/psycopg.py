"""The fence for a host's psycopg 3 ``Connection``: a transaction, or a savepoint in one.

The block begins the way psycopg's own ``connection.transaction()`` would, and ends only what it
began:

- no transaction open, ``autocommit=True``: ``BEGIN`` … ``COMMIT`` (``ROLLBACK``);
- no transaction open, ``autocommit=False``: psycopg's implicit ``BEGIN`` …
  ``connection.commit()`` (``rollback()``);
- a transaction open (the host's, or the implicit one of a non-autocommit connection):
  ``SAVEPOINT`` … ``RELEASE`` (``ROLLBACK TO`` first on an error).

That first statement and the fence's first query go to the server in one round trip: they are
sent in pipeline mode, which the adapter leaves as soon as the query's rows are back, so the
host's own statements run exactly as they would without the fence. (``transaction()`` itself is
not used: inside a pipeline it keeps the connection in pipeline mode until it ends.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from .base import savepoint_name

__all__ = ["PsycopgTransaction"]


class PsycopgTransaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a psycopg 3 connection."""

    family = "postgresql"

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self._conn = connection
        self._savepoint: str | None = None
        self._explicit = False
        self._first: str | None = None  # what begins the block, sent with the first query

    @property
    def connection_key(self) -> object:
        return self._conn

    @property
    def result(self) -> psycopg.Connection[Any]:
        return self._conn

    def begin(self) -> bool:
        conn = self._conn
        if conn.info.transaction_status != TransactionStatus.IDLE:
            self._savepoint = savepoint_name()
            self._first = f"SAVEPOINT {self._savepoint}"
        elif conn.autocommit:
            self._explicit = True
            self._first = "BEGIN"
        # else: psycopg sends its implicit BEGIN before the first query, in the same pipeline.
        return True

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        conn = self._conn
        first, self._first = self._first, None
        cur = conn.cursor()
        if not psycopg.Pipeline.is_supported():
            if first is not None:
                conn.execute(first)
            cur.execute(sql, list(params) if params else None)
        else:
            with conn.pipeline():
                if first is not None:
                    conn.execute(first)
                cur.execute(sql, list(params) if params else None)
        return [tuple(row) for row in cur.fetchall()]

    def end(self, error: BaseException | None) -> None:
        conn = self._conn
        if self._first is not None:
            return  # nothing was sent: the block failed before the fence's first query
        if self._savepoint is not None:
            if error is not None:
                conn.execute(f"ROLLBACK TO SAVEPOINT {self._savepoint}")
            conn.execute(f"RELEASE SAVEPOINT {self._savepoint}")
        elif self._explicit:
            conn.execute("COMMIT" if error is None else "ROLLBACK")
        elif error is None:
            conn.commit()
        else:
            conn.rollback()
