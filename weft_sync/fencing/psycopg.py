"""The fence for a host's psycopg 3 ``Connection``.

Outside a transaction the block's ``BEGIN`` and the fence's epoch read go to the server as one
simple query: one round trip instead of two. The read runs as a statement the fence prepares in
the connection's session the first time (``PREPARE`` in that same query, after the ``BEGIN``),
so the server neither parses nor plans it again. Where the statement is gone (``DEALLOCATE``,
``DISCARD ALL`` by a pool or a proxy between transactions) the read fails before anything of
the block ran: the transaction is rolled back, the session is asked what it has prepared, and
the block tries once more. The ``COMMIT`` carries a check that the transaction the block began
is still the one open, so a host that committed or rolled back inside the block is refused at
the end, and what it ran after that is rolled back, not committed unfenced. Inside a
transaction already open (also the implicit one of a non-autocommit connection that ran a
statement), and in pipeline mode, psycopg's own transaction block is used instead: a
savepoint, committed or rolled back exactly.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

import psycopg
from psycopg import errors, pq
from psycopg.rows import tuple_row

from ..storage.fence_target import PG_FENCE_MARK
from .base import FindBinding, inline_literal

__all__ = ["PsycopgTransaction"]

_IDLE: Final = pq.TransactionStatus.IDLE
_PIPELINE_OFF: Final = pq.PipelineStatus.OFF
_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_COMMAND_OK: Final = pq.ExecStatus.COMMAND_OK
_DIVISION_BY_ZERO: Final = b"22012"
_NO_SUCH_STATEMENT: Final = b"26000"
_DUPLICATE_STATEMENT: Final = b"42P05"
_SQLSTATE: Final = pq.DiagnosticField.SQLSTATE

# Whether the transaction the block began is still open at its end: the epoch read sets this
# transaction-local mark, so a host that committed inside the block makes the division fail.
_CHECKED_COMMIT: Final = (
    f"SELECT 1 / coalesce((current_setting('{PG_FENCE_MARK}', true) = '1')::int, 0); COMMIT"
).encode("ascii")

# Guards _PREPARED: per connection, the fence statements prepared in its session.
_prepared_lock = threading.Lock()
_PREPARED: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[str]] = (
    weakref.WeakKeyDictionary()
)


@functools.lru_cache(maxsize=64)
def _prepared_form(parts: tuple[str, ...]) -> tuple[str, str]:
    """The name and the ``PREPARE`` of the read whose text is ``parts`` joined around
    ``$1``, ``$2``, …; the name derives from the text, so a statement of that name in any
    session is this one."""
    body = parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], start=1))
    name = "weft_sync_fence_" + hashlib.blake2b(body.encode(), digest_size=8).hexdigest()
    types = ", ".join("text" for _ in parts[1:])
    return name, f"PREPARE {name}({types}) AS {body}"


def _missing(conn: psycopg.Connection[Any], name: str) -> bool:
    """Whether the read ``name`` still needs a ``PREPARE`` on ``conn``."""
    with _prepared_lock:
        return name not in _PREPARED.get(conn, ())


@functools.lru_cache(maxsize=1024)
def _command(
    parts: tuple[str, ...], params: tuple[str, ...], begin: str, prepare: bool
) -> bytes | None:
    """The block's first query: ``begin``, the read's ``PREPARE`` when asked, and the read of
    ``params``; ``None`` when a parameter cannot be inlined. A host fences the same few
    workflows over and over, so the query is built once per workflow."""
    args = inline_literal(("(", *(", " for _ in params[1:]), ")"), params)
    if args is None:
        return None
    name, statement = _prepared_form(parts)
    # PREPARE after BEGIN: before it, the isolation level would be too late to set. A
    # prepared statement outlives a rollback of the transaction it was made in.
    prepared = [statement] if prepare else []
    return "; ".join([begin, *prepared, f"EXECUTE {name}{args}"]).encode("ascii")


def _set_prepared(conn: psycopg.Connection[Any], name: str) -> None:
    with _prepared_lock:
        _PREPARED.setdefault(conn, set()).add(name)


def _learn_prepared(conn: psycopg.Connection[Any], name: str) -> None:
    """Ask the session whether it has the read ``name`` prepared, and remember the answer.

    Outside a transaction (a statement of its own, whatever the connection's autocommit).
    """
    # A name of our own making: plain ASCII, no quotes.
    sql = f"SELECT 1 FROM pg_prepared_statements WHERE name = '{name}'"
    with conn.lock:
        result = conn.pgconn.exec_(sql.encode("ascii"))
    if result.status != _TUPLES_OK:
        raise errors.error_from_result(result, encoding=conn.info.encoding)
    with _prepared_lock:
        known = _PREPARED.setdefault(conn, set())
        if result.ntuples:
            known.add(name)
        else:
            known.discard(name)


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
        self, find: FindBinding, params: Sequence[str]
    ) -> list[tuple[Any, ...]] | None:
        """``BEGIN`` and the read in one round trip, or ``None`` (then :meth:`begin` is used)
        when the connection is not proven yet, a transaction is already open or the
        connection is in pipeline mode."""
        conn = self._conn
        binding = find(conn)
        if binding is None:
            return None
        pgconn = conn.pgconn
        parts = binding.read_epoch_parts
        if (
            parts is None
            or binding.recheck is not None
            or pgconn.transaction_status != _IDLE
            or pgconn.pipeline_status != _PIPELINE_OFF
        ):
            return None
        name = _prepared_form(parts)[0]
        begin = _begin_command(conn)
        for _attempt in range(2):
            missing = _missing(conn, name)
            command = _command(parts, tuple(params), begin, missing)
            if command is None:
                return None  # a parameter that is not inlined as a literal
            with conn.lock:
                result = pgconn.exec_(command)
            began = pgconn.transaction_status != _IDLE
            code = None if result.status == _TUPLES_OK else result.error_field(_SQLSTATE)
            if code in (_DUPLICATE_STATEMENT, _NO_SUCH_STATEMENT):
                # What this session has prepared is not what the fence remembers (another
                # block prepared it, or it was deallocated): nothing of the block ran yet.
                if began:
                    conn.rollback()
                _learn_prepared(conn, name)
                continue
            self._own = began
            if code is not None:
                raise errors.error_from_result(result, encoding=conn.info.encoding)
            if missing:
                _set_prepared(conn, name)
            if result.ntuples == 0:
                return []
            raw = result.get_value(0, 0)
            return [(None if raw is None else pq.Escaping(pgconn).unescape_bytea(raw),)]
        return None

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
        if result.error_field(_SQLSTATE) == _DIVISION_BY_ZERO:
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
