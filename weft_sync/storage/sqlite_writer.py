"""The SQLite backend's write path: the request queue, the group-commit writer thread, the flock.

Internal to :mod:`weft_sync.storage.sqlite`; :class:`~weft_sync.storage.sqlite.SqliteStorage`
queues every write here and waits for its outcome.
"""

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Final

from ..errors import StorageError
from .base import Condition, Operation, Put, validate_key

__all__ = [
    "RenewalRow",
    "RequestQueue",
    "SqliteWriter",
    "WriteRequest",
    "WriterFileLock",
    "as_bytes",
    "renewal_batch",
    "renewal_row",
]

_log = logging.getLogger(__name__)

# Requests committed together in one transaction at most; bounds the work a failure throws away.
_MAX_GROUP: Final = 256
_LOCK_POLL_MIN_S: Final = 0.0002
_LOCK_POLL_MAX_S: Final = 0.005
_STOP: Final = object()

# ``(new value, key, expected value)`` of a renewal-shaped batch.
RenewalRow = tuple[bytes, str, bytes]


def as_bytes(value: object) -> bytes | None:
    """Normalise a stored BLOB (bytes, memoryview or, for foreign writers, text) to bytes."""
    if value is None or type(value) is bytes:
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise StorageError(f"stored value of type {type(value).__name__} is not a BLOB: {value!r:.80}")


def renewal_row(
    conditions: Sequence[Condition], operations: Sequence[Operation]
) -> RenewalRow | None:
    """Validate a ``[Condition(k, bytes)] -> [Put(k, bytes)]`` batch and return its row.

    Any other batch gives ``None`` (and is left to :func:`~.base.validate_batch`). Such a batch
    commits exactly when ``UPDATE … SET value = new WHERE key = k AND value = expected`` changes
    a row.
    """
    if len(conditions) != 1 or len(operations) != 1:
        return None
    cond, op = conditions[0], operations[0]
    if type(cond) is not Condition or type(op) is not Put or op.key != cond.key:
        return None
    if type(cond.expected) is not bytes or type(op.value) is not bytes:
        return None
    return op.value, validate_key(cond.key), cond.expected


def renewal_batch(row: RenewalRow) -> tuple[list[Condition], list[Operation]]:
    """Return the conditional batch a renewal row stands for."""
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


class WriteRequest:
    """Conditional batches committed together; the caller blocks in :meth:`wait`.

    ``renewals`` replaces ``batches`` when every batch is renewal-shaped (see
    :func:`renewal_row`).
    """

    __slots__ = ("batches", "done", "error", "renewals", "results")

    def __init__(
        self,
        batches: list[tuple[list[Condition], list[Operation]]],
        renewals: list[RenewalRow] | None = None,
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

    def wait(self) -> list[bool]:
        """Block until the request is finished; return one result per batch or raise its error."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.results is not None
        return self.results


class RequestQueue:
    """The requests waiting for the writer thread, followed by its stop signal once stopping.

    Safe to use from any thread (a ``queue.SimpleQueue`` underneath).
    """

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()

    def put(self, request: WriteRequest) -> None:
        self._items.put(request)

    def put_stop(self) -> None:
        """Tell the writer thread to stop once it has committed what it took before this."""
        self._items.put(_STOP)

    def qsize(self) -> int:
        return self._items.qsize()

    def next_group(self) -> tuple[list[WriteRequest], bool]:
        """Wait for requests; return up to ``_MAX_GROUP`` of them and whether to stop after them."""
        group: list[WriteRequest] = []
        item = self._items.get()
        while True:
            if item is _STOP:
                return group, True
            assert isinstance(item, WriteRequest)
            group.append(item)
            if len(group) >= _MAX_GROUP:
                return group, False
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return group, False

    def drain(self) -> list[WriteRequest]:
        """Remove and return every request queued now, without waiting."""
        drained: list[WriteRequest] = []
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return drained
            if isinstance(item, WriteRequest):
                drained.append(item)


class WriterFileLock:
    """``flock`` on ``<path>.lock``, the mutex between writers in different processes.

    Not thread-safe, and it need not be: one thread at a time uses it (the storage's constructor,
    then the writer thread), and the descriptor is closed only when no writer thread runs.

    :param path: the lock file; created if missing.
    :param timeout_ms: how long :meth:`hold` waits for another process to let go.
    """

    def __init__(self, path: str, timeout_ms: int) -> None:
        self._path = path
        self._timeout_ms = timeout_ms
        self._fd: int | None = None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the lock for the duration of one write transaction.

        :raises StorageError: another process held it for longer than the timeout.
        """
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fd = self._fd
        deadline = time.monotonic() + self._timeout_ms / 1000.0
        delay = _LOCK_POLL_MIN_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # Polling (not a blocking flock) keeps the wait bounded by the busy timeout.
                if time.monotonic() >= deadline:
                    raise StorageError(
                        f"timed out after {self._timeout_ms} ms waiting for the writer lock "
                        f"{self._path!r} held by another process"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, _LOCK_POLL_MAX_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the descriptor, if open; the next :meth:`hold` opens a new one."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class SqliteWriter:
    """Commit queued requests in groups on one named daemon thread, with one connection.

    Each group is one ``BEGIN IMMEDIATE`` transaction taken under the :class:`WriterFileLock`;
    each request in it runs under its own SAVEPOINT, so its failed condition or error leaves the
    others intact. An error that aborts the transaction itself fails every request in the group.

    :param requests: the queue to drain; :meth:`RequestQueue.put_stop` ends the thread.
    :param name: the thread's name.
    :param table: the (validated) table name.
    :param connect: opens a configured autocommit connection to the database.
    :param translate: wraps driver errors of the named action into ``StorageError``.
    :param file_lock: the cross-process writer mutex.
    """

    def __init__(
        self,
        requests: RequestQueue,
        *,
        name: str,
        table: str,
        connect: Callable[[], sqlite3.Connection],
        translate: Callable[[str], AbstractContextManager[None]],
        file_lock: WriterFileLock,
    ) -> None:
        quoted = f'"{table}"'
        self._sql_get = f"SELECT value FROM {quoted} WHERE key = ?"
        self._sql_put = f"REPLACE INTO {quoted} (key, value) VALUES (?, ?)"
        self._sql_delete = f"DELETE FROM {quoted} WHERE key = ?"
        self._sql_renew = f"UPDATE {quoted} SET value = ? WHERE key = ? AND value = ?"
        self._requests = requests
        self._connect = connect
        self._translate = translate
        self._file_lock = file_lock
        # Opened and closed by the writer thread only.
        self._conn: sqlite3.Connection | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def name(self) -> str:
        return self._thread.name

    @property
    def connection(self) -> sqlite3.Connection | None:
        """The writer thread's connection while it has one open."""
        return self._conn

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        stop = False
        try:
            while not stop:
                group, stop = self._requests.next_group()
                if group:
                    self._commit_group(group)
        finally:
            conn, self._conn = self._conn, None
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()

    def _commit_group(self, group: list[WriteRequest]) -> None:
        outcomes: list[tuple[list[bool] | None, BaseException | None]] = []
        try:
            with self._translate("write transaction"):
                if self._conn is None:
                    self._conn = self._connect()
                conn = self._conn
                with self._file_lock.hold():
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
        self, conn: sqlite3.Connection, request: WriteRequest
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

    def _apply_renewals(self, conn: sqlite3.Connection, rows: list[RenewalRow]) -> list[bool]:
        """Apply renewal rows in order, inside the request's savepoint."""
        # The key is unique, so each UPDATE changes at most one row, and changes one exactly when
        # its condition held at its turn: a full count is the sequential outcome of every row.
        if conn.executemany(self._sql_renew, rows).rowcount == len(rows):
            return [True] * len(rows)
        # Some condition failed (or a foreign writer stored text): judge row by row.
        conn.execute("ROLLBACK TO weft_request")
        return [self._apply_batch(conn, *renewal_batch(row)) for row in rows]

    def _apply_batch(
        self, conn: sqlite3.Connection, conditions: list[Condition], operations: list[Operation]
    ) -> bool:
        for cond in conditions:
            row = conn.execute(self._sql_get, (cond.key,)).fetchone()
            stored = None if row is None else as_bytes(row[0])
            if stored != cond.expected:
                return False
        for op in operations:
            if isinstance(op, Put):
                conn.execute(self._sql_put, (op.key, op.value))
            else:
                conn.execute(self._sql_delete, (op.key,))
        return True
