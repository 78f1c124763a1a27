"""The fence for a host's psycopg 3 ``Connection``: ``connection.transaction()``.

psycopg's own transaction block begins a transaction, or a savepoint when one is open (also the
implicit one of a non-autocommit connection), and commits or rolls back exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import psycopg

__all__ = ["PsycopgTransaction"]


class PsycopgTransaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a psycopg 3 connection."""

    family = "postgresql"

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self._conn = connection
        self._tx = ExitStack()

    @property
    def connection_key(self) -> object:
        return self._conn

    @property
    def result(self) -> psycopg.Connection[Any]:
        return self._conn

    def begin(self) -> bool:
        self._tx.enter_context(self._conn.transaction())
        return True

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        # No parameters: several statements may go in one round trip.
        cur = self._conn.cursor()
        cur.execute(sql, list(params) if params else None)
        return [tuple(row) for row in cur.fetchall()] if cur.description else []

    def end(self, error: BaseException | None) -> None:
        if error is None:
            self._tx.__exit__(None, None, None)
        else:
            self._tx.__exit__(type(error), error, error.__traceback__)
