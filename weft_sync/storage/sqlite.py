"""The SQLite backend: one sqlitedict-compatible table, one writer thread, per-thread readers."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import logging
import os
import queue
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Final

from ..errors import ClosedError, StorageError
from .base import (
    Batch,
    Condition,
    Delete,
    Operation,
    Put,
    StorageCapabilities,
    prefix_upper_bound,
    validate_batch,
    validate_key,
    validate_operations,
    validate_table_name,
)

if TYPE_CHECKING:
    from sqlitedict import SqliteDict

__all__ = ["SqliteStorage"]

_log = logging.getLogger(__name__)

SYNCHRONOUS_MODES: Final = ("FULL", "NORMAL")
_CAPABILITIES: Final = StorageCapabilities(
    conditional_batch=True, multi_process=True, multi_host=False
)
# Requests committed together in one transaction at most; bounds the work a failure throws away.
_MAX_GROUP: Final = 256
_LOCK_POLL_MIN_S: Final = 0.0002
_LOCK_POLL_MAX_S: Final = 0.005
_JOIN_GRACE_S: Final = 5.0
_STOP: Final = object()
_BOUNDS: Final = (("gt", ">"), ("gte", ">="), ("lt", "<"), ("lte", "<="))

# Connections inherited across os.fork() are never closed in the child (closing a copied handle
# can checkpoint or unlink the parent's WAL); keeping them referenced here stops finalisation.
_INHERITED: list[object] = []
# Guards the one-time reset of a storage object in a forked child; recreated in every child.
_fork_lock = threading.Lock()
_LIVE: weakref.WeakSet[SqliteStorage] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Reset eagerly so inherited handles are pinned even if the child never uses the storage;
    # the pid check on every call covers forks that skip these hooks.
    global _fork_lock
    _fork_lock = threading.Lock()
    for storage in list(_LIVE):
        storage._ensure_process()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _identity(value: object) -> object:
    return value


def _as_bytes(value: object) -> bytes | None:
    """Normalise a stored BLOB (bytes, memoryview or, for foreign writers, text) to bytes."""
    if value is None or type(value) is bytes:
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise StorageError(f"stored value of type {type(value).__name__} is not a BLOB: {value!r:.80}")


# ``(new value, key, expected value)`` of a renewal-shaped batch.
_RenewalRow = tuple[bytes, str, bytes]


def _renewal_row(
    conditions: Sequence[Condition], operations: Sequence[Operation]
) -> _RenewalRow | None:
    """Validate a ``[Condition(k, bytes)] -> [Put(k, bytes)]`` batch and return its row.

    Any other batch gives ``None`` (and is left to :func:`validate_batch`). Such a batch commits
    exactly when ``UPDATE … SET value = new WHERE key = k AND value = expected`` changes a row.
    """
    if len(conditions) != 1 or len(operations) != 1:
        return None
    cond, op = conditions[0], operations[0]
    if type(cond) is not Condition or type(op) is not Put or op.key != cond.key:
        return None
    if type(cond.expected) is not bytes or type(op.value) is not bytes:
        return None
    return op.value, validate_key(cond.key), cond.expected


def _renewal_batch(row: _RenewalRow) -> tuple[list[Condition], list[Operation]]:
    new, key, expected = row
    return [Condition(key, expected)], [Put(key, new)]


def _duplicate(exc: BaseException) -> BaseException:
    """Copy an exception with its cause; fall back to the original if it cannot be copied."""
    try:
        dup = copy.copy(exc)
    except Exception:
        return exc
    dup.__cause__ = exc.__cause__
    dup.__suppress_context__ = exc.__suppress_context__
    return dup


class _Request:
    """Conditional batches committed together; the caller waits on ``done``.

    ``renewals`` replaces ``batches`` when every batch is renewal-shaped (see
    :func:`_renewal_row`).
    """

    __slots__ = ("batches", "done", "error", "renewals", "results")

    def __init__(
        self,
        batches: list[tuple[list[Condition], list[Operation]]],
        renewals: list[_RenewalRow] | None = None,
    ) -> None:
        self.batches = batches
        self.renewals = renewals
        self.done = threading.Event()
        self.results: list[bool] | None = None
        self.error: BaseException | None = None

    def finish(self, results: list[bool] | None, error: BaseException | None) -> None:
        self.results = results
        self.error = error
        self.done.set()


class SqliteStorage:
    """Store keys in one SQLite file, safely across threads and processes on one host.

    The table has sqlitedict's schema, so :meth:`dict_view` can open it as a ``SqliteDict``.
    The file uses WAL with ``synchronous`` ``FULL`` (or ``NORMAL``) and a busy timeout.

    Threads: every write is queued to one writer thread per instance, which drains the queue into
    a single ``BEGIN IMMEDIATE`` transaction (group commit) and applies each request under its own
    SAVEPOINT, so one request's failed condition or error leaves the others intact. A request
    whose batches are all renewal-shaped (one condition expecting bytes, one put of the same key)
    runs as one ``executemany`` of ``UPDATE … WHERE key = ? AND value = ?``, judged batch by batch
    only when a row did not change. Reads use one connection per thread; WAL readers never block
    the writer.

    Processes: writers in different processes are serialised by ``flock`` on ``<path>.lock``,
    held only while a write transaction runs, and ``BEGIN IMMEDIATE`` takes SQLite's write lock
    before any condition is read. After ``os.fork()`` the child leaves the inherited connections
    and writer thread alone and opens its own. Several hosts must not share the file.

    :param path: the database file; created if missing. ``":memory:"`` is refused.
    :param table: the table name (letters, digits, underscores).
    :param busy_timeout_ms: how long a write waits for another writer, and a read for a lock.
    :param synchronous: ``"FULL"`` or ``"NORMAL"``.
    :raises ValueError: a bad table name, timeout, ``synchronous`` mode or path.
    :raises StorageError: the file cannot be opened or the table cannot be created.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        table: str = "weft_kv",
        busy_timeout_ms: int = 5000,
        synchronous: str = "FULL",
    ) -> None:
        self._path = os.fspath(path)
        if not isinstance(self._path, str) or not self._path or self._path == ":memory:":
            raise ValueError(
                f"SqliteStorage needs a database file path, got {path!r}; in-memory databases "
                f"cannot be shared between connections"
            )
        self._table = validate_table_name(table)
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
        self._lock_path = self._path + ".lock"
        quoted = f'"{self._table}"'
        self._sql_get = f"SELECT value FROM {quoted} WHERE key = ?"
        self._sql_put = f"REPLACE INTO {quoted} (key, value) VALUES (?, ?)"
        self._sql_delete = f"DELETE FROM {quoted} WHERE key = ?"
        self._sql_renew = f"UPDATE {quoted} SET value = ? WHERE key = ? AND value = ?"
        self._sql_scan = f"SELECT key, value FROM {quoted} WHERE key >= ?"

        # Guards _closed, _queue, _writer, _readers and the per-process fields below.
        self._lock = threading.Lock()
        self._closed = False
        self._init_process_state()
        try:
            self._create_schema()
        except BaseException:
            self._release_lock_fd()
            raise
        _LIVE.add(self)

    # -- per-process state -------------------------------------------------------------------

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._local = threading.local()
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._writer_conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._readers: list[tuple[threading.Thread, sqlite3.Connection]] = []

    def _ensure_process(self) -> None:
        """Abandon state inherited from a parent process; the child opens its own lazily."""
        if self._pid == os.getpid():
            return
        with _fork_lock:
            if self._pid == os.getpid():
                return
            _INHERITED.extend(conn for _, conn in self._readers)
            if self._writer_conn is not None:
                _INHERITED.append(self._writer_conn)
            if self._lock_fd is not None:
                # Closing a duplicated descriptor never releases the parent's flock.
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)
            # The parent's lock may have been held by a thread that does not exist here.
            self._lock = threading.Lock()
            self._init_process_state()

    # -- connections -------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self._path,
            timeout=self._busy_timeout_ms / 1000.0,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms:d}")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _create_schema(self) -> None:
        with self._translate("open"):
            conn = self._connect()
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StorageError(
                        f"could not switch {self._path!r} to WAL journal mode (it is {mode!r})"
                    )
                with self._file_lock():
                    conn.execute(
                        f'CREATE TABLE IF NOT EXISTS "{self._table}" '
                        f"(key TEXT PRIMARY KEY, value BLOB)"
                    )
            finally:
                conn.close()

    def _reader(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        conn = self._connect()
        me = threading.current_thread()
        with self._lock:
            if self._closed:
                stale = [conn]
            else:
                # Connections of threads that have ended are closed here rather than leaked.
                stale = [c for t, c in self._readers if not t.is_alive()]
                self._readers = [(t, c) for t, c in self._readers if t.is_alive()]
                self._readers.append((me, conn))
                self._local.conn = conn
        for old in stale:
            with contextlib.suppress(sqlite3.Error):
                old.close()
        self._check_open()
        return conn

    # -- errors ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"SqliteStorage({self._path!r}) is closed")

    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """Turn a driver error into StorageError (ClosedError once the storage is closed)."""
        try:
            yield
        except sqlite3.Error as exc:
            if self._closed and isinstance(exc, sqlite3.ProgrammingError):
                raise ClosedError(f"SqliteStorage({self._path!r}) is closed") from exc
            raise StorageError(
                f"SQLite {what} failed on {self._path!r} table {self._table!r}: {exc}"
            ) from exc
        except OSError as exc:
            raise StorageError(
                f"SQLite {what} failed on {self._path!r} table {self._table!r}: {exc}"
            ) from exc

    # -- reads -------------------------------------------------------------------------------

    @property
    def capabilities(self) -> StorageCapabilities:
        return _CAPABILITIES

    @property
    def path(self) -> str:
        """The database file."""
        return self._path

    @property
    def table(self) -> str:
        """The table holding the keys."""
        return self._table

    def get(self, key: str) -> bytes | None:
        validate_key(key)
        self._ensure_process()
        self._check_open()
        with self._translate("get"):
            row = self._reader().execute(self._sql_get, (key,)).fetchone()
        return None if row is None else _as_bytes(row[0])

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
        sql, args = self._scan_query(prefix, (gt, gte, lt, lte), limit, reverse)
        self._ensure_process()
        self._check_open()
        with self._translate("scan"):
            rows = self._reader().execute(sql, args).fetchall()
        # A NULL value (only a foreign writer can store one) reads as absent, as in get().
        return [(str(k), v) for k, raw in rows if (v := _as_bytes(raw)) is not None]

    def _scan_query(
        self,
        prefix: str,
        bounds: tuple[str | None, str | None, str | None, str | None],
        limit: int | None,
        reverse: bool,
    ) -> tuple[str, list[object]]:
        validate_key(prefix)
        if limit is not None and (type(limit) is not int or limit < 0):
            raise ValueError(f"scan limit must be None or a non-negative int, got {limit!r}")
        sql = [self._sql_scan]
        args: list[object] = [prefix]
        upper = prefix_upper_bound(prefix)
        if upper is not None:
            sql.append(" AND key < ?")
            args.append(upper)
        for (name, op), bound in zip(_BOUNDS, bounds, strict=True):
            if bound is not None:
                try:
                    validate_key(bound)
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"scan bound {name}: {exc}") from None
                sql.append(f" AND key {op} ?")
                args.append(bound)
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
            self._ensure_process()
            self._check_open()

    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool:
        row = _renewal_row(conditions, operations)
        if row is not None:
            return self._submit([], [row])[0]
        return self._submit([validate_batch(conditions, operations)])[0]

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        checked: list[tuple[list[Condition], list[Operation]]] = []
        rows: list[_RenewalRow] = []
        for item in batches:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(
                    f"each conditional batch must be a (conditions, operations) tuple, got {item!r}"
                )
            row = None if checked else _renewal_row(item[0], item[1])
            if row is not None:
                rows.append(row)
            else:
                checked.append(validate_batch(item[0], item[1]))
        if not rows and not checked:
            self._ensure_process()
            self._check_open()
            return []
        if not checked:
            return self._submit([], rows)
        # Not every batch is a renewal: the renewals seen first go through the general path too.
        return self._submit([_renewal_batch(row) for row in rows] + checked)

    def _submit(
        self,
        batches: list[tuple[list[Condition], list[Operation]]],
        renewals: list[_RenewalRow] | None = None,
    ) -> list[bool]:
        self._ensure_process()
        request = _Request(batches, renewals)
        with self._lock:
            self._check_open()
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._writer_loop,
                    name=f"weft-sqlite-writer[{os.path.basename(self._path)}:{self._table}]",
                    daemon=True,
                )
                self._writer.start()
            self._queue.put(request)
        request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.results is not None
        return request.results

    # -- the writer thread -------------------------------------------------------------------

    def _writer_loop(self) -> None:
        q = self._queue
        stop = False
        try:
            while not stop:
                group: list[_Request] = []
                item = q.get()
                while True:
                    if item is _STOP:
                        stop = True
                        break
                    assert isinstance(item, _Request)
                    group.append(item)
                    if len(group) >= _MAX_GROUP:
                        break
                    try:
                        item = q.get_nowait()
                    except queue.Empty:
                        break
                if group:
                    self._commit_group(group)
        finally:
            conn, self._writer_conn = self._writer_conn, None
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()

    def _commit_group(self, group: list[_Request]) -> None:
        outcomes: list[tuple[list[bool] | None, BaseException | None]] = []
        try:
            with self._translate("write transaction"):
                if self._writer_conn is None:
                    self._writer_conn = self._connect()
                conn = self._writer_conn
                with self._file_lock():
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        outcomes = [self._apply_request(conn, req) for req in group]
                        conn.execute("COMMIT")
                    except BaseException:
                        if conn.in_transaction:
                            with contextlib.suppress(sqlite3.Error):
                                conn.execute("ROLLBACK")
                        raise
        except BaseException as exc:
            _log.debug("SQLite write transaction of %d requests failed: %s", len(group), exc)
            # Nothing in the group committed, so every caller gets the error (its own copy, so
            # threads raising it do not share one traceback).
            for i, req in enumerate(group):
                req.finish(None, exc if i == 0 else _duplicate(exc))
            if not isinstance(exc, Exception):
                raise
            return
        for req, (results, error) in zip(group, outcomes, strict=True):
            req.finish(results, error)

    def _apply_request(
        self, conn: sqlite3.Connection, request: _Request
    ) -> tuple[list[bool] | None, BaseException | None]:
        conn.execute("SAVEPOINT weft_request")
        try:
            with self._translate("write"):
                if request.renewals is not None:
                    results = self._apply_renewals(conn, request.renewals)
                else:
                    results = [self._apply_batch(conn, c, o) for c, o in request.batches]
        except StorageError as exc:
            if not conn.in_transaction:
                raise  # SQLite rolled the whole transaction back: every request in it is lost.
            conn.execute("ROLLBACK TO weft_request")
            conn.execute("RELEASE weft_request")
            return None, exc
        conn.execute("RELEASE weft_request")
        return results, None

    def _apply_renewals(self, conn: sqlite3.Connection, rows: list[_RenewalRow]) -> list[bool]:
        """Apply renewal rows in order, inside the request's savepoint."""
        # The key is unique, so each UPDATE changes at most one row, and changes one exactly when
        # its condition held at its turn: a full count is the sequential outcome of every row.
        if conn.executemany(self._sql_renew, rows).rowcount == len(rows):
            return [True] * len(rows)
        # Some condition failed (or a foreign writer stored text): judge row by row.
        conn.execute("ROLLBACK TO weft_request")
        return [self._apply_batch(conn, *_renewal_batch(row)) for row in rows]

    def _apply_batch(
        self, conn: sqlite3.Connection, conditions: list[Condition], operations: list[Operation]
    ) -> bool:
        for cond in conditions:
            row = conn.execute(self._sql_get, (cond.key,)).fetchone()
            stored = None if row is None else _as_bytes(row[0])
            if stored != cond.expected:
                return False
        for op in operations:
            if isinstance(op, Put):
                conn.execute(self._sql_put, (op.key, op.value))
            else:
                conn.execute(self._sql_delete, (op.key,))
        return True

    # -- the cross-process writer mutex --------------------------------------------------------

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """Hold ``flock`` on ``<path>.lock`` for the duration of one write transaction."""
        if self._lock_fd is None:
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        fd = self._lock_fd
        deadline = time.monotonic() + self._busy_timeout_ms / 1000.0
        delay = _LOCK_POLL_MIN_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # Polling (not a blocking flock) keeps the wait bounded by the busy timeout.
                if time.monotonic() >= deadline:
                    raise StorageError(
                        f"timed out after {self._busy_timeout_ms} ms waiting for the writer lock "
                        f"{self._lock_path!r} held by another process"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, _LOCK_POLL_MAX_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _release_lock_fd(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- views and lifecycle -----------------------------------------------------------------

    def dict_view(self) -> SqliteDict:
        """Open a read-only ``SqliteDict`` over this file and table; the caller closes it.

        Values are the stored bytes (identity encode/decode). The view runs its own thread.
        """
        from sqlitedict import SqliteDict

        self._ensure_process()
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

    def close(self) -> None:
        """Stop the writer thread and close every connection; idempotent."""
        self._ensure_process()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            writer, readers = self._writer, self._readers
            self._writer, self._readers = None, []
            self._local = threading.local()
            # Requests the writer has not taken yet fail; the one it is committing finishes.
            pending = self._drain_queue()
            if writer is not None:
                self._queue.put(_STOP)
        for request in pending:
            request.finish(None, ClosedError(f"SqliteStorage({self._path!r}) is closed"))
        if writer is not None:
            writer.join(timeout=2 * self._busy_timeout_ms / 1000.0 + _JOIN_GRACE_S)
            if writer.is_alive():
                _log.warning("SQLite writer thread %s did not stop in time", writer.name)
        if writer is None or not writer.is_alive():
            self._release_lock_fd()
        for request in self._drain_queue():
            request.finish(None, ClosedError(f"SqliteStorage({self._path!r}) is closed"))
        for _, conn in readers:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def _drain_queue(self) -> list[_Request]:
        drained: list[_Request] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return drained
            if isinstance(item, _Request):
                drained.append(item)

    def __enter__(self) -> SqliteStorage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"SqliteStorage({self._path!r}, table={self._table!r}, {state})"
