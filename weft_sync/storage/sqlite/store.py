"""The SQLite backend: one sqlitedict-compatible table, one writer thread, per-thread readers."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Final
from urllib.parse import quote

from ..._fork import process_bound_class
from ...errors import ClosedError, MissingStoreError, ReadOnlyStorageError, StorageError
from ..base import (
    Batch,
    Condition,
    Delete,
    Operation,
    Put,
    StorageCapabilities,
    check_batch_shape,
    tightest_bounds,
    validate_batch,
    validate_key,
    validate_operations,
    validate_scan_args,
    validate_table_name,
)
from ..cas import CasRow, validate_cas_rows
from ..fence_proof import SqliteFenceTarget
from ..read_then_write import Decide
from ..reads import validate_keys
from ..wait_bound import WaitDeadline
from . import fork as sqlite_fork
from .identity import RESERVED_TABLES, OpenPath, StoreIdentity, refuse_second_name
from .locks import SqliteSessionLockMethods, SqliteSessionLocks
from .readers import ReaderConnections
from .schema import check_schema, create_schema, replaces_deleted_store
from .writer import (
    RenewalRow,
    RequestQueue,
    SqliteWriter,
    WriteRequest,
    WriterFileLock,
    as_bytes,
    renewal_batch,
    renewal_row,
)

if TYPE_CHECKING:
    from sqlitedict import SqliteDict

_log = logging.getLogger(__name__)

SYNCHRONOUS_MODES: Final = ("FULL", "NORMAL")
_CAPABILITIES: Final = StorageCapabilities(
    conditional_batch=True, multi_process=True, multi_host=False, session_locks=True
)
_JOIN_GRACE_S: Final = 5.0
# How long close(timeout) waits past its bound: a lock wait it cut ends within one busy slice.
_BOUND_GRACE_S: Final = 0.5
# Keys per ``SELECT … WHERE key IN (…)`` of get_many (SQLite allows 32,766 parameters).
_GET_MANY_CHUNK: Final = 500


def _identity(value: object) -> object:
    return value


class _DriverErrors:
    """The ``with`` block of :meth:`SqliteStorage._translate`: a driver error leaves it as
    :class:`~weft_sync.errors.StorageError` naming the store and the action (``ClosedError``
    once the storage is closed). A class rather than a generator: every write passes five."""

    __slots__ = ("_storage", "_what")

    def __init__(self, storage: SqliteStorage, what: str) -> None:
        self._storage = storage
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or not isinstance(exc, sqlite3.Error | OSError):
            return
        storage = self._storage
        if storage._closed and isinstance(exc, sqlite3.ProgrammingError):
            raise ClosedError(f"SqliteStorage({storage._path!r}) is closed") from exc
        raise StorageError(
            f"SQLite {self._what} failed on {storage._path!r} table {storage._table!r}: {exc}"
        ) from exc


@process_bound_class
class SqliteStorage(SqliteSessionLockMethods):
    """Store keys in one SQLite file, safely across threads and processes on one host.

    The table has sqlitedict's schema, so :meth:`dict_view` can open it as a ``SqliteDict``.
    The file uses WAL with ``synchronous`` ``FULL`` (or ``NORMAL``) and a busy timeout.

    Threads: a write arriving while no other write of this instance is queued or committing is
    committed by the calling thread itself, in its own ``BEGIN IMMEDIATE`` transaction. Otherwise
    it is queued to the instance's writer thread, which drains the queue into a single
    ``BEGIN IMMEDIATE`` transaction (group commit). Both take the same in-process transaction
    lock, so one write connection is used by one thread at a time, and apply each request under
    its own SAVEPOINT, so one request's failed condition or error leaves the others intact.
    A request whose batches are all renewal-shaped (one condition expecting bytes, one put of the
    same key) runs as one ``executemany`` of ``UPDATE … WHERE key = ? AND value = ?``, judged
    batch by batch only when a row did not change. Reads use one connection per thread; WAL
    readers never block the writer.

    Processes: writers in different processes are serialised by ``flock`` on ``<path>.lock``,
    held only while a write transaction runs, and ``BEGIN IMMEDIATE`` takes SQLite's write lock
    before any condition is read. Several hosts must not share the file. Session locks are
    ``flock``-ed files in ``<path>.weft-locks/`` (see :mod:`~weft_sync.storage.sqlite.locks`).

    Fork: a fork never waits for this instance. In the child it raises
    :class:`~weft_sync.errors.ClosedError`, and the child opens its own storage on the same file.
    The child closes the connections it inherited when no read or write of the library was
    running at the fork, and otherwise leaves them untouched (see
    :mod:`~weft_sync.storage.sqlite.fork`): fork while the storage is idle, or open it after the
    fork. Connections the application opens itself on the same file (a :meth:`dict_view`
    included) should not be open across a fork.

    :param path: the database file; created if missing. ``":memory:"`` is refused.
    :param table: the table name (letters, digits, underscores; not ``sqlite_…`` and not
        ``weft_open_paths``, a table the store keeps in the same file).
    :param busy_timeout_ms: how long a write waits for another writer, and a read for a lock.
    :param synchronous: ``"FULL"`` or ``"NORMAL"``.
    :param read_only: open an existing store for reading only: connections use SQLite's
        ``mode=ro``, no writer thread starts, no lock file or table is created, and every write
        raises :class:`~weft_sync.errors.ReadOnlyStorageError`. SQLite may still create the
        ``-wal`` and ``-shm`` side files of an existing database, as any reader does.
    :raises ValueError: a bad table name, timeout, ``synchronous`` mode or path.
    :raises StorageError: the file cannot be opened or the table cannot be created (with
        ``read_only``: the file or the table does not exist).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        table: str = "weft_kv",
        busy_timeout_ms: int = 5000,
        synchronous: str = "FULL",
        read_only: bool = False,
    ) -> None:
        self._path = os.fspath(path)
        if not isinstance(self._path, str) or not self._path or self._path == ":memory:":
            raise ValueError(
                f"SqliteStorage needs a database file path, got {path!r}; in-memory databases "
                f"cannot be shared between connections"
            )
        self._table = validate_table_name(table)
        if self._table.lower() in RESERVED_TABLES:
            raise ValueError(
                f"invalid table name {table!r}: the SQLite store keeps a table of that name for "
                f"itself in the same file ({', '.join(sorted(RESERVED_TABLES))}); pick another name"
            )
        if type(busy_timeout_ms) is not int or busy_timeout_ms < 0:
            raise ValueError(
                f"busy_timeout_ms must be a non-negative int of milliseconds, "
                f"got {busy_timeout_ms!r}"
            )
        mode = synchronous.upper() if isinstance(synchronous, str) else synchronous
        if mode not in SYNCHRONOUS_MODES:
            raise ValueError(
                f"invalid synchronous mode {synchronous!r}: use one of "
                f"{', '.join(SYNCHRONOUS_MODES)}"
            )
        self._busy_timeout_ms = busy_timeout_ms
        self._synchronous = str(mode)
        self._read_only = bool(read_only)
        # Resolved once: a later chdir() must not move the store under a read-only instance
        # or under the fence's same-file proof.
        # ``mode=rw`` (never create) plus ``query_only`` rather than ``mode=ro``: a read-only
        # connection cannot remove the ``-wal``/``-shm`` files its open creates, while the last
        # read-write connection to close does, so inspecting a cleanly closed store leaves no
        # file behind. ``query_only`` makes SQLite refuse every write statement.
        self._ro_uri = f"file:{quote(os.path.abspath(self._path))}?mode=rw"
        quoted = f'"{self._table}"'
        self._sql_get = f"SELECT value FROM {quoted} WHERE key = ?"
        self._sql_get_many = f"SELECT key, value FROM {quoted} WHERE key IN "
        self._sql_scan = f"SELECT key, value FROM {quoted} WHERE"

        # Guards _closed and _writer, and orders each write's choice (commit on the calling
        # thread, or queue) against other writes, against close() (no request is queued or
        # started after close() has drained the queue).
        self._lock = threading.Lock()
        self._closed = False
        self._fork_pid = os.getpid()
        self._queue = RequestQueue()
        self._writer: SqliteWriter | None = None
        self._bound = WaitDeadline()
        self._file_lock = WriterFileLock(self._path + ".lock", self._busy_timeout_ms, self._bound)
        self._readers = ReaderConnections(self._connect, self._closed_error)
        self._identity = StoreIdentity(self._path, self._connect)
        # A fenced host block checks, as the store's own commits do, that the file at the path
        # is still the one this store opened.
        self._fence_target = SqliteFenceTarget(
            self._path,
            self._table,
            None if self._read_only else self._identity.check_database_file,
        )
        self._session_locks = SqliteSessionLocks(self._path, read_only=self._read_only)
        # A lock file without its database: a store was here and its file was deleted.
        replaces_deleted = not self._read_only and replaces_deleted_store(self._path)
        # One file, one name: a hard-linked file would get a WAL and locks per name.
        refuse_second_name(self._path)
        try:
            with sqlite_fork.opening():
                if self._read_only:
                    self._check_schema()
                else:
                    with self._translate("open"):
                        create_schema(
                            self._path,
                            self._table,
                            self._connect,
                            self._file_lock,
                            replaces_deleted=replaces_deleted,
                            busy_timeout_ms=self._busy_timeout_ms,
                        )
                        self._identity.open()
                        with self._file_lock.hold():
                            self._identity.register_path(OpenPath(self._path))
        except BaseException:
            self._identity.close()
            self._file_lock.close()
            raise
        sqlite_fork.track(self)

    # -- fork --------------------------------------------------------------------------------

    def _in_sqlite(self) -> bool:
        """Whether a thread was using one of this instance's connections (read in a child, on
        the copies of the locks every use of a connection holds)."""
        writer = self._writer
        return (writer is not None and writer.in_use()) or self._readers.in_use()

    def _after_fork_in_child(self) -> None:
        self._abandon_in_child(close=sqlite_fork.closing_is_safe())

    def _abandon_in_child(self, *, close: bool) -> None:
        """Let go of everything inherited: close the copies when ``close``, else pin them."""
        # A parent thread may have held the lock at fork time; only this thread exists now.
        self._lock = threading.Lock()
        if self._writer is not None:
            self._writer.abandon_in_child(close)
        self._file_lock.close()
        self._readers.abandon_in_child(close)
        self._identity.abandon_in_child(close)
        self._closed = True
        sqlite_fork.untrack(self)

    # -- connections -------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # A read-only store is opened by URI so that a missing file is an error, not created.
        conn = sqlite3.connect(
            self._ro_uri if self._read_only else self._path,
            timeout=self._busy_timeout_ms / 1000.0,
            isolation_level=None,
            check_same_thread=False,
            uri=self._read_only,
        )
        try:
            if self._read_only:
                conn.execute("PRAGMA query_only = ON")
            conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms:d}")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            # Each write request runs in a savepoint, whose journal keeps the original of every
            # page it changes; in memory that costs a copy, in a temporary file also the writes
            # (about a tenth of a large renewal's CPU).
            conn.execute("PRAGMA temp_store = MEMORY")
        except BaseException:
            conn.close()
            raise
        return conn

    def _check_schema(self) -> None:
        with self._translate("read-only open"):
            found = check_schema(self._path, self._table, self._connect)
        if not found:
            raise MissingStoreError(
                f"SQLite file {self._path!r} has no table {self._table!r} (opened read-only, so "
                f"it is not created)"
            )

    # -- errors ------------------------------------------------------------------------------

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"SqliteStorage({self._path!r}) is closed")

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()
        self._identity.raise_if_failed()

    def _translate(self, what: str) -> _DriverErrors:
        """Turn a driver error into StorageError (ClosedError once the storage is closed)."""
        return _DriverErrors(self, what)

    # -- reads -------------------------------------------------------------------------------

    @property
    def capabilities(self) -> StorageCapabilities:
        return _CAPABILITIES

    @property
    def read_only(self) -> bool:
        """Whether the store was opened read-only."""
        return self._read_only

    @property
    def path(self) -> str:
        """The database file."""
        return self._path

    @property
    def table(self) -> str:
        """The table holding the keys."""
        return self._table

    def fence_target(self) -> SqliteFenceTarget:
        """Where this store's table is, for :mod:`weft_sync.fencing` (see
        :class:`~weft_sync.storage.fence_proof.SupportsHostFence`)."""
        self._check_open()
        return self._fence_target

    def get(self, key: str) -> bytes | None:
        validate_key(key)
        self._check_open()
        with self._translate("get"), self._readers.for_thread() as conn:
            row = conn.execute(self._sql_get, (key,)).fetchone()
        return None if row is None else as_bytes(row[0])

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Read many keys in one read transaction (one snapshot), :data:`_GET_MANY_CHUNK` keys
        per query. See :class:`~weft_sync.storage.reads.SupportsGetMany`.
        """
        checked = validate_keys(keys)
        self._check_open()
        if not checked:
            return []
        unique = list(dict.fromkeys(checked))
        found: dict[str, bytes | None] = {}
        with self._translate("get_many"), self._readers.for_thread() as conn:
            conn.execute("BEGIN")
            try:
                for start in range(0, len(unique), _GET_MANY_CHUNK):
                    part = unique[start : start + _GET_MANY_CHUNK]
                    sql = self._sql_get_many + "(" + ",".join("?" * len(part)) + ")"
                    found.update((key, as_bytes(value)) for key, value in conn.execute(sql, part))
            finally:
                if conn.in_transaction:
                    conn.execute("COMMIT")  # ends the read transaction; nothing was written
        return [found.get(key) for key in checked]

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
        sql, args = self._scan_query(prefix, comparisons, limit, reverse)
        self._check_open()
        with self._translate("scan"), self._readers.for_thread() as conn:
            rows = conn.execute(sql, args).fetchall()
        # A NULL value (only a foreign writer can store one) reads as absent, as in get().
        return [(str(k), v) for k, raw in rows if (v := as_bytes(raw)) is not None]

    def _scan_query(
        self, prefix: str, comparisons: list[tuple[str, str]], limit: int | None, reverse: bool
    ) -> tuple[str, list[object]]:
        # A lower bound stays for an empty prefix too: it leaves out NULL keys a foreign writer
        # may have stored. Only the tightest bound of each side goes in (see tightest_bounds).
        bounds = tightest_bounds(prefix, comparisons)
        sql = [self._sql_scan, " AND ".join(f" key {op} ?" for op, _ in bounds)]
        args: list[object] = [bound for _, bound in bounds]
        sql.append(" ORDER BY key DESC LIMIT ?" if reverse else " ORDER BY key ASC LIMIT ?")
        args.append(-1 if limit is None else limit)
        return "".join(sql), args

    # -- writes ------------------------------------------------------------------------------

    def put(self, key: str, value: bytes) -> None:
        self._submit([([], validate_operations([Put(key, value)]))])

    def delete(self, key: str) -> None:
        self._submit([([], validate_operations([Delete(key)]))])

    def batch(self, operations: Sequence[Operation]) -> None:
        checked = validate_operations(operations)
        if checked:
            self._submit([([], checked)])
        else:
            self._check_open()

    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool:
        row = renewal_row(conditions, operations)
        if row is not None:
            return self._submit([], [row])[0]
        return self._submit([validate_batch(conditions, operations)])[0]

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        checked: list[tuple[list[Condition], list[Operation]]] = []
        rows: list[RenewalRow] = []
        for item in batches:
            conditions, operations = check_batch_shape(item)
            row = None if checked else renewal_row(conditions, operations)
            if row is not None:
                rows.append(row)
            else:
                checked.append(validate_batch(conditions, operations))
        if not rows and not checked:
            self._check_open()
            return []
        if not checked:
            return self._submit([], rows)
        # Not every batch is a renewal: the renewals seen first go through the general path too.
        return self._submit([renewal_batch(row) for row in rows] + checked)

    def compare_and_set_many(self, rows: Sequence[CasRow]) -> list[bool]:
        """Set each ``(key, expected, new)`` row's key to ``new`` if it holds ``expected``.

        One ``BEGIN IMMEDIATE`` transaction runs one ``executemany`` of ``UPDATE … SET value =
        new WHERE key = ? AND value = expected``; when some condition fails, the rows are judged
        one by one instead. See :class:`~weft_sync.storage.cas.SupportsCompareAndSetMany`.
        """
        checked = validate_cas_rows(rows)
        if not checked:
            self._check_open()
            return []
        return self._submit([], checked)

    def read_then_write(
        self, keys: Sequence[str], decide: Decide
    ) -> tuple[list[bytes | None], bool]:
        """Read ``keys`` inside a write transaction and apply the batch ``decide`` makes of
        them, in that transaction. See
        :class:`~weft_sync.storage.read_then_write.SupportsReadThenWrite`.
        """
        checked = validate_keys(keys)
        request = self._submit_request([], None, (checked, decide))
        committed = request.wait()[0]
        return request.values, committed

    def _submit(
        self,
        batches: list[tuple[list[Condition], list[Operation]]],
        renewals: list[RenewalRow] | None = None,
    ) -> list[bool]:
        return self._submit_request(batches, renewals).wait()

    def _submit_request(
        self,
        batches: list[tuple[list[Condition], list[Operation]]],
        renewals: list[RenewalRow] | None,
        read: tuple[list[str], Decide] | None = None,
    ) -> WriteRequest:
        """Commit a request (on this thread when the writer is idle, else queued); return it
        once finished or queued: its ``wait()`` gives the results or raises."""
        if self._read_only:
            self._check_open()
            raise ReadOnlyStorageError(
                f"SqliteStorage({self._path!r}) was opened read-only; writes are refused"
            )
        fast = False
        # The transaction lock taken by try_begin_fast is given back in this finally, whatever
        # interrupts the commit (a KeyboardInterrupt lands between any two statements).
        try:
            with self._lock:
                self._check_open()
                writer = self._writer or self._start_writer()
                # Deciding under this lock orders the decision against queueing: a request
                # already queued commits before this one.
                fast = writer.try_begin_fast()
                if not fast:
                    request = WriteRequest(batches, renewals, read=read)
                    self._queue.put(request)
            if fast:
                request = WriteRequest(batches, renewals, queued=False, read=read)
                hand_over = writer.commit_fast(request)
        finally:
            if fast:
                writer.end_fast()
        if fast:
            hand_over()
        return request

    def _start_writer(self) -> SqliteWriter:
        """Create and start the writer thread; the caller holds ``_lock``."""
        writer = self._writer = SqliteWriter(
            self._queue,
            name=f"weft-sqlite-writer[{os.path.basename(self._path)}:{self._table}]",
            table=self._table,
            connect=self._connect,
            translate=self._translate,
            file_lock=self._file_lock,
            busy_timeout_ms=self._busy_timeout_ms,
            bound=self._bound,
            before_commit=self._identity.check_before_commit,
        )
        writer.start()
        return writer

    # -- identity ----------------------------------------------------------------------------

    def verify_identity(self) -> None:
        """Check that the file at the path is still the store this object opened.

        Compares the device/inode of the database file, its ``-wal`` and ``-shm`` with the ones
        recorded at open, and reads the store id back through a fresh connection (see
        :mod:`~weft_sync.storage.sqlite.identity`). Every write transaction runs the file part
        of this check before it commits; the maintenance task calls this once per pass.

        :raises StoreIdentityError: the file was deleted, replaced or lost its WAL (now or
            before); every later call of this storage raises it too.
        :raises StorageError: the store id could not be read.
        """
        self._check_open()
        # The fresh connection is opened and closed under opening(), so a child can tell.
        with sqlite_fork.opening(), self._translate("identity check"):
            self._identity.verify()

    # -- views and lifecycle -----------------------------------------------------------------

    def dict_view(self) -> SqliteDict:
        """Open a read-only ``SqliteDict`` over this file and table; the caller closes it.

        Values are the stored bytes (identity encode/decode). The view runs its own thread.
        """
        from sqlitedict import SqliteDict

        self._check_open()
        return SqliteDict(
            self._path,
            tablename=self._table,
            flag="r",
            journal_mode="WAL",
            encode=_identity,
            decode=_identity,
            outer_stack=False,
        )

    def bound_waits(self, deadline: float | None) -> None:
        """See :class:`~weft_sync.storage.wait_bound.SupportsWaitBound`."""
        self._bound.set(deadline)

    def close(self, timeout: float | None = None) -> None:
        """Stop the writer thread and close every connection; idempotent.

        :param timeout: seconds to wait for the write in flight and the writer thread; waits
            for other connections' locks end then too (as with :meth:`bound_waits`). ``None``:
            until the bound, if one is set, else twice the busy timeout and 5 s more. A writer
            still running then is left behind (logged).

        In a child that inherited this instance across ``os.fork()`` it only lets go of the
        inherited copies (see the class docstring): the parent still uses the originals.
        """
        if self._fork_pid != os.getpid():
            if not self._closed:
                self._abandon_in_child(close=False)
            return
        now = time.monotonic()
        if timeout is not None:
            self._bound.set(now + max(0.0, timeout))
        # A bounded close waits past its bound only as long as a lock wait it cut takes to end.
        stop_by = min(
            now + 2 * self._busy_timeout_ms / 1000.0 + _JOIN_GRACE_S,
            max(now, self._bound.deadline) + _BOUND_GRACE_S,
        )
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # _writer stays set: one that does not stop in time keeps a connection that a
            # forked child must still leave alone (see _in_sqlite).
            writer = self._writer
            # Requests the writer has not taken yet fail; those being committed finish.
            pending = self._queue.drain()
            if writer is not None:
                self._queue.put_stop()
        for request in pending:
            request.finish(None, self._closed_error())
        stopped = writer is None or self._stop_writer(writer, stop_by)
        if stopped:
            self._file_lock.close()
        for request in self._queue.drain():
            request.finish(None, self._closed_error())
        self._readers.close_all()
        if stopped:
            self._identity.close()
            sqlite_fork.untrack(self)

    def _stop_writer(self, writer: SqliteWriter, deadline: float) -> bool:
        """Join the writer thread and close its connection by ``deadline``; say whether done."""
        writer.join(timeout=max(0.0, deadline - time.monotonic()))
        if writer.is_alive():
            _log.warning(
                "SQLite writer thread %s did not stop in time; it is left running (a daemon) "
                "and its connection open",
                writer.name,
            )
            return False
        # A caller may still be committing on the write connection: wait for it.
        if not writer.close_connection(max(0.0, deadline - time.monotonic())):
            _log.warning("SQLite write on %r did not finish in time", self._path)
            return False
        return True

    def __enter__(self) -> SqliteStorage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._fork_pid != os.getpid():
            state = f"inherited from process {self._fork_pid}"
        else:
            state = "closed" if self._closed else "open"
        if self._read_only:
            state += ", read-only"
        return f"SqliteStorage({self._path!r}, table={self._table!r}, {state})"
