"""The SQLite backend's read connections: one per thread, each behind its own gate.

Internal to :mod:`weft_sync.storage.sqlite.store`. A read holds its connection's gate, an
uncontended per-thread lock, for the length of its statements. A forked child reads the copies of
the gates to tell whether a thread of the parent was inside SQLite on these connections at the fork
(see :mod:`~weft_sync.storage.sqlite.fork`).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable
from types import TracebackType

from ..._fork import pin
from ...errors import ClosedError


class Reader:
    """One thread's read connection and its gate; ``with reader as conn:`` holds the gate."""

    __slots__ = ("conn", "gate", "thread")

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        # Held by the owning thread around each read, and while the connection opens or closes.
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

        The close runs under the gate, so a forked child can tell that it was under way.
        """
        with self.gate:
            conn, self.conn = self.conn, None
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()


class ReaderConnections:
    """The per-thread read connections of one storage.

    A reader leaves the list only after its connection is closed, so a forked child always sees
    every connection that may have been in use.

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
        # Guards _readers and _closed; held while a reader joins the list under its own gate
        # (so never waited for with a gate held, except that one).
        self._lock = threading.Lock()
        self._readers: list[Reader] = []
        self._closed = False
        self._local = threading.local()

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

    def in_use(self) -> bool:
        """Whether a thread holds a reader's gate (read in a forked child, on the copies)."""
        return any(reader.gate.locked() for reader in self._readers)

    def abandon_in_child(self, close: bool) -> None:
        """After a fork, in the child: close the inherited connections when ``close``, else
        pin them (see :mod:`~weft_sync.storage.sqlite.fork`)."""
        self._lock = threading.Lock()
        for reader in self._readers:
            conn, reader.conn = reader.conn, None
            reader.gate = threading.Lock()
            if conn is None:
                continue
            if close:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            else:
                pin(conn)
        self._readers = []
        self._closed = True
