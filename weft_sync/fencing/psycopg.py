"""The fence for a host's psycopg 3 ``Connection``: psycopg's own transaction block.

The block is ``connection.transaction()``: ``BEGIN`` outside a transaction (psycopg's, with the
connection's isolation level), a savepoint inside one or in pipeline mode; it commits or rolls
back exactly, and psycopg itself refuses a ``commit()`` or ``rollback()`` of the host inside
it. The fence's statements run with ``prepare=False``, so that no prepared statement is left in
the host's session (psycopg prepares a query on its own once it ran ``prepare_threshold``
times, and a prepared statement breaks behind a transaction-mode pooler); the settings the
epoch read makes are transaction-local (``set_config(…, true)``). Parameters are bound by
psycopg.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from psycopg.rows import tuple_row

_PIPELINE_OFF = psycopg.pq.PipelineStatus.OFF


def run_query(
    conn: psycopg.Connection[Any], sql: str, params: Sequence[object]
) -> list[tuple[Any, ...]]:
    """Run one fence statement on the host's ``conn``, never prepared, and return its rows.

    Tuples whatever row factory the host set. In pipeline mode the result is not in yet when
    ``execute`` returns: fetching syncs the pipeline (every statement the fence sends through
    here returns rows).
    """
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(sql, params or None, prepare=False)
        if cur.description is None and conn.pgconn.pipeline_status != _PIPELINE_OFF:
            return cur.fetchall()
        return cur.fetchall() if cur.description else []


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
        tx = self._conn.transaction()
        tx.__enter__()
        self._tx = tx
        return True

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        return run_query(self._conn, sql, params)

    def end(self, error: BaseException | None) -> None:
        tx, self._tx = self._tx, None
        if tx is None:
            return
        if error is None:
            tx.__exit__(None, None, None)
        else:
            tx.__exit__(type(error), error, error.__traceback__)
