"""The SQLite backend's write path: the request queue, the group-commit writer thread, the flock.

Internal to :mod:`weft_sync.storage.sqlite.store`; :class:`~weft_sync.storage.SqliteStorage`
hands every write here: committed on the caller's thread when no other write is under way,
queued for the writer thread otherwise.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import fcntl
import functools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Final

from ..._fork import pin
from ...errors import StorageError
from ..base import Condition, Operation, Put, validate_batch, validate_key
from ..cas import CasRow
from ..read_then_write import Decide
from ..wait_bound import WaitDeadline

_log = logging.getLogger(__name__)

# Requests committed together in one transaction at most; bounds the work a failure throws away.
_MAX_GROUP: Final = 256
# Up to this many keys are read with one lookup each; more with one query (see _read).
_POINT_READS_MAX: Final = 4
_LOCK_POLL_MIN_S: Final = 0.0002
_LOCK_POLL_MAX_S: Final = 0.005
# SQLite's own busy wait cannot be interrupted (not even by Connection.interrupt()), so the write
# connection waits in slices of at most this long and the deadline is checked between them.
_BUSY_SLICE_MS: Final = 50
_SQLITE_BUSY: Final = 5
_STOP: Final = object()

# A renewal-shaped batch, or a compare_and_set_many row: ``(key, expected value, new value)``.
RenewalRow = CasRow


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
    return validate_key(cond.key), cond.expected, op.value


def renewal_batch(row: RenewalRow) -> tuple[list[Condition], list[Operation]]:
    """Return the conditional batch a renewal row stands for."""
    key, expected, new = row
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


def _gave_up(bound: WaitDeadline, natural: float, timeout_ms: int) -> str:
    """Say why a lock wait ended: the store began closing, or the busy timeout passed."""
    if bound.cuts(natural):
        return "gave up at the close deadline (the store is closing)"
    return f"timed out after {timeout_ms} ms"


def is_busy(exc: sqlite3.OperationalError) -> bool:
    """Whether SQLite gave up waiting for another connection's lock (``SQLITE_BUSY``)."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return (int(code) & 0xFF) == _SQLITE_BUSY
    return str(exc).startswith("database is locked")


def _finish(
    group: list[WriteRequest],
    outcomes: list[tuple[list[bool] | None, BaseException | None]],
    failure: BaseException | None,
) -> None:
    """Hand each request its outcome; re-raise a failure that is not an ``Exception``."""
    if failure is not None:
        _log.debug("SQLite write transaction of %d requests failed: %s", len(group), failure)
    for req, (results, error) in zip(group, outcomes, strict=True):
        req.finish(results, error)
    if failure is not None and not isinstance(failure, Exception):
        raise failure


class WriteRequest:
    """Conditional batches committed together; the caller blocks in :meth:`wait`.

    ``renewals`` replaces ``batches`` when every batch is renewal-shaped (see
    :func:`renewal_row`) or the rows come from ``compare_and_set_many``; ``read`` replaces both
    for a ``read_then_write``.
    """

    __slots__ = ("batches", "decide", "done", "error", "read_keys", "renewals", "results", "values")

    def __init__(
        self,
        batches: list[tuple[list[Condition], list[Operation]]],
        renewals: list[RenewalRow] | None = None,
        *,
        queued: bool = True,
        read: tuple[list[str], Decide] | None = None,
    ) -> None:
        self.batches = batches
        self.renewals = renewals
        # A read-then-write request (see weft_sync.storage.read_then_write): its keys are read
        # in the transaction, ``decide`` makes its one batch of them; ``values`` gets what was
        # read.
        self.read_keys: list[str] = [] if read is None else read[0]
        self.decide: Decide | None = None if read is None else read[1]
        self.values: list[bytes | None] = []
        # Only a queued request is finished by another thread; one its caller commits itself
        # (SqliteWriter.commit_fast) is finished before wait() is called, and needs no event.
        self.done = threading.Event() if queued else None
        self.results: list[bool] | None = None
        self.error: BaseException | None = None

    def finish(self, results: list[bool] | None, error: BaseException | None) -> None:
        self.results = results
        self.error = error
        if self.done is not None:
            self.done.set()

    def wait(self) -> list[bool]:
        """Block until the request is finished; return one result per batch or raise its error."""
        if self.done is not None:
            self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.results is not None
        return self.results


class RequestQueue:
    """The requests waiting for the writer thread, followed by its stop signal once stopping.

    Safe to use from any thread. A request stays queued until the writer thread takes it while
    holding the transaction lock, so a non-empty queue means the writer has work coming.
    """

    def __init__(self) -> None:
        # Guards _items; the writer thread waits on it for the next request or stop signal.
        self._cond = threading.Condition(threading.Lock())
        self._items: collections.deque[object] = collections.deque()

    def put(self, request: WriteRequest) -> None:
        with self._cond:
            self._items.append(request)
            self._cond.notify()

    def put_stop(self) -> None:
        """Tell the writer thread to stop once it has committed what it took before this."""
        with self._cond:
            self._items.append(_STOP)
            self._cond.notify()

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)

    def wait(self) -> None:
        """Block until a request or the stop signal is queued, without taking it."""
        with self._cond:
            while not self._items:
                self._cond.wait()

    def take_group(self) -> tuple[list[WriteRequest], bool]:
        """Take up to ``_MAX_GROUP`` queued requests and whether to stop after them."""
        group: list[WriteRequest] = []
        with self._cond:
            while self._items and len(group) < _MAX_GROUP:
                item = self._items.popleft()
                if item is _STOP:
                    return group, True
                assert isinstance(item, WriteRequest)
                group.append(item)
        return group, False

    def drain(self) -> list[WriteRequest]:
        """Remove and return every request queued now; a queued stop signal stays."""
        with self._cond:
            drained = [item for item in self._items if isinstance(item, WriteRequest)]
            stops = len(self._items) - len(drained)
            self._items.clear()
            self._items.extend([_STOP] * stops)
        return drained


class WriterFileLock:
    """``flock`` on ``<path>.lock``, the mutex between writers in different processes.

    Not thread-safe, and it need not be: one thread at a time uses it (the storage's constructor,
    then whichever thread holds the :class:`SqliteWriter`'s transaction lock), and the descriptor
    is closed only once no writer thread runs and no caller is committing. A forked child only
    closes its copy of the descriptor: an unlock through it would release the parent's lock.

    :param path: the lock file; created if missing.
    :param timeout_ms: how long :meth:`hold` waits for another process to let go.
    :param bound: ends the wait earlier once set (the store is closing).
    """

    def __init__(self, path: str, timeout_ms: int, bound: WaitDeadline | None = None) -> None:
        self._path = path
        self._timeout_ms = timeout_ms
        self._bound = WaitDeadline() if bound is None else bound
        self._fd: int | None = None
        # The descriptor __enter__ locked, unlocked by __exit__ (close() may clear _fd first).
        self._held: int | None = None

    def hold(self) -> WriterFileLock:
        """``with file_lock.hold():`` holds the lock for the duration of one write transaction.

        :raises StorageError: (on entering) another process held it for longer than the timeout.
        """
        return self

    def __enter__(self) -> None:
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fd = self._fd
        natural: float | None = None
        delay = _LOCK_POLL_MIN_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._held = fd
                return
            except BlockingIOError:
                if natural is None:
                    natural = time.monotonic() + self._timeout_ms / 1000.0
                # Polling (not a blocking flock) keeps the wait bounded by the busy timeout.
                if time.monotonic() >= self._bound.limit(natural):
                    raise StorageError(
                        f"{_gave_up(self._bound, natural, self._timeout_ms)} waiting for the "
                        f"writer lock {self._path!r} held by another process"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, _LOCK_POLL_MAX_S)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        fd, self._held = self._held, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the descriptor, if open; the next :meth:`hold` opens a new one."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class SqliteWriter:
    """Commit write requests on one connection: on the caller's thread when idle, else in groups.

    Every write transaction is ``BEGIN IMMEDIATE`` taken under the :class:`WriterFileLock` and
    the in-process transaction lock, so transactions of one instance never overlap, in this
    process or across processes. In a transaction of several requests each runs under its own
    SAVEPOINT, so its failed condition or error leaves the others intact; a request alone in its
    transaction needs none (its error rolls the transaction back). An error that aborts the
    transaction itself fails every request in it. A batch reads its conditions' keys in one
    query and writes each run of puts (or deletes) with one ``executemany``.

    A request submitted while no request is queued and no transaction runs is committed by the
    calling thread itself (:meth:`try_begin_fast` then :meth:`commit_fast`), sparing the handoff
    to the writer thread. Otherwise it is queued; the named daemon writer thread waits for the
    transaction lock, then takes every queued request (up to ``_MAX_GROUP``) into one
    transaction (group commit).

    :param requests: the queue to drain; :meth:`RequestQueue.put_stop` ends the thread.
    :param name: the thread's name.
    :param table: the (validated) table name.
    :param connect: opens a configured autocommit connection to the database; it must allow use
        from any thread (``check_same_thread=False``).
    :param translate: wraps driver errors of the named action into ``StorageError``.
    :param file_lock: the cross-process writer mutex.
    :param busy_timeout_ms: how long ``BEGIN IMMEDIATE`` waits for another connection's write
        lock, in slices of at most ``_BUSY_SLICE_MS`` so that ``bound`` can end it earlier.
    :param bound: once set, no transaction waits for a lock past it.
    :param before_commit: called inside every transaction just before ``COMMIT``; an exception
        it raises rolls the whole transaction back (the store-identity check).
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
        busy_timeout_ms: int,
        bound: WaitDeadline,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        quoted = f'"{table}"'
        self._busy_timeout_ms = busy_timeout_ms
        self._bound = bound
        self._before_commit = before_commit
        self._sql_get = f"SELECT value FROM {quoted} WHERE key = ?"
        self._sql_get_in = f"SELECT key, value FROM {quoted} WHERE key IN "
        self._sql_put = f"REPLACE INTO {quoted} (key, value) VALUES (?, ?)"
        self._sql_delete = f"DELETE FROM {quoted} WHERE key = ?"
        self._sql_renew = f"UPDATE {quoted} SET value = ?3 WHERE key = ?1 AND value = ?2"
        self._requests = requests
        self._connect = connect
        self._translate = translate
        self._file_lock = file_lock
        # The transaction lock: held for each write transaction, by the writer thread around a
        # group or by a caller committing its own request. Guards _conn (used strictly by one
        # thread at a time), the use of _file_lock, fast_commits and group_commits. It is held
        # across the transaction's I/O by design, like the flock it wraps; only the request
        # queue's lock is taken while holding it, and it is only ever tried (never waited for)
        # while holding another lock.
        self._txn_lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        # Transactions committed (or attempted) by callers and by the writer thread.
        self.fast_commits = 0
        self.group_commits = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def name(self) -> str:
        return self._thread.name

    @property
    def connection(self) -> sqlite3.Connection | None:
        """The write connection while one is open."""
        return self._conn

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def try_begin_fast(self) -> bool:
        """Take the transaction lock if no request is queued and no transaction runs.

        The caller serialises this against queueing (the storage's lock), so a request queued
        before it always commits before the caller's. On ``True`` the caller calls
        :meth:`commit_fast` and then, whatever happened, :meth:`end_fast`.
        """
        if self._requests.qsize():
            return False
        return self._txn_lock.acquire(blocking=False)

    def commit_fast(self, request: WriteRequest) -> Callable[[], None]:
        """Commit ``request`` on the calling thread, which holds the lock from try_begin_fast.

        The caller gives the lock back with :meth:`end_fast`, also when this raises, and then
        calls what this returns: it hands ``request`` its outcome (and logs a failure, which
        must not happen under the lock).
        """
        self.fast_commits += 1
        outcomes, failure = self._transaction([request])
        return functools.partial(_finish, [request], outcomes, failure)

    def end_fast(self) -> None:
        """Release the transaction lock taken by a successful :meth:`try_begin_fast`."""
        self._txn_lock.release()

    def close_connection(self, timeout: float) -> bool:
        """Close the write connection once no transaction runs.

        :returns: ``False`` if a transaction outlasted ``timeout`` seconds; the connection is
            then left open.
        """
        if not self._txn_lock.acquire(timeout=timeout):
            return False
        try:
            conn, self._conn = self._conn, None
            # Under the lock, so a forked child sees the connection in use (see in_use).
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
        finally:
            self._txn_lock.release()
        return True

    # -- fork ----------------------------------------------------------------------------------

    def in_use(self) -> bool:
        """Whether a thread holds the transaction lock (every use of the connection does)."""
        return self._txn_lock.locked()

    def abandon_in_child(self, close: bool) -> None:
        """After a fork, in the child: close the inherited write connection, or pin it.

        ``close`` only when no thread of the parent was inside SQLite on a connection of the
        library (see :mod:`~weft_sync.storage.sqlite.fork`). The flock descriptor is only
        closed, never unlocked: the parent may hold the lock through the same open file.
        """
        conn, self._conn = self._conn, None
        self._txn_lock = threading.Lock()
        if conn is not None:
            if close:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            else:
                pin(conn)
        self._file_lock.close()

    def _run(self) -> None:
        stop = False
        while not stop:
            self._requests.wait()
            with self._txn_lock:
                group, stop = self._requests.take_group()
                if not group:
                    continue
                self.group_commits += 1
                outcomes, failure = self._transaction(group)
            try:
                _finish(group, outcomes, failure)
            except BaseException:
                # Every request of the group has its error already; the thread must go on, or
                # the requests queued next are never taken.
                _log.debug("a write transaction of the writer thread raised", exc_info=True)

    def _transaction(
        self, group: list[WriteRequest]
    ) -> tuple[list[tuple[list[bool] | None, BaseException | None]], BaseException | None]:
        """Commit ``group`` in one transaction; the caller holds the transaction lock.

        Returns each request's outcome and, if the transaction failed as a whole, its error.
        """
        try:
            with self._translate("write transaction"):
                if self._conn is None:
                    self._conn = self._open_connection()
                conn = self._conn
                with self._file_lock.hold():
                    try:
                        if conn.in_transaction:
                            # Left open by a call interrupted between its statements (a
                            # KeyboardInterrupt lands between any two bytecodes): undone here.
                            conn.execute("ROLLBACK")
                        self._begin_immediate(conn)
                        isolate = len(group) > 1
                        outcomes = [self._apply_request(conn, req, isolate) for req in group]
                        if self._before_commit is not None:
                            self._before_commit()
                        conn.execute("COMMIT")
                    except BaseException:
                        if conn.in_transaction:
                            with contextlib.suppress(sqlite3.Error):
                                conn.execute("ROLLBACK")
                        raise
        except BaseException as exc:
            # Nothing in the group committed, so every caller gets the error (its own copy, so
            # threads raising it do not share one traceback).
            failed: list[tuple[list[bool] | None, BaseException | None]] = [
                (None, exc if i == 0 else _duplicate(exc)) for i in range(len(group))
            ]
            return failed, exc
        return outcomes, None

    def _open_connection(self) -> sqlite3.Connection:
        conn = self._connect()
        try:
            # Only BEGIN IMMEDIATE waits on this connection: in WAL mode, once it holds the
            # write lock, no statement of the transaction (nor its COMMIT) needs another lock.
            conn.execute(f"PRAGMA busy_timeout = {min(self._busy_timeout_ms, _BUSY_SLICE_MS):d}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _begin_immediate(self, conn: sqlite3.Connection) -> None:
        """``BEGIN IMMEDIATE``, waiting up to the busy timeout or the bound, whichever is first.

        Past the bound one attempt is still made, so a free lock is taken.
        """
        natural = time.monotonic() + self._busy_timeout_ms / 1000.0
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not is_busy(exc):
                    raise
                if time.monotonic() < self._bound.limit(natural):
                    continue
                if not self._bound.cuts(natural):
                    raise
                # Re-raised as a driver error so that the caller's translation names the store.
                raise sqlite3.OperationalError(
                    f"{_gave_up(self._bound, natural, self._busy_timeout_ms)}: another "
                    f"connection holds the write lock ({exc})"
                ) from exc

    def _apply_request(
        self, conn: sqlite3.Connection, request: WriteRequest, isolate: bool
    ) -> tuple[list[bool] | None, BaseException | None]:
        """Apply one request; with ``isolate``, under a savepoint that its error rolls back.

        Without ``isolate`` (the request is alone in its transaction) an error propagates and
        rolls back the whole transaction, which holds nothing else.
        """
        if request.decide is not None:
            return self._apply_read_then_write(conn, request, isolate)
        renewals = request.renewals
        if not isolate:
            # Alone in its transaction: an error rolls the whole of it back.
            with self._translate("write"):
                if renewals is not None:
                    return self._apply_renewals(conn, renewals, False), None
                return [self._apply_batch(conn, c, o) for c, o in request.batches], None
        if renewals is not None:
            return self._in_savepoint(conn, lambda: self._apply_renewals(conn, renewals, True))
        return self._in_savepoint(
            conn, lambda: [self._apply_batch(conn, c, o) for c, o in request.batches]
        )

    def _in_savepoint(
        self, conn: sqlite3.Connection, apply: Callable[[], list[bool]]
    ) -> tuple[list[bool] | None, BaseException | None]:
        """Run ``apply`` for one request of several under a savepoint that its
        ``StorageError`` rolls back: the error is then the request's own outcome, and the
        other requests of the transaction keep theirs."""
        conn.execute("SAVEPOINT weft_request")
        try:
            with self._translate("write"):
                results = apply()
        except StorageError as exc:
            if not conn.in_transaction:
                raise  # SQLite rolled the whole transaction back: every request in it is lost.
            conn.execute("ROLLBACK TO weft_request")
            conn.execute("RELEASE weft_request")
            return None, exc
        conn.execute("RELEASE weft_request")
        return results, None

    def _apply_read_then_write(
        self, conn: sqlite3.Connection, request: WriteRequest, isolate: bool
    ) -> tuple[list[bool] | None, BaseException | None]:
        """Read the request's keys, ask its ``decide``, apply the batch it returns.

        What ``decide`` raises, or a bad batch, is the request's own error: nothing was written
        for it yet, so the others in the transaction are untouched.
        """
        assert request.decide is not None
        with self._translate("read"):
            known = self._read(conn, request.read_keys)
        request.values = [known.get(key) for key in request.read_keys]
        try:
            decision = request.decide(list(request.values))
            if decision is None:
                return [False], None
            conditions, operations = validate_batch(*decision)
        except BaseException as exc:
            # A BaseException too (SystemExit from host code): it is this request's alone,
            # raised to its caller by wait(), and the other requests of the group commit.
            return None, exc
        if not isolate:
            with self._translate("write"):
                return [self._apply_batch(conn, conditions, operations, known)], None
        return self._in_savepoint(
            conn, lambda: [self._apply_batch(conn, conditions, operations, known)]
        )

    def _read(self, conn: sqlite3.Connection, keys: Sequence[str]) -> dict[str, bytes | None]:
        """The stored value of each of ``keys`` (absent ones: ``None``): a lookup each for up to
        ``_POINT_READS_MAX`` keys, one query for more."""
        wanted = list(dict.fromkeys(keys))
        if len(wanted) <= _POINT_READS_MAX:
            # A few keys: one primary-key lookup each costs SQLite less than an IN list, which
            # builds a temporary index of its values first.
            get = self._sql_get
            point: dict[str, bytes | None] = {}
            for key in wanted:
                row = conn.execute(get, (key,)).fetchone()
                point[key] = None if row is None else as_bytes(row[0])
            return point
        sql = self._sql_get_in + "(" + ",".join("?" * len(wanted)) + ")"
        found: dict[str, bytes | None] = dict.fromkeys(wanted)
        for key, value in conn.execute(sql, wanted):
            found[key] = value if type(value) is bytes else as_bytes(value)
        return found

    def _apply_renewals(
        self, conn: sqlite3.Connection, rows: list[RenewalRow], isolated: bool
    ) -> list[bool]:
        """Apply renewal rows in order, inside the request's savepoint when ``isolated``."""
        if len(rows) == 1:
            # One UPDATE changes its row exactly when the condition holds; a foreign writer's
            # text value is judged by the general path.
            if conn.execute(self._sql_renew, rows[0]).rowcount == 1:
                return [True]
            return [self._apply_batch(conn, *renewal_batch(rows[0]))]
        if not isolated:
            conn.execute("SAVEPOINT weft_request")
        # The key is unique, so each UPDATE changes at most one row, and changes one exactly when
        # its condition held at its turn: a full count is the sequential outcome of every row.
        if conn.executemany(self._sql_renew, rows).rowcount == len(rows):
            if not isolated:
                conn.execute("RELEASE weft_request")
            return [True] * len(rows)
        # Some condition failed (or a foreign writer stored text): judge row by row.
        conn.execute("ROLLBACK TO weft_request")
        if not isolated:
            conn.execute("RELEASE weft_request")
        return [self._apply_batch(conn, *renewal_batch(row)) for row in rows]

    def _apply_batch(
        self,
        conn: sqlite3.Connection,
        conditions: list[Condition],
        operations: list[Operation],
        known: dict[str, bytes | None] | None = None,
    ) -> bool:
        """Judge the conditions, then apply the operations; ``False`` when one fails.

        :param known: values read earlier in this transaction (nothing wrote them since);
            conditions on those keys are judged against them without another query.
        """
        if known:
            if any(c.key in known and known[c.key] != c.expected for c in conditions):
                return False
            conditions = [c for c in conditions if c.key not in known]
        if conditions:
            stored = self._read(conn, [cond.key for cond in conditions])
            if any(stored[cond.key] != cond.expected for cond in conditions):
                return False
        # Consecutive operations of one kind go in one executemany; the order is kept.
        start = 0
        while start < len(operations):
            kind = type(operations[start])
            end = start + 1
            while end < len(operations) and type(operations[end]) is kind:
                end += 1
            run = operations[start:end]
            if kind is Put:
                puts = [(op.key, op.value) for op in run if isinstance(op, Put)]
                conn.executemany(self._sql_put, puts)
            else:
                conn.executemany(self._sql_delete, [(op.key,) for op in run])
            start = end
        return True
