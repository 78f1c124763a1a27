"""The fence for a host's SQLAlchemy ``Connection`` or ORM ``Session``.

The block uses SQLAlchemy's own transaction objects: ``begin()`` when none is open,
``begin_nested()`` (a savepoint) inside one. A ``Session`` block commits through the session, so
pending ORM changes are flushed inside the fenced transaction. On SQLite the DBAPI connection
gets ``BEGIN IMMEDIATE`` when SQLAlchemy's ``begin()`` did not start a database transaction
itself (pysqlite's default); otherwise, and in a savepoint, the write lock is taken by the fence
with a no-op ``UPDATE`` of the epoch row.

A host that ends the block's transaction inside it (``connection.commit()``,
``session.commit()``, a rollback) leaves SQLAlchemy's transaction object of the block inactive,
and its next statement begins another transaction. The block never commits that one: the
fence's end check refuses it on PostgreSQL (the mark is gone) and on SQLite when the epoch
changed, and the block's end rolls back whatever is open and raises ``StorageError`` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from sqlalchemy.engine import Connection, RootTransaction
from sqlalchemy.engine.base import NestedTransaction
from sqlalchemy.orm import Session, SessionTransaction

from .base import ended_inside
from .wrapped import as_psycopg


def _dialect_family(connection: Connection) -> str:
    return str(connection.dialect.name)


def _begin_immediate(connection: Connection) -> bool:
    """Start SQLite's write transaction on the DBAPI connection unless one is open already."""
    dbapi = connection.connection.dbapi_connection
    if dbapi is None or getattr(dbapi, "in_transaction", True):
        return False
    dbapi.execute("BEGIN IMMEDIATE")
    return True


def _refuse_autocommit(connection: Connection) -> None:
    """Refuse a PostgreSQL connection whose driver commits every statement on its own.

    Under ``isolation_level="AUTOCOMMIT"`` SQLAlchemy's ``begin()`` sends no ``BEGIN``: the epoch
    row's lock would end with the statement that took it.
    """
    dbapi = connection.connection.dbapi_connection
    if getattr(dbapi, "autocommit", False) is True:
        raise ValueError(
            "cannot fence a SQLAlchemy connection with isolation_level='AUTOCOMMIT': its "
            "statements commit one by one, so the fence's lock would not cover them; use a "
            "connection without AUTOCOMMIT (e.g. engine.connect() on a default engine)"
        )


class _Transaction(Protocol):
    """What the block needs of SQLAlchemy's transaction objects (root, nested, session)."""

    @property
    def is_active(self) -> bool: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...


def _end(tx: _Transaction, owner: Connection | Session, error: BaseException | None) -> None:
    """Commit ``tx`` (roll it back on ``error``); when the host ended it inside the block, roll
    back what ``owner`` (the connection or session) began after that, and refuse the block."""
    if tx.is_active:
        if error is None:
            tx.commit()
        else:
            tx.rollback()
        return
    if owner.in_transaction():
        owner.rollback()
    if error is None:
        raise ended_inside()


def _query(connection: Connection, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
    # On psycopg 3, on the driver connection itself: never prepared (see fencing.psycopg).
    inner = as_psycopg(connection.connection.dbapi_connection)
    if inner is not None:
        return inner.query(sql, params)
    result = connection.exec_driver_sql(sql, tuple(params) if params else None)
    return [tuple(row) for row in result.fetchall()] if result.returns_rows else []


class ConnectionTransaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a SQLAlchemy ``Connection``."""

    def __init__(self, connection: Connection) -> None:
        self._conn = connection
        self.family = _dialect_family(connection)
        self._tx: RootTransaction | NestedTransaction | None = None

    @property
    def connection_key(self) -> object | None:
        return self._conn.connection.dbapi_connection

    @property
    def result(self) -> Connection:
        return self._conn

    def begin(self) -> bool:
        if self.family == "postgresql":
            _refuse_autocommit(self._conn)
        if self._conn.in_transaction():
            self._tx = self._conn.begin_nested()
            return self.family != "sqlite"
        self._tx = self._conn.begin()
        return self.family != "sqlite" or _begin_immediate(self._conn)

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        return _query(self._conn, sql, params)

    def end(self, error: BaseException | None) -> None:
        assert self._tx is not None
        _end(self._tx, self._conn, error)


class SessionTransactionAdapter:
    """A :class:`~weft_sync.fencing.base.HostTransaction` over a SQLAlchemy ORM ``Session``."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._tx: SessionTransaction | None = None
        # get_bind(), not connection(): that would begin the session's transaction already.
        self.family = str(session.get_bind().dialect.name)

    @property
    def connection_key(self) -> object | None:
        return self._session.connection().connection.dbapi_connection

    @property
    def result(self) -> Session:
        return self._session

    def begin(self) -> bool:
        nested = self._session.in_transaction()
        tx = self._session.begin_nested() if nested else self._session.begin()
        if self.family == "postgresql":
            try:
                _refuse_autocommit(self._session.connection())
            except ValueError:
                tx.rollback()
                raise
        self._tx = tx
        if self.family != "sqlite":
            return True
        return not nested and _begin_immediate(self._session.connection())

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        return _query(self._session.connection(), sql, params)

    def end(self, error: BaseException | None) -> None:
        assert self._tx is not None
        _end(self._tx, self._session, error)
