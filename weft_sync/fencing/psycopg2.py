"""The fence for a host's psycopg2 connection: ``BEGIN`` (or psycopg2's own), or a savepoint.

A connection with no transaction open begins one (an explicit ``BEGIN`` in autocommit mode,
psycopg2's implicit one otherwise) and ends it with ``COMMIT`` or ``ROLLBACK``; inside an open
transaction the block is a savepoint. psycopg2 binds parameters itself and sends each
``execute`` as one simple query, so on a proven connection in autocommit mode the explicit
``BEGIN`` and the epoch read go together, and so do the end check and ``COMMIT``
(``FenceBinding.commit_checked``): a proven block is two round trips plus the host's
statements. psycopg2's implicit ``BEGIN`` always goes alone, and its transaction must end with
``connection.commit()`` (psycopg2 keeps its own transaction state), so there the end check is
a round trip of its own: four.

psycopg2 does not refuse a ``commit()`` inside the block. In autocommit mode its ``commit()``
does nothing (the block's ``BEGIN`` is the server's, not psycopg2's): the fence still holds.
Otherwise it ends the block's transaction, and the end check refuses to commit the one the
host's next statement begins. A ``COMMIT`` statement ends the transaction behind psycopg2's
back: its next statements run outside any transaction, each committed by the server as it
runs, which no fence can undo; the block still raises at its end.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import psycopg2.errors
import psycopg2.extensions

from ..storage.fence_proof import FenceBinding
from .base import FindBinding, ended_inside, savepoint_name

_log = logging.getLogger(__name__)

_IDLE = psycopg2.extensions.TRANSACTION_STATUS_IDLE


class Psycopg2Transaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a psycopg2 connection."""

    family = "postgresql"

    def __init__(self, connection: psycopg2.extensions.connection) -> None:
        self._conn = connection
        self._savepoint: str | None = None
        self._explicit = False

    @property
    def connection_key(self) -> object:
        return self._conn

    @property
    def result(self) -> psycopg2.extensions.connection:
        return self._conn

    def begin(self) -> bool:
        status = self._conn.get_transaction_status()
        if status == _IDLE:
            if self._conn.autocommit:
                self._explicit = True
                self.query("BEGIN", ())
        else:
            self._savepoint = savepoint_name()
            self.query(f"SAVEPOINT {self._savepoint}", ())
        return True

    def begin_reading(
        self, find: FindBinding, params: Sequence[str]
    ) -> list[tuple[Any, ...]] | None:
        """In autocommit mode outside a transaction, on a proven connection: ``BEGIN`` and the
        epoch read as one query; ``None`` (nothing sent) otherwise."""
        conn = self._conn
        if not conn.autocommit or conn.get_transaction_status() != _IDLE:
            return None
        binding = find(conn)
        if binding is None or binding.recheck is not None:
            return None
        self._explicit = True
        return self.query("BEGIN; " + binding.read_epoch, params)

    def commit_checked(self, binding: FenceBinding, workflow_id: str) -> bool:
        """After an explicit ``BEGIN``: the end check and ``COMMIT`` as one query; ``False``
        (nothing sent) otherwise."""
        if not self._explicit or binding.commit_checked is None:
            return False
        try:
            self.query(binding.commit_checked, ())
        except psycopg2.errors.DivisionByZero:
            self._rollback_quietly()
            raise ended_inside(workflow_id) from None
        except BaseException:
            self._rollback_quietly()
            raise
        return True

    def _rollback_quietly(self) -> None:
        try:
            self.query("ROLLBACK", ())
        except Exception:
            # The error that ended the block is the one the host needs to see.
            _log.warning("could not roll back a fenced host transaction", exc_info=True)

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        # A plain cursor: the host's cursor_factory (e.g. RealDictCursor) would change the rows.
        with self._conn.cursor(cursor_factory=psycopg2.extensions.cursor) as cur:
            cur.execute(sql, tuple(params) if params else None)
            return [tuple(row) for row in cur.fetchall()] if cur.description else []

    def end(self, error: BaseException | None) -> None:
        if self._savepoint is not None:
            if error is not None:
                self.query(f"ROLLBACK TO SAVEPOINT {self._savepoint}", ())
            self.query(f"RELEASE SAVEPOINT {self._savepoint}", ())
        elif self._explicit:
            self.query("COMMIT" if error is None else "ROLLBACK", ())
        elif error is None:
            self._conn.commit()
        else:
            self._conn.rollback()
