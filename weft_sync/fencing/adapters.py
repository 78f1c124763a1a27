"""Which :class:`~weft_sync.fencing.base.HostTransaction` fits a host's connection object.

A driver's adapter is imported only when the host has imported the driver: a connection of a
driver that is not loaded cannot exist, so nothing here imports psycopg, psycopg2 or SQLAlchemy
on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

from .base import FastBlockFactory, HostTransaction

ACCEPTED: Final = (
    "sqlite3.Connection",
    "psycopg.Connection",
    "psycopg2 connection",
    "sqlalchemy.engine.Connection",
    "sqlalchemy.orm.Session",
)


# Exact connection type -> adapter class, filled as types are first seen (a dict lookup per
# block instead of the isinstance chain below). Guarded by the GIL: entries are only added.
_BY_TYPE: dict[type, Callable[[Any], HostTransaction]] = {}
# Exact connection type -> its family's fast block (an adapter's ``fast_block``), filled the
# same way: a type's first block is generic. Guarded by the GIL: entries are only added.
FAST_BLOCKS: dict[type, FastBlockFactory] = {}


def adapt(connection: object) -> HostTransaction:
    """Wrap ``connection`` for one fenced block.

    :raises TypeError: ``connection`` is none of :data:`ACCEPTED` (nor already a
        ``HostTransaction``), naming its type and the accepted ones.
    """
    factory = _BY_TYPE.get(type(connection))
    if factory is None:
        adapted = _adapt_new(connection)
        _BY_TYPE[type(connection)] = _same if adapted is connection else type(adapted)
        fast: FastBlockFactory | None = getattr(type(adapted), "fast_block", None)
        if fast is not None and adapted is not connection:
            FAST_BLOCKS[type(connection)] = fast
        return adapted
    return factory(connection)


def _same(connection: HostTransaction) -> HostTransaction:
    return connection


def _adapt_new(connection: object) -> HostTransaction:
    if "sqlite3" in sys.modules:
        import sqlite3

        if isinstance(connection, sqlite3.Connection):
            from .sqlite3 import Sqlite3Transaction

            return Sqlite3Transaction(connection)
    if "psycopg" in sys.modules:
        import psycopg

        if isinstance(connection, psycopg.Connection):
            from .psycopg import PsycopgTransaction

            return PsycopgTransaction(connection)
    if "psycopg2" in sys.modules:
        import psycopg2.extensions

        if isinstance(connection, psycopg2.extensions.connection):
            from .psycopg2 import Psycopg2Transaction

            return Psycopg2Transaction(connection)
    if "sqlalchemy" in sys.modules:
        adapted = _sqlalchemy(connection)
        if adapted is not None:
            return adapted
    if isinstance(connection, HostTransaction):
        return connection
    raise TypeError(
        f"cannot fence a {type(connection).__module__}.{type(connection).__qualname__}: "
        f"Ownership.fenced() accepts a {', '.join(ACCEPTED)} (for Django use "
        f"weft_sync.django.fenced_atomic)"
    )


def _sqlalchemy(connection: object) -> HostTransaction | None:
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    if isinstance(connection, Connection):
        from .sqlalchemy import ConnectionTransaction

        return ConnectionTransaction(connection)
    if isinstance(connection, Session):
        from .sqlalchemy import SessionTransactionAdapter

        return SessionTransactionAdapter(connection)
    return None
