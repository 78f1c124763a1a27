"""Session locks for PostgreSQL stores: session-level advisory locks on dedicated connections.

Each held name is ``pg_try_advisory_lock(class_key, name_key)`` on a connection of its own (not
from the pool, so that no other statement ever queues behind it and a pool reset never drops
it). The server releases the lock when that session ends: the process died (its socket closed),
the backend was terminated, the server restarted, or TCP keepalives gave up on a partitioned
client (keepalives are on: about 11 s of silence unless the DSN sets its own). A partition can
therefore drop the lock while its holder still runs; :meth:`PostgresSessionLock.ensure` takes it
again once the server is reachable.

Keys: ``class_key`` derives from the table name, so that stores in different tables of one
database never see each other's locks, and ``name_key`` from the lock name, both 32-bit hashes.
Two names whose keys collide share one lock: a dead name colliding with a live one looks alive,
and a second holder of a colliding name is refused. With 32-bit keys a collision needs tens of
thousands of names held at once to become likely; a caller that judges liveness must keep a
fallback (such as a time-based expiry) for a name that looks alive but is not.

A probe is one query over ``pg_locks`` on a pooled connection; it never touches the locks.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow

from .. import _fork
from .._fork import pin, process_bound
from ..errors import StorageError
from ..redaction import redact_text
from .session_locks import validate_lock_name, validate_lock_names

__all__ = ["PostgresSessionLock", "PostgresSessionLockMethods", "lock_keys"]

_Conn = psycopg.Connection[TupleRow]

# libpq keepalive settings for lock connections, unless the DSN sets its own.
_KEEPALIVES: Final = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}
_TRY_LOCK: Final = "SELECT pg_try_advisory_lock(%s::int4, %s::int4)"
_UNLOCK: Final = "SELECT pg_advisory_unlock(%s::int4, %s::int4)"
# pg_locks shows the two int4 keys of a two-key advisory lock as oids (unsigned): classid holds
# the first, objid the second, and objsubid is 2.
_STILL_MINE: Final = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() "
    "AND locktype = 'advisory' AND classid = %s::oid AND objid = %s::oid "
    "AND objsubid = 2 AND granted)"
)
_PROBE: Final = (
    "SELECT DISTINCT objid::int8 FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = %s::oid AND objsubid = 2 AND granted AND objid = ANY(%s::oid[])"
)


def _key32(text: str) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "big", signed=True)


def lock_keys(table: str, name: str) -> tuple[int, int]:
    """The signed ``(class_key, name_key)`` int4 pair of lock ``name`` on store ``table``."""
    return _key32(f"weft_sync.session-lock:{table}"), _key32(name)


def _oid(key: int) -> int:
    return key & 0xFFFFFFFF


class PostgresSessionLock:
    """An advisory lock held by one dedicated session, re-taken by :meth:`ensure` if lost.

    Thread-safe: ``_lock`` guards ``_conn``. ``ensure`` and ``release`` talk to the server under
    it, bounded by the session's ``statement_timeout`` and the ``connect_timeout``; nothing else
    ever waits for that lock but another call on this same object.
    """

    def __init__(
        self, name: str, table: str, conn: _Conn, connect: Any, keys: tuple[int, int]
    ) -> None:
        self._name = name
        self._table = table
        self._keys = keys
        self._connect = connect
        self._lock = threading.Lock()  # guards _conn and _released
        self._conn: _Conn | None = conn
        self._released = False
        self._pid = os.getpid()
        _fork.track(self)  # a forked child closes its copy

    @property
    def name(self) -> str:
        return self._name

    @property
    def token(self) -> str:
        return f"pg_advisory_lock({self._keys[0]}, {self._keys[1]}) on table {self._table}"

    def ensure(self) -> bool:
        """Whether the session still holds the lock; reconnect and re-take it if it was lost."""
        if self._pid != os.getpid():
            return False
        with self._lock:
            if self._released:
                return False
            conn = self._conn
            if conn is not None and self._still_mine(conn):
                return True
            self._conn = None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            try:
                self._conn = _take(self._connect, self._keys, self._name)
            except StorageError:
                return False
            return True

    def _still_mine(self, conn: _Conn) -> bool:
        try:
            row = conn.execute(_STILL_MINE, [_oid(self._keys[0]), _oid(self._keys[1])]).fetchone()
        except psycopg.Error:
            return False
        return bool(row and row[0])

    def release(self) -> None:
        """Unlock and close the session; idempotent, never raises. A no-op in a forked child."""
        if self._pid != os.getpid():
            return
        with self._lock:
            self._released = True
            conn, self._conn = self._conn, None
        _fork.untrack(self)
        if conn is not None:
            # Unlock first: closing alone returns before the server has ended the session, and
            # a caller that releases and then probes must find the name free.
            with contextlib.suppress(psycopg.Error):
                conn.execute(_UNLOCK, list(self._keys))
            with contextlib.suppress(Exception):
                conn.close()

    def _after_fork_in_child(self) -> None:
        # Close the child's copy of the socket, sending nothing (a Terminate message would end
        # the parent's session); the connection object is pinned so it is never finalised.
        conn, self._conn = self._conn, None
        self._released = True
        self._lock = threading.Lock()
        if conn is not None:
            pin(conn)
            with contextlib.suppress(Exception):
                os.close(conn.pgconn.socket)

    def __repr__(self) -> str:
        return f"PostgresSessionLock({self._name!r}, {self.token})"


def _take(connect: Any, keys: tuple[int, int], name: str) -> _Conn:
    """Open a dedicated session and take the lock on it; return the session.

    :raises StorageError: the server cannot be reached, or another session holds the lock.
    """
    try:
        conn: _Conn = connect()
    except psycopg.Error as exc:
        raise StorageError(
            f"cannot take the session lock {name!r}: connecting failed: {redact_text(str(exc))}"
        ) from exc
    try:
        row = conn.execute(_TRY_LOCK, list(keys)).fetchone()
    except psycopg.Error as exc:
        conn.close()
        raise StorageError(
            f"cannot take the session lock {name!r}: {redact_text(str(exc))}"
        ) from exc
    if not (row and row[0]):
        conn.close()
        raise StorageError(
            f"cannot take the session lock {name!r}: another session holds it (or a name "
            f"whose key {keys[1]} collides with it)"
        )
    return conn


class PostgresSessionLockMethods:
    """The ``SupportsSessionLocks`` methods of ``PostgresStorage``, kept beside their backend."""

    _dsn: str
    _table: str
    _read_only: bool
    _connect_kwargs: dict[str, Any]
    _fork_pid: int

    if TYPE_CHECKING:  # defined by the storage class this is mixed into

        def _check_open(self) -> None: ...

        def _read(self, action: str, query: Any, params: Sequence[object]) -> list[TupleRow]: ...

    def _lock_connect(self) -> _Conn:
        own = conninfo_to_dict(self._dsn)
        kwargs = dict(self._connect_kwargs)
        kwargs.update({k: v for k, v in _KEEPALIVES.items() if k not in own})
        return psycopg.connect(self._dsn, **kwargs)

    @process_bound
    def acquire_session_lock(self, name: str) -> PostgresSessionLock:
        """Take the session lock ``name`` (see :class:`~.session_locks.SupportsSessionLocks`)."""
        validate_lock_name(name)
        self._check_open()
        if self._read_only:
            raise StorageError(
                f"cannot take the session lock {name!r}: the PostgreSQL store was opened read-only"
            )
        keys = lock_keys(self._table, name)
        conn = _take(self._lock_connect, keys, name)
        return PostgresSessionLock(name, self._table, conn, self._lock_connect, keys)

    @process_bound
    def held_session_locks(self, names: Collection[str]) -> set[str]:
        """Which of ``names`` some session holds now (one query over ``pg_locks``)."""
        checked = validate_lock_names(names)
        self._check_open()
        if not checked:
            return set()
        class_key = lock_keys(self._table, "")[0]
        by_oid: dict[int, list[str]] = {}
        for name in checked:
            by_oid.setdefault(_oid(_key32(name)), []).append(name)
        rows = self._read("session lock probe", _PROBE, [_oid(class_key), list(by_oid)])
        return {name for (objid,) in rows for name in by_oid.get(int(objid), ())}

    @process_bound
    def forget_session_lock(self, name: str) -> None:
        """Nothing to tidy: the server forgets a lock when its session ends."""
        validate_lock_name(name)
        self._check_open()
