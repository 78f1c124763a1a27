"""A client-side bound on every PostgreSQL call: cancel it, then cut it, once it outlives its time.

``statement_timeout`` and ``lock_timeout`` are enforced by the server, so they cannot bound a call
whose server never answers: a backend stopped (``SIGSTOP``), a server or network that stalls, a
pooler that dropped the settings. :class:`CallDeadlines` gives every call of a store a deadline
on the client: one thread per store watches the calls in flight, and a call still running at its
deadline gets a cancel request (``Connection.cancel_safe()``, psycopg's documented thread-safe
cancel); one still running :data:`CUT_AFTER_S` later has its socket shut down
(``shutdown(2)`` on a duplicate of the descriptor: the connection's own descriptor stays open, so
no other file can take its number), which makes the waiting call fail at once with a connection
error. The pool discards that connection when it is returned.

A store that is closing can also bring every deadline forward to its own (:meth:`CallDeadlines.
limit_to`, the store's ``bound_waits``): calls in flight are then cancelled by that deadline, and
a call that begins past it gets :data:`PAST_LIMIT_S`.

The thread starts with the first call and is stopped and joined by :meth:`CallDeadlines.close`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

_log = logging.getLogger(__name__)

CANCEL_TIMEOUT_S: Final = 0.5
"""How long the cancel request itself may take."""
CUT_AFTER_S: Final = 0.5
"""How long after the cancel a call that still runs has its socket shut down."""
PAST_LIMIT_S: Final = 0.1
"""How long a call that begins at or past the store's limit (:meth:`CallDeadlines.limit_to`)
may run: one short attempt, time for a free lock or row to answer."""
_JOIN_S: Final = 5.0


class CallDeadlines:
    """The deadlines of one store's calls in flight, and the thread that enforces them.

    Thread-safe: ``_cond`` guards ``_calls``, ``_next_id``, ``_limit``, ``_thread`` and
    ``_closed``. The cancel and the cut run on the watcher thread outside it.

    :param bound_s: how long one call may run before it is cancelled.
    :param name: the watcher thread's name.
    """

    def __init__(self, bound_s: float, name: str) -> None:
        self._bound_s = bound_s
        self._name = name
        self._cond = threading.Condition()
        # call id -> [deadline (monotonic), connection, stage: 0 before the cancel, 1 after,
        # whether the deadline is the limit's]
        self._calls: dict[int, list[Any]] = {}
        self._next_id = 0
        self._limit: float | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pid = os.getpid()

    @property
    def bound_s(self) -> float:
        """How long a call may run before it is cancelled (then cut :data:`CUT_AFTER_S` on)."""
        return self._bound_s

    @contextlib.contextmanager
    def guard(self, conn: Any, since: float | None = None) -> Iterator[None]:
        """Bound what runs on ``conn`` inside the block (a no-op after close or in a child).

        :param since: when the call began (``time.monotonic()``), if before the block: one
            call that borrows several connections in turn is bounded as a whole.
        """
        if self._pid != os.getpid():
            yield
            return
        with self._cond:
            if self._closed:
                call = None
            else:
                call = self._next_id
                self._next_id += 1
                start = time.monotonic() if since is None else since
                deadline, limited = start + self._bound_s, False
                if self._limit is not None:
                    limit = max(self._limit, time.monotonic() + PAST_LIMIT_S)
                    deadline, limited = min(deadline, limit), limit < deadline
                self._calls[call] = [deadline, conn, 0, limited]
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify()
        try:
            yield
        finally:
            if call is not None:
                with self._cond:
                    self._calls.pop(call, None)

    def limit_to(self, deadline: float | None) -> None:
        """Bring every call's deadline forward to ``deadline`` (``time.monotonic()``) at the
        latest, the calls in flight included; a call that begins past it gets
        :data:`PAST_LIMIT_S`. ``None`` lifts the limit (calls in flight keep theirs)."""
        with self._cond:
            self._limit = deadline
            if deadline is None:
                return
            for entry in self._calls.values():
                if entry[2] == 0 and deadline < entry[0]:
                    entry[0], entry[3] = deadline, True
            self._cond.notify()

    def close(self) -> None:
        """Stop and join the watcher thread; idempotent. Calls still running are not cut."""
        with self._cond:
            self._closed = True
            thread, self._thread = self._thread, None
            self._calls.clear()
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)

    def _run(self) -> None:
        while True:
            due: list[tuple[Any, int, bool]] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                wait: float | None = None
                for entry in self._calls.values():
                    if entry[0] <= now:
                        due.append((entry[1], entry[2], entry[3]))
                        entry[2] += 1
                        entry[0] = now + CUT_AFTER_S
                    else:
                        left = entry[0] - now
                        wait = left if wait is None else min(wait, left)
                if not due:
                    self._cond.wait(wait)
                    continue
            for conn, stage, limited in due:
                if stage == 0:
                    _cancel(conn, limited)
                else:
                    _cut(conn)


def _cancel(conn: Any, limited: bool) -> None:
    if limited:
        # The store is closing by a deadline: expected, and said once per store by close().
        _log.info("a PostgreSQL call ran into the store's close deadline; cancelling it")
    else:
        _log.warning("a PostgreSQL call outlived its bound; cancelling it")
    try:
        conn.cancel_safe(timeout=CANCEL_TIMEOUT_S)
    except Exception as exc:  # the cut follows anyway
        _log.debug("cancelling a PostgreSQL call failed: %r", exc)


def _cut(conn: Any) -> None:
    _log.warning("a PostgreSQL call still ran after its cancel; shutting its connection down")
    try:
        dup = os.dup(conn.pgconn.socket)
    except Exception as exc:
        _log.debug("no socket to shut down: %r", exc)
        return
    sock = socket.socket(fileno=dup)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError as exc:
        _log.debug("shutting a PostgreSQL socket down failed: %r", exc)
    finally:
        sock.close()
