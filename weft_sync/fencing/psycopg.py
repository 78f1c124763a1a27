"""The fence for a host's psycopg 3 ``Connection``.

Outside a transaction the block's ``BEGIN`` and the fence's epoch read go to the server as one
simple query (one round trip instead of two), with the read's parameters inlined as literals;
the ``COMMIT`` carries a check that the transaction the block began is still the one open (a
host that committed or rolled back inside the block is refused at the end, and what it ran after
that is rolled back, not committed unfenced). Inside a transaction already open (also the
implicit one of a non-autocommit connection that ran a statement), and in pipeline mode,
psycopg's own transaction block is used instead: a savepoint, committed or rolled back exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

import psycopg
from psycopg import errors, pq
from psycopg.rows import tuple_row

from ..storage.fence_target import FenceBinding
from .base import inline_literal

__all__ = ["PsycopgTransaction"]

_IDLE: Final = pq.TransactionStatus.IDLE
_PIPELINE_OFF: Final = pq.PipelineStatus.OFF
_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_COMMAND_OK: Final = pq.ExecStatus.COMMAND_OK
_DIVISION_BY_ZERO: Final = b"22012"

# A transaction-local setting made by the block's own BEGIN: gone once that transaction ends.
_MARK: Final = "SELECT set_config('weft_sync.fenced', '1', true)"
_CHECKED_COMMIT: Final = (
    b"SELECT 1 / coalesce((current_setting('weft_sync.fenced', true) = '1')::int, 0); COMMIT"
)


class PsycopgTransaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a psycopg 3 connection."""

    family = "postgresql"

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self._conn = connection
        self._tx: AbstractContextManager[psycopg.Transaction] | None = None
        self._own = False  # the block began the transaction with begin_reading()

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

    def begin_reading(
        self, binding: FenceBinding, params: Sequence[str]
    ) -> list[tuple[Any, ...]] | None:
        """``BEGIN`` and the read in one round trip, or ``None`` (then :meth:`begin` is used)
        when a transaction is already open or the connection is in pipeline mode."""
        conn = self._conn
        pgconn = conn.pgconn
        parts = binding.read_epoch_parts
        if (
            parts is None
            or binding.recheck is not None
            or pgconn.transaction_status != _IDLE
            or pgconn.pipeline_status != _PIPELINE_OFF
        ):
            return None
        read = inline_literal(parts, params)
        if read is None:
            return None
        command = f"{_begin_command(conn)}; {_MARK}; {read}".encode("ascii")
        with conn.lock:
            result = pgconn.exec_(command)
        self._own = pgconn.transaction_status != _IDLE
        if result.status != _TUPLES_OK:
            raise errors.error_from_result(result, encoding=conn.info.encoding)
        if result.ntuples == 0:
            return []
        raw = result.get_value(0, 0)
        return [(None if raw is None else pq.Escaping(pgconn).unescape_bytea(raw),)]

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        # Tuples whatever row factory the host set; no parameters: several statements may go
        # in one round trip.
        cur = self._conn.cursor(row_factory=tuple_row)
        cur.execute(sql, params or None)
        if cur.description is None and self._conn.pgconn.pipeline_status != _PIPELINE_OFF:
            # In pipeline mode the result is not in yet: fetching syncs the pipeline (every
            # statement the fence sends through here returns rows).
            return cur.fetchall()
        return cur.fetchall() if cur.description else []

    def end(self, error: BaseException | None) -> None:
        if self._own:
            self._own = False
            self._end_own(error)
            return
        tx, self._tx = self._tx, None
        if tx is None:
            return
        if error is None:
            tx.__exit__(None, None, None)
        else:
            tx.__exit__(type(error), error, error.__traceback__)

    def _end_own(self, error: BaseException | None) -> None:
        conn = self._conn
        pgconn = conn.pgconn
        if error is not None:
            if pgconn.transaction_status != _IDLE:
                conn.rollback()
            return
        if pgconn.transaction_status == _IDLE:
            raise psycopg.ProgrammingError(_ENDED_INSIDE)
        with conn.lock:
            result = pgconn.exec_(_CHECKED_COMMIT)
        if result.status == _COMMAND_OK:
            return
        failure = errors.error_from_result(result, encoding=conn.info.encoding)
        if pgconn.transaction_status != _IDLE:
            conn.rollback()  # the check failed: the COMMIT after it did not run
        if result.error_field(pq.DiagnosticField.SQLSTATE) == _DIVISION_BY_ZERO:
            raise psycopg.ProgrammingError(_ENDED_INSIDE) from failure
        raise failure


_ENDED_INSIDE: Final = (
    "the fenced transaction was ended inside the block (commit() or rollback() on the "
    "connection); what ran after that point was rolled back, not committed unfenced"
)


def _begin_command(conn: psycopg.Connection[Any]) -> str:
    """The ``BEGIN`` psycopg itself would send for ``conn``'s transaction characteristics."""
    if conn.isolation_level is None and conn.read_only is None and conn.deferrable is None:
        return "BEGIN"
    parts = ["BEGIN"]
    if conn.isolation_level is not None:
        level = psycopg.IsolationLevel(conn.isolation_level)
        parts.append("ISOLATION LEVEL " + level.name.replace("_", " "))
    if conn.read_only is not None:
        parts.append("READ ONLY" if conn.read_only else "READ WRITE")
    if conn.deferrable is not None:
        parts.append("DEFERRABLE" if conn.deferrable else "NOT DEFERRABLE")
    return " ".join(parts)
