"""The fence for a host's psycopg 3 ``Connection``: psycopg's transaction, ended by the fence.

A connection the fence proved before, outside autocommit mode, with no transaction open and no
pipeline (:class:`PsycopgBlock`), runs the block in psycopg's implicit transaction: the epoch
read, which psycopg precedes with its ``BEGIN`` (the connection's isolation level, read-only and
deferrable, as its transaction block's), the host's statements, then the end check and
``COMMIT`` as one simple query (``FenceBinding.commit_checked``; no parameters, so psycopg sends
it unprepared with the simple protocol, which takes several statements), or
``connection.rollback()`` on an exception. psycopg takes the transaction status from libpq (its
own bookkeeping is only of ``connection.transaction()`` blocks and two-phase transactions,
neither used here), so afterwards it sees an idle connection, as after its own ``commit()``.
A proven block is therefore ``BEGIN``, the read, the host's statements and the check with
``COMMIT``: one round trip more than the same block unfenced. psycopg allows a host's
``commit()`` or ``rollback()`` there: it ends the block's transaction, and the end check
refuses to commit the one the host's next statement begins (rolled back, ``StorageError``).

Everywhere else the block is ``connection.transaction()``: in autocommit mode (a ``BEGIN`` of its
own; there a ``commit()`` ending an explicit ``BEGIN`` would leave the host's later statements to
commit one by one, out of any fence's reach, and psycopg refuses a ``commit()`` or ``rollback()``
inside its transaction block), inside an open transaction or in pipeline mode (a savepoint), and
on the first block of a connection (the generic block, which proves it). psycopg commits that
block with a ``COMMIT`` of its own, so the end check (``FenceBinding.end_check``) goes before it
as a round trip of its own: two round trips more than the block unfenced.

psycopg does not see a ``COMMIT`` statement the host sends inside the block (its next statement
begins psycopg's implicit transaction, or runs on its own in autocommit mode): the end check
refuses to commit what follows, and cannot take back a statement that ran on its own. The
fence's statements run with ``prepare=False``, so that no prepared statement is left in the
host's session (psycopg prepares a query on its own once it ran ``prepare_threshold`` times, and
a prepared statement breaks behind a transaction-mode pooler); the settings the epoch read makes
are transaction-local (``set_config(…, true)``). Parameters are bound by psycopg.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from ..errors import EngineDeposedError
from .base import FenceContext, ended_inside, first_value

_log = logging.getLogger(__name__)

_PIPELINE_OFF = psycopg.pq.PipelineStatus.OFF
_IDLE = psycopg.pq.TransactionStatus.IDLE


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
        if cur.description is None and conn.info.pipeline_status != _PIPELINE_OFF:
            return cur.fetchall()
        return cur.fetchall() if cur.description else []


class PsycopgBlock:
    """The fenced block on a proven psycopg 3 connection, with nothing in between.

    The generic block's steps for a connection proven before, in one frame. Outside autocommit
    mode, with no transaction open and no pipeline: the epoch read (never prepared), which
    psycopg precedes with its implicit ``BEGIN``, and the comparison on entry; the end check
    and ``COMMIT`` as one query (``FenceBinding.commit_checked``), or ``rollback()`` on an
    exception, on exit. Otherwise psycopg's transaction block, with the end check a query of
    its own before the block's ``COMMIT``. A connection not proven yet (or whose binding asks
    for a re-check) is handed to the generic block before anything was sent, which proves it.
    """

    __slots__ = (
        "_check",
        "_commit",
        "_conn",
        "_expected",
        "_fence",
        "_generic",
        "_implicit",
        "_tx",
        "_wid",
    )

    def __init__(
        self, fence: FenceContext, workflow_id: str, connection: psycopg.Connection[Any]
    ) -> None:
        self._fence = fence
        self._wid = workflow_id
        self._conn = connection
        self._tx: AbstractContextManager[psycopg.Transaction] | None = None
        self._generic: AbstractContextManager[object] | None = None
        self._implicit = False  # the block is psycopg's implicit transaction, not tx
        self._check = ""
        self._commit = ""
        self._expected: bytes | None = None

    def __enter__(self) -> psycopg.Connection[Any]:
        fence, wid, conn = self._fence, self._wid, self._conn
        binding = fence.proof_for(conn)
        if binding is None or binding.recheck is not None:
            generic = self._generic = fence.generic_block(wid, conn)
            generic.__enter__()
            return conn
        expected = fence.epoch_of(wid)  # validates the id
        if expected is None:
            fence.deposed(wid)
        params = fence.read_params(wid)
        info = conn.info
        # psycopg's commit() and rollback() end an explicit BEGIN in autocommit mode, after
        # which the host's statements commit on their own: there psycopg's transaction block
        # (which refuses them) stays. Outside it, what such a call begins the end check refuses.
        if (
            binding.commit_checked is not None
            and not conn.autocommit
            and info.transaction_status == _IDLE
            and info.pipeline_status == _PIPELINE_OFF
        ):
            row = self._begin_reading(binding.read_epoch, params)
            self._implicit = True
            self._commit = binding.commit_checked
        else:
            row = self._enter_transaction(binding.read_epoch, params)
        observed = first_value(row)
        if observed != expected:
            self._abandon(EngineDeposedError(wid))
            fence.deposed(wid, expected, observed)
        self._check = binding.end_check
        self._expected = expected
        return conn

    def _begin_reading(self, read_epoch: str, params: Sequence[str]) -> tuple[Any, ...] | None:
        """The epoch read, which psycopg precedes with its implicit ``BEGIN`` (the
        connection's isolation level, read-only and deferrable, as its transaction block's)."""
        conn = self._conn
        try:
            with conn.cursor(row_factory=tuple_row) as cur:
                cur.execute(read_epoch, params, prepare=False)
                return cur.fetchone()
        except BaseException as exc:
            _rollback_quietly(conn)
            if isinstance(exc, Exception):
                raise self._fence.failed(self._wid, exc) from exc
            raise

    def _enter_transaction(self, read_epoch: str, params: Sequence[str]) -> tuple[Any, ...] | None:
        """psycopg's transaction block (``BEGIN`` alone, or a savepoint), then the epoch read."""
        conn = self._conn
        tx = conn.transaction()
        try:
            tx.__enter__()
        except Exception as exc:
            raise self._fence.failed(self._wid, exc) from exc
        try:
            with conn.cursor(row_factory=tuple_row) as cur:
                cur.execute(read_epoch, params, prepare=False)
                row = cur.fetchone()  # in pipeline mode, fetching syncs the pipeline
        except BaseException as exc:
            _exit_quietly(tx, exc)
            if isinstance(exc, Exception):
                raise self._fence.failed(self._wid, exc) from exc
            raise
        self._tx = tx
        return row

    def _abandon(self, error: BaseException) -> None:
        """Roll back what the block began, logging (not raising) a failure to."""
        tx, self._tx = self._tx, None
        implicit, self._implicit = self._implicit, False
        if tx is not None:
            _exit_quietly(tx, error)
        elif implicit:
            _rollback_quietly(self._conn)

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
        if exc is not None:
            self._abandon(exc)
            return
        if self._implicit:
            self._implicit = False
            self._commit_checked()
            return
        tx, self._tx = self._tx, None
        if tx is None:
            return
        # psycopg refuses a commit() inside its block, not a COMMIT statement: check that the
        # transaction is still the one the block began (FenceBinding.end_check).
        fence, wid = self._fence, self._wid
        try:
            with self._conn.cursor(row_factory=tuple_row) as cur:
                cur.execute(self._check, fence.read_params(wid)[:1], prepare=False)
                row = cur.fetchone()
        except BaseException as error:
            _exit_quietly(tx, error)
            raise
        observed = first_value(row)
        if observed != self._expected:
            _exit_quietly(tx, EngineDeposedError(wid))
            fence.end_refused(wid, self._expected, observed)
        tx.__exit__(None, None, None)

    def _commit_checked(self) -> None:
        """The end check and ``COMMIT`` as one simple query (no parameters): psycopg then sees
        the connection idle, as after its own ``commit()``.

        :raises StorageError: the host ended the block's transaction inside it; rolled back.
        :raises Exception: the driver's error when the check or the commit failed (an aborted
            transaction: the host's own error, swallowed); rolled back.
        """
        conn = self._conn
        if conn.info.transaction_status == _IDLE:
            raise ended_inside(self._wid)  # the host's commit() or rollback(): nothing is open
        try:
            with conn.cursor(row_factory=tuple_row) as cur:
                cur.execute(self._commit, prepare=False)
        except psycopg.errors.DivisionByZero:
            _rollback_quietly(conn)
            raise ended_inside(self._wid) from None
        except BaseException:
            _rollback_quietly(conn)
            raise


def _rollback_quietly(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.rollback()
    except Exception:
        # The error that ended the block is the one the host needs to see.
        _log.warning("could not roll back a fenced host transaction", exc_info=True)


def _exit_quietly(tx: AbstractContextManager[psycopg.Transaction], error: BaseException) -> None:
    try:
        tx.__exit__(type(error), error, error.__traceback__)
    except Exception:
        # The error that ended the block is the one the host needs to see.
        _log.warning("could not roll back a fenced host transaction", exc_info=True)


class PsycopgTransaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a psycopg 3 connection."""

    family = "postgresql"
    fast_block = PsycopgBlock

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
