"""The PostgreSQL backend: one table, row-locked compare-and-swap, a psycopg connection pool."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

try:
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.rows import TupleRow
    from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"PostgresStorage needs psycopg 3 and psycopg-pool ({exc}); install them with "
        f"'pip install weft_sync[postgres]'"
    ) from exc

from ... import _fork
from ..._fork import inherited_error, pin, process_bound_class
from ...errors import ClosedError, MissingStoreError, ReadOnlyStorageError, StorageError
from ...redaction import redact_text
from ..base import (
    Operation,
    Put,
    StorageCapabilities,
    validate_key,
    validate_operations,
    validate_scan_args,
    validate_table_name,
)
from ..fence_proof import PostgresFenceTarget, PostgresIdentity, quote_identifier
from ..reads import ScanRange, validate_keys, validate_scan_ranges
from .cas import ConditionalWrites
from .deadline import CallDeadlines
from .locked import IsolatedBatches
from .locks import PostgresSessionLockMethods, new_store_tag, tagged_application_name
from .settings import (
    DERIVED,
    Derived,
    ReplicationSettings,
    WaitBounds,
    check_pool_sizes,
    check_session_settings,
    derive_wait_bounds,
    expected_settings,
    merged_options,
    transaction_settings,
)
from .sql import Plan, Queries, advisory_key

_log = logging.getLogger(__name__)

_Conn = psycopg.Connection[TupleRow]

_CAPABILITIES: Final = StorageCapabilities(
    conditional_batch=True, multi_process=True, multi_host=True, session_locks=True
)
# Behind a transaction-mode pooler no session outlives a transaction: no session locks.
_POOLED_CAPABILITIES: Final = StorageCapabilities(
    conditional_batch=True, multi_process=True, multi_host=True, session_locks=False
)
POOLER_MODES: Final = ("auto", "transaction", "none", "session")
"""``pooler=``: ``auto`` (the default: a pooler is detected at open), ``transaction``
(pgbouncer's transaction or statement pooling, declared) or ``none`` (a direct connection or one
pooled per session, and nothing else: a pooler that drops the settings fails the open);
``session`` is the same as ``none``."""
_SERVER_TIME: Final = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
# Whether the server is a standby, and which backend answers (compared with the one libpq met).
_SESSION: Final = "SELECT pg_is_in_recovery(), pg_backend_pid()"
_SETTINGS: Final = "SELECT name, setting FROM pg_settings WHERE name = ANY(%s::text[])"
_IDLE_SESSION_VERSION: Final = 140000  # idle_session_timeout exists from PostgreSQL 14
# How long past its statement_timeout a call runs before the client cancels it.
_CANCEL_MARGIN_S: Final = 0.25
# A statement the server cut at one of its bounds (statement_timeout or a cancel; lock_timeout).
_SERVER_BOUNDS: Final = (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable)


@process_bound_class
class PostgresStorage(ConditionalWrites, IsolatedBatches, PostgresSessionLockMethods):
    """Store keys in one PostgreSQL table, safely across threads, processes and hosts.

    The table is ``(key TEXT COLLATE "C" PRIMARY KEY, value BYTEA NOT NULL)``, created if
    missing, so keys sort in UTF-8 byte order (in a UTF8 database), as on SQLite.

    A conditional batch runs in one READ COMMITTED transaction: it locks the existing rows of
    every key it names with one ``SELECT … ORDER BY key FOR UPDATE`` (one order for every caller,
    so batches over the same keys queue rather than deadlock), compares, then writes. A key a
    condition requires absent has no row to lock, so it is claimed by an insert that does nothing
    on a conflict (one ``INSERT … ON CONFLICT DO UPDATE … WHERE`` writes those keys and the
    batch's puts together) and the keys it returns are checked: the uncommitted row holds the
    key's unique-index entry, and a concurrent writer of that key waits for this transaction.
    ``read_then_write`` locks the keys it reads the same way, before its batch is decided; keys
    that batch only writes are locked by the write. ``conditional_batches`` runs
    all batches in one transaction and gives a batch a SAVEPOINT when it could fail after writing;
    a list of renewal-shaped batches (one condition expecting bytes and one put, on the same key,
    keys distinct across the list) runs as a single ``UPDATE … FROM unnest(…)``, and batches on
    pairwise disjoint keys that require no key absent (takeovers, for one) are judged against one
    row-locking SELECT and written with one upsert and one delete. Other lists of batches lock
    batch by batch in the order given: callers that may race over the same keys should pass their
    batches in one order (sorted by key, say), or PostgreSQL may break a deadlock between them by
    failing one transaction (``StorageError``, nothing written).

    Connections come from a ``psycopg_pool.ConnectionPool`` (autocommit sessions) that checks each
    connection before lending it, so calls succeed again once a restarted server is back: the
    pool retries a lost connection with back-off for one pool timeout at most, then connects
    again when a call needs one, so its next attempt is never more than one pool timeout away,
    however long the server was down. Every session the instance opens carries the
    ``application_name`` of the DSN (else ``PGAPPNAME``, else ``weft_sync``) followed by a random
    tag of the instance, which crash probes look for (see :mod:`.locks`). A
    connection lost during COMMIT leaves the outcome unknown: ``StorageError`` is raised and the
    caller must re-read. In a child that inherited this instance across ``os.fork()`` it raises
    :class:`~weft_sync.errors.ClosedError`; the inherited pool is left alone, never closed (that
    would end the parent's sessions, which share its sockets): the child opens its own storage.

    Every wait is bounded (see :mod:`~weft_sync.storage.postgres.settings`): each session (behind
    a transaction-mode pooler, each transaction) runs with a ``statement_timeout`` and a
    ``lock_timeout``, and the pool wait is bounded, all derived from ``renew_interval_ms`` unless
    given. A call that hits a bound raises ``StorageError`` and
    writes nothing; a connection the server dropped is discarded when it is returned, and the pool
    checks every connection it lends, so the next call gets a live one.

    :param dsn: a libpq connection string or ``postgresql://`` URL. ``connect_timeout`` defaults
        to ``timeout`` (rounded up) when it does not set one; a ``statement_timeout`` or
        ``lock_timeout`` set in its ``options`` wins over the derived one.
    :param table: the table name (letters, digits, underscores).
    :param min_size: connections the pool keeps open.
    :param max_size: connections the pool may open at most.
    :param timeout: seconds a call waits for a pooled connection before raising ``StorageError``,
        and how long the pool retries a lost connection before it gives up on it (its
        ``reconnect_timeout``); default one renew interval.
    :param lock_timeout: seconds a statement of this store waits for a row lock before failing
        with ``StorageError`` (the session's ``lock_timeout``), or ``None`` for no bound; default
        half a renew interval, at most one second. Our own transactions hold row locks for
        milliseconds; the bound matters when another session holds a row (a host's fenced
        transaction, see :mod:`weft_sync.fencing`, holding an epoch row; a stray ``SELECT … FOR
        UPDATE``): the call fails and is retried by a later pass instead of stalling it.
    :param statement_timeout: seconds any statement may run (the session's
        ``statement_timeout``), or ``None`` for no bound; default one renew interval.
    :param read_only: use an existing table for reading only: it is checked, never created, and
        every session runs with ``default_transaction_read_only``, so the server itself refuses
        writes (raised as :class:`~weft_sync.errors.ReadOnlyStorageError`).
    :param renew_interval_ms: the claim renew interval the bounds are derived from; default
        5000 (``OwnershipOptions``'s default).
    :param pooler: ``"transaction"`` when the DSN reaches the server through a transaction-mode
        pooler (pgbouncer): no startup ``options`` are sent (the pooler refuses or drops them;
        give bounds as parameters, not in ``options``), psycopg's automatic prepared statements
        are off (``prepare_threshold=None``: a prepared statement would live on a server
        session the next transaction may not get), the store offers no session locks (a lock
        would stay on the pooled server session after its holder died), so crash detection
        falls back to the claim TTL, and every call runs in a transaction whose ``BEGIN``
        carries ``SET LOCAL`` of ``statement_timeout``, ``lock_timeout`` and
        ``idle_in_transaction_session_timeout`` (one simple query: a single statement costs
        ``BEGIN`` and ``COMMIT`` more, a transaction nothing), read back at open; the client-side
        deadline stays. One warning at open says so. Read-only is refused there (it is session
        state). ``"auto"`` (default): the same when the open finds a pooler answering for the
        server (the backend ``pg_backend_pid()`` reports is not the one libpq was told of when
        the connection started, which on a direct connection it always is), else as ``"none"``.
        ``"none"`` (or ``"session"``): as a direct connection, whatever answers; an open
        through a pooler that drops the settings then fails, naming them.
    :raises ValueError: a bad table name, pool size or bound (negative, infinite, NaN), or a
        malformed ``dsn``.
    :raises StorageError: the server cannot be reached, or the table exists with another key
        collation.
    """

    def __init__(
        self,
        dsn: str,
        *,
        table: str = "weft_kv",
        min_size: int = 1,
        max_size: int = 16,
        timeout: float | None = None,
        lock_timeout: float | Derived | None = DERIVED,
        read_only: bool = False,
        renew_interval_ms: int | None = None,
        statement_timeout: float | Derived | None = DERIVED,
        pooler: str = "auto",
    ) -> None:
        if not isinstance(dsn, str):
            raise TypeError(f"dsn must be a connection string, got {type(dsn).__name__}")
        if pooler not in POOLER_MODES:
            raise ValueError(f"pooler must be one of {', '.join(POOLER_MODES)}, got {pooler!r}")
        self._pooler = pooler
        if pooler == "transaction" and read_only:
            raise ValueError(
                "read_only=True cannot be kept behind a transaction-mode pooler (it is session "
                "state the pooler would hand to other clients); connect directly to read only"
            )
        self._table = validate_table_name(table)
        check_pool_sizes(min_size, max_size)
        self._bounds = derive_wait_bounds(
            renew_interval_ms=renew_interval_ms,
            statement_timeout_ms=_bound_ms("statement_timeout", statement_timeout),
            lock_timeout_ms=_bound_ms("lock_timeout", lock_timeout),
            timeout=timeout,
        )
        self._dsn = dsn
        self._min_size = min_size
        self._max_size = max_size
        self._timeout = self._bounds.pool_timeout_s
        self._read_only = bool(read_only)
        # Carried in the application_name of every session this instance opens: a crash probe
        # proves the instance gone only when none of them is left (see .locks).
        self._tag = new_store_tag()
        self._connect_kwargs = _connect_kwargs(dsn, self._bounds, self._tag)
        # Set once, before the pool opens: whether this store runs as behind a transaction-mode
        # pooler, the BEGIN its transactions then start with, and what proved a pooler there.
        self._pooled = False
        self._begin: sql.Composed | None = None
        self._detected: str | None = None
        if pooler == "transaction":
            self._run_pooled()
        self._q = Queries(self._table)
        self._lock = threading.Lock()  # guards _pool and _closed
        self._pool: ConnectionPool[_Conn] | None = None
        self._fork_pid = os.getpid()
        self._closed = False
        self._fence_target: PostgresFenceTarget | None = None
        # A client-side bound on every call: cancelled a little after its statement_timeout
        # (which a stalled server never enforces), cut shortly after that.
        statement_s = self._bounds.statement_timeout_ms / 1000.0
        self._deadlines: CallDeadlines | None = (
            CallDeadlines(statement_s + _CANCEL_MARGIN_S, f"weft-pg-deadline[{self._table}]")
            if statement_s
            else None
        )
        with self._translate("table setup"):
            version = self._check_table() if self._read_only else self._ensure_table()
        idle_session = version >= _IDLE_SESSION_VERSION and not self._pooled
        if idle_session:
            self._connect_kwargs = _connect_kwargs(dsn, self._bounds, self._tag, idle_session=True)
        # Behind a transaction pooler no session setting can be relied on: the ones each
        # transaction sets itself are read back inside one.
        self._expected = (
            transaction_settings(self._bounds)
            if self._pooled
            else expected_settings(_dsn_params(dsn), self._bounds, idle_session=idle_session)
        )
        if self._pooled:
            self._warn_pooled()
        pool = self._new_pool()
        try:
            with self._translate("connection pool start"):
                pool.open(wait=True, timeout=self._timeout)
                with pool.connection(timeout=self._timeout) as conn, self._bounded(conn):
                    kind = "transaction" if self._pooled else "session"
                    self._check_settings(conn, f"store's pooled {kind}")
        except BaseException:
            pool.close()
            raise
        self._pool = pool
        _fork.track(self)

    # -- setup -------------------------------------------------------------------------------

    def _check_settings(self, conn: _Conn, where: str) -> None:
        """Read back the settings this store set on ``conn``; refuse a session without them.

        Behind a pooler, call it inside :meth:`_transaction`: the settings are that
        transaction's.

        :raises StorageError: one is not in effect (named in the message).
        """
        if not self._expected:
            return
        rows = conn.execute(_SETTINGS, [list(self._expected)]).fetchall()
        found = {str(n): str(v) for n, v in rows}
        try:
            check_session_settings(found, self._expected, where, per_transaction=self._pooled)
        except ValueError as exc:
            raise StorageError(f"PostgreSQL table {self._table!r}: {exc}") from None

    def _run_pooled(self) -> None:
        """Run as behind a transaction-mode pooler from here on (see the class docstring)."""
        self._pooled = True
        self._connect_kwargs = _connect_kwargs(self._dsn, self._bounds, self._tag, pooled=True)
        self._begin = _begin_with(transaction_settings(self._bounds))

    def _recognise_session(self, conn: psycopg.Connection[Any]) -> bool:
        """Read whether ``conn``'s server is a standby and, with ``pooler="auto"``, whether a
        pooler answers for it; if one does, run as behind one (:meth:`_run_pooled`).

        On proof, not a guess: libpq learns the pid of its backend when the connection starts
        (``conn.info.backend_pid``), and on a direct connection ``pg_backend_pid()`` is that pid
        in every transaction. A pooler answers the startup itself, with a key of its own, and
        lends a server session per transaction or client: the two differ.

        :returns: whether the server is a standby.
        """
        row = conn.execute(_SESSION).fetchone()
        assert row is not None
        standby, pid = bool(row[0]), int(row[1])
        if self._pooler == "auto" and pid != conn.info.backend_pid:
            self._detected = (
                f"the server session's pg_backend_pid() is {pid}, not the {conn.info.backend_pid} "
                f"the connection was opened with"
            )
            self._run_pooled()
        return standby

    def _warn_pooled(self) -> None:
        """Log once, at open, that this store runs as behind a transaction-mode pooler."""
        if self._detected is None:
            how, advice = "as declared (pooler=transaction)", ""
        else:
            how = f"found at open ({self._detected})"
            advice = "; add pooler=transaction to the URL to say so, or pooler=none to refuse it"
        _log.warning(
            "weft_sync: PostgreSQL store %s (table %s) runs behind a transaction-mode pooler, %s: "
            "session advisory locks cannot be held there, so crash detection falls back to the "
            "claim TTL (a crashed engine's claims move when they expire, not at once); psycopg's "
            "automatic prepared statements are off; statement_timeout, lock_timeout and "
            "idle_in_transaction_session_timeout are set per transaction (SET LOCAL)%s",
            redact_text(self._dsn),
            self._table,
            how,
            advice,
        )

    def _ensure_table(self) -> int:
        """Create the table if missing and check its key collation, on a direct connection.

        :returns: the server's ``server_version_num``.
        """
        with psycopg.connect(self._dsn, **self._connect_kwargs) as conn:
            if self._recognise_session(conn):
                raise _standby_error(self._dsn)
            version = conn.info.server_version
            self._q.render(conn)
            ident = sql.Identifier(self._table).as_string(conn)
            # The advisory lock serialises creation by several processes: CREATE TABLE IF NOT
            # EXISTS alone can still fail with a unique violation when two run at once.
            with self._transaction(conn):
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [advisory_key(self._table)])
                row = conn.execute(
                    "SELECT co.collname FROM pg_attribute a "
                    "LEFT JOIN pg_collation co ON co.oid = a.attcollation "
                    "WHERE a.attrelid = to_regclass(%s) AND a.attname = 'key'",
                    [ident],
                ).fetchone()
                if row is None:
                    conn.execute(self._q.create)
                    _log.debug("created PostgreSQL table %s", self._table)
                    return version
        if row[0] not in ("C", "POSIX"):
            raise StorageError(
                f"table {self._table!r} exists but its key column uses collation {row[0]!r}; "
                f'weft_sync needs COLLATE "C" so keys sort in byte order: migrate the table or '
                f"choose another table name"
            )
        return version

    def _check_table(self) -> int:
        """Check that the table exists, on a direct read-only connection; create nothing.

        :returns: the server's ``server_version_num``.
        """
        with psycopg.connect(self._dsn, **self._connect_kwargs) as conn:
            self._recognise_session(conn)
            if self._pooled:
                raise StorageError(
                    f"PostgreSQL store {redact_text(self._dsn)!r} is behind a transaction-mode "
                    f"pooler ({self._detected}), where a read-only session cannot be kept (it "
                    f"is session state the pooler would hand to other clients); connect "
                    f"directly, or through a session-mode pool, to read only"
                )
            version = conn.info.server_version
            self._q.render(conn)
            ident = sql.Identifier(self._table).as_string(conn)
            row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [ident]).fetchone()
        if row is None or not row[0]:
            raise MissingStoreError(
                f"PostgreSQL database has no table {self._table!r} (opened read-only, so it is "
                f"not created)"
            )
        return version

    @staticmethod
    def _configure_read_only(conn: _Conn) -> None:
        conn.execute("SET default_transaction_read_only = on")

    def _new_pool(self) -> ConnectionPool[_Conn]:
        return ConnectionPool(
            self._dsn,
            kwargs=self._connect_kwargs,
            min_size=self._min_size,
            max_size=self._max_size,
            open=False,
            configure=self._configure_read_only if self._read_only else None,
            name=f"weft-pg[{self._table}]",
            timeout=self._timeout,
            # By default the pool retries a lost connection for five minutes at ever longer
            # intervals, and a call waits for its next try, not for the server: stop at one wait.
            reconnect_timeout=self._timeout,
        )

    # -- connections -------------------------------------------------------------------------

    def _abandon_in_child(self) -> None:
        """In a forked child: keep the inherited pool referenced and unused, never closed."""
        # Another parent thread may have held the lock at fork(); the child has only this thread.
        self._lock = threading.Lock()
        pool, self._pool = self._pool, None
        if pool is not None:
            pin(pool)
        self._closed = True
        _fork.untrack(self)

    def _after_fork_in_child(self) -> None:
        self._abandon_in_child()

    def _check_open(self) -> None:
        if self._fork_pid != os.getpid():
            raise inherited_error(self, self._fork_pid)
        with self._lock:
            closed = self._closed
        if closed:
            raise self._closed_error()

    def _current_pool(self) -> ConnectionPool[_Conn]:
        """Return the pool, unless this instance is closed or was inherited across a fork."""
        if self._fork_pid != os.getpid():
            raise inherited_error(self, self._fork_pid)
        with self._lock:
            pool, closed = self._state()
        if closed or pool is None:
            raise self._closed_error()
        return pool

    def _state(self) -> tuple[ConnectionPool[_Conn] | None, bool]:
        return self._pool, self._closed

    @contextmanager
    def _translate(self, action: str) -> Iterator[None]:
        """Turn every driver and pool error raised inside the block into ``StorageError``."""
        try:
            yield
        except psycopg.Error as exc:
            if isinstance(exc, PoolClosed) and self._closed:
                raise self._closed_error() from None
            if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction) and self._read_only:
                raise ReadOnlyStorageError(
                    f"PostgresStorage for table {self._table!r} was opened read-only; "
                    f"{action} refused"
                ) from exc
            raise StorageError(
                f"PostgreSQL {action} on table {self._table!r} failed: {redact_text(str(exc))}"
            ) from exc

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"PostgresStorage for table {self._table!r} is closed")

    @contextmanager
    def _connection(self, action: str, *, check: bool = True) -> Iterator[_Conn]:
        """Borrow a pooled connection for the block (as ``pool.connection()`` does).

        A connection is checked with a round trip before it is lent, unless ``check`` is false:
        reads that run again after a failure (:meth:`_read`) and writes that start again after a
        failed ``BEGIN`` (:meth:`_write_transaction`) skip it. One that fails the check goes
        back to the pool, which discards it and opens another, and the next one is tried at
        once. The whole wait is bounded by the pool timeout.

        After the server dropped every pooled session (a restart, a kill storm) the pool has no
        connection to lend until one of its attempts to open one succeeds, and a call waits for
        that attempt. The pool gives up a connection it has retried for one pool timeout
        (``reconnect_timeout``) and opens the next one when a call asks for it, so once the
        server is back that attempt comes within one pool timeout, however long it was down; a
        call whose wait ends just before it fails, and leaves the connection to the next call.
        """
        pool = self._current_pool()
        started = time.monotonic()
        deadline = started + self._timeout
        with self._translate(action):
            while True:
                conn = pool.getconn(timeout=max(0.0, deadline - time.monotonic()))
                if not check:
                    break
                with self.guard_call(conn, started):
                    alive = _alive(conn)
                if alive:
                    break
                pool.putconn(conn)
            try:
                with self.guard_call(conn, started), conn:
                    yield conn
            finally:
                pool.putconn(conn)

    @contextmanager
    def _write_transaction(self, action: str) -> Iterator[_Conn]:
        """A pooled connection inside a transaction, lent without the liveness round trip.

        ``BEGIN`` is the first thing the transaction sends: on a session the server dropped it
        fails there, before anything is written, and the transaction starts once more on a
        checked connection (the pool discards the broken one). A ``BEGIN`` cut by the statement
        bound is not tried again. An exception raised in the block rolls the transaction back
        and propagates (driver errors as ``StorageError``).
        """
        with self._connection(action, check=False) as conn:
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(self._transaction(conn))
            except psycopg.OperationalError as exc:
                if isinstance(exc, psycopg.errors.QueryCanceled):
                    raise
                _log.debug("PostgreSQL %s: BEGIN failed on a pooled connection (%s)", action, exc)
            else:
                with stack:
                    yield conn
                return
        with self._connection(action) as conn, self._transaction(conn):
            yield conn

    @contextmanager
    def _writing(self, action: str, *, atomic: bool) -> Iterator[_Conn]:
        """A pooled connection for one call's writes, in one transaction when ``atomic``.

        On a direct connection a call that is not ``atomic`` sends its statements in autocommit,
        on a checked connection. Behind a pooler every call is a transaction that sets its
        bounds, lent as :meth:`_write_transaction` lends one.
        """
        if self._pooled:
            with self._write_transaction(action) as conn:
                yield conn
            return
        with self._connection(action) as conn:
            if atomic:
                with conn.transaction():
                    yield conn
            else:
                yield conn

    @contextmanager
    def _transaction(self, conn: _Conn) -> Iterator[None]:
        """Run the block in one transaction on ``conn`` (autocommit, not in one yet).

        On a direct connection it is psycopg's ``conn.transaction()``. Behind a pooler the
        ``BEGIN`` and the ``SET LOCAL`` of every bound go as one simple query (no parameters,
        so psycopg sends several statements at once: no extra round trip), so the server session
        the pooler lends for the transaction runs it with them; the block's end sends
        ``COMMIT``, or ``ROLLBACK`` when it raises. A transaction block inside is a savepoint.
        """
        begin = self._begin
        if begin is None:
            with conn.transaction():
                yield
            return
        conn.execute(begin)
        try:
            yield
        except BaseException:
            _roll_back(conn)
            raise
        conn.commit()

    def _bounded(self, conn: _Conn) -> contextlib.AbstractContextManager[None]:
        """What a statement sent on its own runs in: nothing on a direct connection (the
        session has the bounds), a :meth:`_transaction` that sets them behind a pooler."""
        return self._transaction(conn) if self._pooled else contextlib.nullcontext()

    def guard_call(
        self, conn: _Conn, since: float | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Bound what runs on ``conn`` in the block on the client side, counting from ``since``
        (see :mod:`~weft_sync.storage.postgres.deadline`); nothing when statements are
        unbounded."""
        deadlines = self._deadlines
        return contextlib.nullcontext() if deadlines is None else deadlines.guard(conn, since)

    def _read(self, action: str, query: Any, params: Sequence[object]) -> list[TupleRow]:
        """Fetch the rows of one read-only statement on a connection lent without a check.

        Skipping the pool's check saves a round trip per read. A statement that fails on a
        connection the server dropped (an ``OperationalError``; the pool discards the broken
        connection when it is returned) runs once more on a checked connection: a read is safe to
        repeat. One cut by a server bound (``statement_timeout``, ``lock_timeout``) is not: it
        would wait as long again. Behind a pooler the read is a transaction that sets its bounds.
        """
        started = time.monotonic()
        try:
            with self._connection(action, check=False) as conn, self._bounded(conn):
                return conn.execute(query, params, binary=True).fetchall()
        except StorageError as exc:
            cause = exc.__cause__
            if not isinstance(cause, psycopg.OperationalError) or isinstance(
                cause, (PoolTimeout, *_SERVER_BOUNDS)
            ):
                raise
            if self._deadlines is not None and (
                time.monotonic() - started > self._deadlines.bound_s / 2
            ):
                raise  # cut by its deadline (or nearly there): a retry would double the bound
            _log.debug("PostgreSQL %s failed on a pooled connection (%s); retrying", action, cause)
        with self._connection(action) as conn, self._bounded(conn):
            return conn.execute(query, params, binary=True).fetchall()

    # -- protocol ----------------------------------------------------------------------------

    @property
    def capabilities(self) -> StorageCapabilities:
        return _POOLED_CAPABILITIES if self._pooled else _CAPABILITIES

    def server_time_ms(self) -> int:
        """The database server's clock: milliseconds since the Unix epoch (one round trip).

        ``clock_timestamp()`` is read when the statement runs, not at transaction start, so a
        caller that notes its own clock before and after the call bounds the server's reading.
        """
        rows = self._read("server clock read", _SERVER_TIME, [])
        return int(rows[0][0])

    @property
    def read_only(self) -> bool:
        """Whether the store was opened read-only."""
        return self._read_only

    def get(self, key: str) -> bytes | None:
        validate_key(key)
        rows = self._read("get", self._q.get, [key])
        return bytes(rows[0][0]) if rows else None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Read many keys with one statement (one snapshot).

        See :class:`~weft_sync.storage.reads.SupportsGetMany`.
        """
        checked = validate_keys(keys)
        if not checked:
            self._check_open()
            return []
        rows = self._read("get_many", self._q.get_many, [checked])
        found = {str(key): bytes(value) for key, value in rows}
        return [found.get(key) for key in checked]

    def put(self, key: str, value: bytes) -> None:
        (op,) = validate_operations([Put(key, value)])
        assert isinstance(op, Put)
        with self._writing("put", atomic=False) as conn:
            conn.execute(self._q.put, [op.key, op.value])

    def delete(self, key: str) -> None:
        validate_key(key)
        with self._writing("delete", atomic=False) as conn:
            conn.execute(self._q.delete, [key])

    def scan(
        self,
        prefix: str = "",
        *,
        gt: str | None = None,
        gte: str | None = None,
        lt: str | None = None,
        lte: str | None = None,
        limit: int | None = None,
        reverse: bool = False,
    ) -> list[tuple[str, bytes]]:
        comparisons = validate_scan_args(prefix, gt, gte, lt, lte, limit)
        if prefix:
            comparisons.insert(0, (">=", prefix))
        clauses = [sql.SQL("key {} %s").format(sql.SQL(op)) for op, _ in comparisons]
        params: list[object] = [bound for _, bound in comparisons]
        query = sql.Composed([self._q.scan])
        if clauses:
            query += sql.SQL(" WHERE ") + sql.SQL(" AND ").join(clauses)
        query += sql.SQL(" ORDER BY key DESC LIMIT %s" if reverse else " ORDER BY key LIMIT %s")
        params.append(limit)
        rows = self._read("scan", query, params)
        return [(str(k), bytes(v)) for k, v in rows]

    def scan_many(self, ranges: Sequence[ScanRange]) -> list[list[tuple[str, bytes]]]:
        """Several scans in one statement: one round trip, one snapshot.

        See :class:`~weft_sync.storage.reads.SupportsScanMany`.
        """
        checked = validate_scan_ranges(ranges)
        self._check_open()
        if not checked:
            return []
        parts: list[sql.Composable] = []
        params: list[object] = []
        for index, (scan, comparisons) in enumerate(checked):
            if scan.prefix:
                comparisons.insert(0, (">=", scan.prefix))
            part = sql.SQL("(SELECT {n}::int4, key, value FROM {t}").format(
                n=sql.Literal(index), t=self._q.table
            )
            if comparisons:
                part += sql.SQL(" WHERE ") + sql.SQL(" AND ").join(
                    sql.SQL("key {} %s").format(sql.SQL(op)) for op, _ in comparisons
                )
            parts.append(part + sql.SQL(" ORDER BY key LIMIT %s)"))
            params += [bound for _, bound in comparisons]
            params.append(scan.limit)
        results: list[list[tuple[str, bytes]]] = [[] for _ in checked]
        query = sql.SQL(" UNION ALL ").join(parts)
        if len(parts) > 1:  # one ORDER BY over the union: a lone part is ordered already
            query += sql.SQL(" ORDER BY 1, 2")
        for index, key, value in self._read("scan_many", query, params):
            results[index].append((str(key), bytes(value)))
        return results

    def batch(self, operations: Sequence[Operation]) -> None:
        plan = Plan.build([], validate_operations(operations))
        if not plan.put_keys and not plan.delete_keys:
            self._check_open()
            return
        atomic = bool(plan.put_keys and plan.delete_keys)
        with self._writing("batch", atomic=atomic) as conn:
            self._write(conn, plan.put_keys, plan.put_values, plan.delete_keys)

    def fence_target(self) -> PostgresFenceTarget:
        """Where this store's table is, for :mod:`weft_sync.fencing` (read once, then cached).

        See :class:`~weft_sync.storage.fence_proof.SupportsHostFence`.
        """
        target = self._fence_target
        if target is None:
            rows = self._read("fence identity", self._q.identity, [quote_identifier(self._table)])
            sysid, database, oid, schema = rows[0]
            identity = PostgresIdentity(str(sysid), str(database), int(oid), str(schema))
            target = self._fence_target = PostgresFenceTarget(self._table, identity)
        return target

    @property
    def wait_bounds(self) -> WaitBounds:
        """The statement, lock and pool bounds every call of this storage runs under."""
        return self._bounds

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"PostgresStorage({redact_text(self._dsn)!r}, table={self._table!r}, {state})"

    def replication_settings(self) -> ReplicationSettings:
        """Read how the server replicates commits (see :class:`ReplicationSettings`)."""
        rows = self._read(
            "replication settings",
            "SELECT current_setting('synchronous_commit'), "
            "current_setting('synchronous_standby_names'), pg_is_in_recovery(), "
            "(SELECT count(*) FROM pg_stat_replication), "
            "(SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')), "
            "(SELECT count(*) FROM pg_stat_replication WHERE sync_state IS NULL)",
            [],
        )
        commit, names, standby, streaming, sync, hidden = rows[0]
        return ReplicationSettings(
            str(commit),
            str(names),
            bool(standby),
            int(streaming),
            None if hidden else int(sync),
        )

    def bound_waits(self, deadline: float | None) -> None:
        """See :class:`~weft_sync.storage.wait_bound.SupportsWaitBound`: every call, those in
        flight included, is cancelled by ``deadline`` at the latest (one that begins past it
        gets a short attempt, :data:`~weft_sync.storage.postgres.deadline.PAST_LIMIT_S`).
        A store with no ``statement_timeout`` has no client-side bound to bring forward: there
        it changes nothing."""
        if self._deadlines is not None:
            self._deadlines.limit_to(deadline)

    def close(self) -> None:
        """Close the pool; idempotent. In a forked child it only lets go of the inherited one."""
        if self._fork_pid != os.getpid():
            if not self._closed:
                self._abandon_in_child()
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool = self._pool
            self._pool = None
        _fork.untrack(self)
        if pool is not None:
            pool.close()
        if self._deadlines is not None:
            self._deadlines.close()

    def __enter__(self) -> PostgresStorage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _alive(conn: _Conn) -> bool:
    try:
        ConnectionPool.check_connection(conn)
    except psycopg.Error:
        return False
    return True


def _bound_ms(name: str, seconds: object) -> int | None:
    """A bound given in seconds as the session setting's milliseconds (``0``: no bound), or
    ``None`` when it is left to be derived."""
    if seconds is DERIVED:
        return None
    if seconds is None:
        return 0
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not 0 < seconds < 86_400
    ):
        raise ValueError(
            f"{name} must be a positive number of seconds below one day, or None, got {seconds!r}"
        )
    return max(1, math.ceil(seconds * 1000))


def _dsn_params(dsn: str) -> dict[str, Any]:
    try:
        return conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ValueError(
            f"invalid PostgreSQL connection string {redact_text(dsn)!r}: {redact_text(str(exc))}"
        ) from None


def _standby_error(dsn: str) -> StorageError:
    """The error for a read-write open on a standby: it takes no writes, so an engine there could
    neither claim nor renew, and every write would fail with a read-only error."""
    return StorageError(
        f"the PostgreSQL server of {redact_text(dsn)!r} is a standby (pg_is_in_recovery() "
        f"is true): it takes no writes, so claims cannot be made or renewed there; point the "
        f"store URL at the primary (a standby can only be inspected read-only, e.g. "
        f"'weft-sync doctor')"
    )


def _begin_with(settings: dict[str, int]) -> sql.Composed:
    """``BEGIN`` and a ``SET LOCAL`` of each setting (ms), as one string of statements."""
    sets = [
        sql.SQL("SET LOCAL {} = {}").format(sql.SQL(name), sql.Literal(value))
        for name, value in settings.items()
    ]
    return sql.SQL("; ").join([sql.SQL("BEGIN"), *sets])


def _roll_back(conn: _Conn) -> None:
    """Roll back what a failed block left open on ``conn``; a connection that cannot is
    discarded by the pool when it is returned."""
    if conn.closed:
        return
    try:
        conn.rollback()
    except psycopg.Error as exc:
        _log.debug("rolling back a PostgreSQL transaction failed: %r", exc)


def _connect_kwargs(
    dsn: str, bounds: WaitBounds, tag: str, *, idle_session: bool = False, pooled: bool = False
) -> dict[str, Any]:
    params = _dsn_params(dsn)
    kwargs = merged_options(params, bounds, idle_session=idle_session)
    own = params.get("application_name")
    kwargs["application_name"] = tagged_application_name(
        os.environ.get("PGAPPNAME") if own is None else str(own), tag
    )
    if pooled:
        # A transaction pooler refuses (or drops) startup options, and a prepared statement
        # lives on one server session that the next transaction may not get.
        kwargs.pop("options", None)
        kwargs["prepare_threshold"] = None
    return kwargs
