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

The host must not commit or roll back the connection inside the block. A block whose
transaction the host ended finds no transaction open at its end and raises ``StorageError``
(``_ended_inside``), or finds the one the host's next write began, in which case it re-reads the
epoch first (under that transaction's write lock, taken by the write) and commits it only while
the epoch is still this engine's, else rolls back and raises ``EngineDeposedError``. A savepoint
block whose savepoint the host's commit ended rolls back what is open and raises
``StorageError``. Every block re-reads the epoch just before its ``COMMIT``
(``FenceBinding.end_check``): one statement, no round trip.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from ..errors import StorageError, StoreIdentityError
from .base import FenceContext, FindBinding, first_value, savepoint_name

_log = logging.getLogger(__name__)

# Python 3.12+ only; before it every connection is in the legacy transaction mode.
_HAS_AUTOCOMMIT = hasattr(sqlite3.Connection, "autocommit")


class Sqlite3Block:
    """The fenced block on a ``sqlite3.Connection`` in its usual case, with nothing in between.

    The usual case: no transaction open, the module not managing transactions, and a binding
    proven before. Then the block is ``BEGIN IMMEDIATE``, the re-check
    (``FenceBinding.recheck``, ``PRAGMA database_list``), the epoch read and the comparison on
    entry, and ``COMMIT`` (``ROLLBACK`` on an exception) on exit — the generic block's steps
    for this case, in one frame. Every other case, and a re-check that fails, is handed to the
    generic block before anything of the block ran, which proves the connection afresh.
    """

    __slots__ = (
        "_check",
        "_conn",
        "_cursor",
        "_expected",
        "_fence",
        "_generic",
        "_params",
        "_store_check",
        "_wid",
    )

    def __init__(self, fence: FenceContext, workflow_id: str, connection: sqlite3.Connection):
        self._fence = fence
        self._wid = workflow_id
        self._conn = connection
        self._cursor: sqlite3.Cursor | None = None
        self._generic: AbstractContextManager[object] | None = None
        self._check = ""
        self._store_check: Callable[[], None] | None = None
        self._params: tuple[str, ...] = ()
        self._expected: bytes | None = None

    def __enter__(self) -> sqlite3.Connection:
        fence, wid, conn = self._fence, self._wid, self._conn
        binding = fence.hint
        if binding is None or binding.recheck is None or binding.confirm is None:
            return self._hand_over()
        if not _can_begin(conn):
            return self._hand_over()
        expected = fence.epoch_of(wid)  # validates the id
        if expected is None:
            fence.deposed(wid)
        params = fence.read_params(wid)
        cursor = conn.cursor()
        try:
            cursor.execute("BEGIN IMMEDIATE")
        except Exception as exc:
            raise fence.failed(wid, exc) from exc
        try:
            still = binding.confirm(cursor.execute(binding.recheck).fetchall())
            row = cursor.execute(binding.read_epoch, params).fetchone() if still else None
        except Exception as exc:
            _rollback_quietly(conn, cursor)
            raise fence.failed(wid, exc) from exc
        if not still:
            _rollback_quietly(conn, cursor)
            return self._hand_over()
        if first_value(row) != expected:
            _rollback_quietly(conn, cursor)
            fence.deposed(wid)
        self._cursor = cursor
        self._check = binding.end_check
        self._store_check = binding.store_check
        self._params = params
        self._expected = expected
        return conn

    def _hand_over(self) -> sqlite3.Connection:
        generic = self._generic = self._fence.generic_block(self._wid, self._conn)
        generic.__enter__()
        return self._conn

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        generic, self._generic = self._generic, None
        if generic is not None:
            generic.__exit__(exc_type, exc, tb)
            return
        cursor, self._cursor = self._cursor, None
        if cursor is None:
            return
        conn = self._conn
        if exc is not None:
            _rollback_quietly(conn, cursor)
            return
        if not conn.in_transaction:
            raise _ended_inside()
        # The host may have committed inside the block and begun another transaction: commit
        # only while the epoch is still this engine's, read under that transaction's write lock.
        try:
            row = cursor.execute(self._check, self._params).fetchone()
        except BaseException:
            _rollback_quietly(conn, cursor)
            raise
        observed = first_value(row)
        if observed != self._expected:
            _rollback_quietly(conn, cursor)
            self._fence.end_refused(self._wid, self._expected, observed)
        store_check = self._store_check
        if store_check is not None:
            try:
                store_check()
            except StoreIdentityError as replaced:
                _rollback_quietly(conn, cursor)
                self._fence.store_replaced(self._wid, replaced)
        cursor.execute("COMMIT")


class Sqlite3Transaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a ``sqlite3.Connection``."""

    __slots__ = ("_conn", "_cursor", "_savepoint")

    family = "sqlite"
    fast_block = Sqlite3Block
    # sqlite3.Connection takes no weak references: the last proof is only a guess, re-checked
    # by every block (FenceBinding.recheck).
    connection_key = None

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._conn = connection
        self._savepoint: str | None = None
        # Set by begin_reading(): the cursor that began the transaction, and ends it.
        self._cursor: sqlite3.Cursor | None = None

    @property
    def result(self) -> sqlite3.Connection:
        return self._conn

    def _module_managed(self) -> bool:
        # Python 3.12+: autocommit False means the module owns BEGIN/COMMIT on this connection.
        return _HAS_AUTOCOMMIT and _managed(self._conn)

    def begin_reading(
        self, find: FindBinding, params: Sequence[str]
    ) -> list[tuple[Any, ...]] | None:
        """``BEGIN IMMEDIATE``, the binding's re-check and the epoch read in one call; ``None``
        (nothing begun) inside an open transaction, where the module owns the transaction, or
        when the re-check finds the connection no longer on the proven file."""
        conn = self._conn
        binding = find(None)
        if binding is None or conn.in_transaction or (_HAS_AUTOCOMMIT and self._module_managed()):
            return None
        # One cursor for the block's own statements: conn.execute() makes one per statement.
        cursor = conn.cursor()
        cursor.execute("BEGIN IMMEDIATE")
        self._cursor = cursor
        if binding.recheck is not None and binding.confirm is not None:
            still = binding.confirm(cursor.execute(binding.recheck).fetchall())
        else:
            still = True
        if not still:
            self._cursor = None
            cursor.execute("ROLLBACK")
            return None
        row = cursor.execute(binding.read_epoch, params).fetchone()
        return [] if row is None else [row]

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
        try:
            open_now = conn.in_transaction
        except sqlite3.ProgrammingError:
            if error is None:
                raise
            return  # closed: SQLite rolled back whatever was open
        cursor = self._cursor
        if cursor is not None:
            if open_now:
                cursor.execute("COMMIT" if error is None else "ROLLBACK")
            elif error is None:
                raise _ended_inside()
            return
        if self._savepoint is not None:
            if not open_now:
                if error is None:
                    raise _ended_inside()
                return  # SQLite rolled the whole transaction back (e.g. SQLITE_FULL)
            try:
                if error is not None:
                    conn.execute(f"ROLLBACK TO {self._savepoint}")
                conn.execute(f"RELEASE {self._savepoint}")
            except sqlite3.OperationalError:
                # No such savepoint: the host ended its transaction inside the block, and what
                # is open began after that, outside the fence.
                _rollback_quietly(conn, conn.cursor())
                if error is None:
                    raise _ended_inside() from None
        elif self._module_managed():
            if error is None:
                conn.commit()
            else:
                conn.rollback()
        elif open_now:
            conn.execute("COMMIT" if error is None else "ROLLBACK")
        elif error is None:
            raise _ended_inside()


def _ended_inside() -> StorageError:
    return StorageError(
        "the fenced transaction was ended inside the block (commit(), rollback() or a COMMIT "
        "or ROLLBACK statement on the connection); what ran after that point was not fenced "
        "(with isolation_level=None SQLite committed each of those statements as it ran)"
    )


def _can_begin(conn: sqlite3.Connection) -> bool:
    """Whether a block may begin its own transaction on ``conn``: none open, and the module not
    managing them. ``False`` for a closed connection: the generic block reports that."""
    try:
        return not conn.in_transaction and not (_HAS_AUTOCOMMIT and _managed(conn))
    except sqlite3.ProgrammingError:
        return False


def _managed(conn: sqlite3.Connection) -> bool:
    return getattr(conn, "autocommit", None) is False


def _rollback_quietly(conn: sqlite3.Connection, cursor: sqlite3.Cursor) -> None:
    try:
        if conn.in_transaction:
            cursor.execute("ROLLBACK")
    except Exception:
        # The error that ended the block is the one the host needs to see.
        _log.warning("could not roll back a fenced host transaction", exc_info=True)
