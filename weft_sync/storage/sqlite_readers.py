"""The SQLite backend's read connections: one per thread, each behind its own gate.

Internal to :mod:`weft_sync.storage.sqlite`. A read holds its connection's gate, an uncontended
per-thread lock, for the length of its statements. The gates let a fork wait until no thread of
this process is inside SQLite on these connections, so that a forked child can close the copies
it inherited: SQLite keeps per-process lock bookkeeping for every file, and a copied connection
left open in the child would make the child's own connections skip the operating-system locks
that keep other processes from checkpointing or deleting the write-ahead log under them.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable
from types import TracebackType

from .._fork import pin
from ..errors import ClosedError

__all__ = ["Reader", "ReaderConnections"]


class Reader:
    """One thread's read connection and its gate; ``with reader as conn:`` holds the gate."""

    __slots__ = ("conn", "gate", "thread")

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        # Held by the owning thread around each read, and by a fork in progress.
        self.gate = threading.Lock()
        self.conn: sqlite3.Connection | None = None

    def __enter__(self) -> sqlite3.Connection:
        self.gate.acquire()
        conn = self.conn
        if conn is None:
            self.gate.release()
            raise ClosedError("the SQLite read connection was closed with its storage")
        return conn

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.gate.release()

    def close(self) -> None:
        """Close the connection once no read runs on it; idempotent.

        The close runs under the gate, so a fork waits for it: a child must not inherit SQLite's
        lock bookkeeping for the file half-way through a close.
        """
        with self.gate:
            conn, self.conn = self.conn, None
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()


class ReaderConnections:
    """The per-thread read connections of one storage.

    A reader leaves the list only after its connection is closed, so a fork always sees (and
    waits for) every connection that may be in use.

    :param connect: opens a configured connection usable from any thread.
    :param closed_error: builds the error raised once :meth:`close_all` ran.
    """

    def __init__(
        self,
        connect: Callable[[], sqlite3.Connection],
        closed_error: Callable[[], ClosedError],
    ) -> None:
        self._connect = connect
        self._closed_error = closed_error
        # Guards _readers and _closed; never held while waiting for a gate except by a fork,
        # which takes it first and then the gates (a reader holding its gate never waits for it).
        self._lock = threading.Lock()
        self._readers: list[Reader] = []
        self._closed = False
        self._local = threading.local()
        self._paused: list[Reader] | None = None

    def for_thread(self) -> Reader:
        """The calling thread's reader, connected on its first use.

        :raises ClosedError: :meth:`close_all` ran.
        :raises sqlite3.Error: the connection could not be opened.
        """
        reader: Reader | None = getattr(self._local, "reader", None)
        if reader is not None:
            return reader
        reader = Reader(threading.current_thread())
        error: BaseException | None = None
        with reader.gate:
            with self._lock:
                if self._closed:
                    raise self._closed_error()
                stale = [r for r in self._readers if not r.thread.is_alive()]
                self._readers.append(reader)
            try:
                reader.conn = self._connect()
            except BaseException as exc:
                error = exc
                stale.append(reader)
            else:
                self._local.reader = reader
        # Connections of threads that have ended are closed here rather than leaked.
        self._retire(stale)
        if error is not None:
            raise error
        return reader

    def _retire(self, readers: list[Reader]) -> None:
        for reader in readers:
            reader.close()
        if readers:
            with self._lock:
                self._readers = [r for r in self._readers if r not in readers]

    def close_all(self) -> None:
        """Refuse new readers and close every connection, each once no read runs on it."""
        with self._lock:
            self._closed = True
            readers = list(self._readers)
        self._retire(readers)

    # -- fork --------------------------------------------------------------------------------

    def pause(self, deadline: float) -> bool:
        """Before a fork: hold every gate, so no read runs; ``False`` if not done by ``deadline``.

        On ``True`` no reader can start until :meth:`resume` (or, in the child,
        :meth:`abandon_in_child`).
        """
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        held: list[Reader] = []
        for reader in self._readers:
            if not reader.gate.acquire(timeout=max(0.0, deadline - time.monotonic())):
                for taken in held:
                    taken.gate.release()
                self._lock.release()
                return False
            held.append(reader)
        self._paused = held
        return True

    def resume(self) -> None:
        """After a fork, in the parent: let reads run again."""
        held, self._paused = self._paused, None
        if held is None:
            return
        for reader in held:
            reader.gate.release()
        self._lock.release()

    def abandon_in_child(self) -> None:
        """After a fork, in the child: close the inherited connections, or pin them.

        They are closed when the fork paused every read (no parent thread was inside SQLite
        on them, so closing touches nothing the parent uses); otherwise they are pinned.
        """
        paused = self._paused is not None
        self._paused = None
        self._lock = threading.Lock()
        for reader in self._readers:
            conn, reader.conn = reader.conn, None
            reader.gate = threading.Lock()
            if conn is None:
                continue
            if paused:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            else:
                pin(conn)
        self._readers = []
        self._closed = True
