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

The watcher wakes every :data:`TICK_S` while calls are in flight and measures how late it
wakes: when the whole process was frozen (``SIGSTOP``, a suspended machine) or starved past
:data:`FROZEN_AFTER_S`, every deadline in flight moves on by that lateness, since the calls
could not read their answers then either; a process continued after a stop does not cancel the
calls it was making when it stopped. A cancel or a cut in progress holds up the end of its
call's block (:meth:`CallDeadlines.guard`): it can never reach the next statement the
connection runs after it went back to the pool.

A store that is closing can also bring every deadline forward to its own (:meth:`CallDeadlines.
limit_to`, the store's ``bound_waits``): calls in flight are then cancelled by that deadline, and
a call that begins past it gets :data:`PAST_LIMIT_S`.

The thread starts with the first call and is stopped and joined by :meth:`CallDeadlines.close`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

_log = logging.getLogger(__name__)

CANCEL_TIMEOUT_S: Final = 0.5
"""How long the cancel request itself may take."""
CUT_AFTER_S: Final = 0.5
"""How long after the cancel a call that still runs has its socket shut down."""
PAST_LIMIT_S: Final = 0.1
"""How long a call that begins at or past the store's limit (:meth:`CallDeadlines.limit_to`)
may run: one short attempt, time for a free lock or row to answer."""
TICK_S: Final = 0.1
"""How often the watcher wakes while calls are in flight, to see whether the process ran."""
FROZEN_AFTER_S: Final = 0.1
"""How much later than asked the watcher may wake before the time it lost is not counted
against the calls in flight (see the module docstring)."""
_JOIN_S: Final = 5.0


@dataclass(slots=True)
class _Call:
    """One call in flight, as the watcher sees it (guarded by its :class:`CallDeadlines`'s
    ``_cond``)."""

    deadline: float
    """When it is cancelled, then (stage 1) cut (``time.monotonic()``)."""
    conn: Any
    began: float
    """When the call began (``time.monotonic()``)."""
    limited: bool
    """Whether the deadline is the closing store's limit (:meth:`CallDeadlines.limit_to`)."""
    stage: int = 0
    """0 before the cancel, 1 after it, 2 after the cut."""
    busy: bool = False
    """Whether the watcher is cancelling or cutting it right now."""


class CallDeadlines:
    """The deadlines of one store's calls in flight, and the thread that enforces them.

    Thread-safe: ``_cond`` guards ``_calls``, ``_next_id``, ``_limit``, ``_thread``,
    ``_closed`` and ``_asleep_until``. The cancel and the cut run on the watcher thread outside
    it.

    :param bound_s: how long one call may run before it is cancelled.
    :param name: the watcher thread's name.
    """

    def __init__(self, bound_s: float, name: str) -> None:
        self._bound_s = bound_s
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._calls: dict[int, _Call] = {}
        # When the watcher's wait ends by itself (``math.inf``: it waits to be notified), or
        # ``None`` while it is not waiting: it looks at every call again before it waits. A new
        # call wakes it only when its deadline comes first.
        self._asleep_until: float | None = None
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
                self._calls[call] = _Call(deadline, conn, start, limited)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                asleep_until = self._asleep_until
                if asleep_until is not None and deadline < asleep_until:
                    self._cond.notify()
        try:
            yield
        finally:
            if call is not None:
                with self._cond:
                    entry = self._calls.pop(call, None)
                    # A cancel or cut under way finishes first (bounded by its own timeout),
                    # so it cannot hit the connection's next statement.
                    while entry is not None and entry.busy:
                        self._cond.wait()

    def limit_to(self, deadline: float | None) -> None:
        """Bring every call's deadline forward to ``deadline`` (``time.monotonic()``) at the
        latest, the calls in flight included; a call that begins past it gets
        :data:`PAST_LIMIT_S`. ``None`` lifts the limit (calls in flight keep theirs)."""
        with self._cond:
            self._limit = deadline
            if deadline is None:
                return
            for entry in self._calls.values():
                if entry.stage == 0 and deadline < entry.deadline:
                    entry.deadline, entry.limited = deadline, True
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
        woke_by: float | None = None  # when the last timed wait was due to end
        while True:
            due: list[_Call] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                lost = 0.0 if woke_by is None else now - woke_by
                if lost > FROZEN_AFTER_S:
                    # The process did not run (stopped, suspended, starved): the calls could
                    # not read their answers either, so that time does not count against them.
                    # A closing store's deadline stays where it is.
                    for entry in self._calls.values():
                        if not entry.limited:
                            entry.deadline += max(0.0, min(lost, now - entry.began))
                else:
                    lost = 0.0
                woke_by = None
                wait: float | None = None
                for entry in self._calls.values():
                    if entry.busy:
                        continue
                    if entry.deadline <= now:
                        due.append(entry)
                        entry.busy = True
                    else:
                        left = entry.deadline - now
                        wait = left if wait is None else min(wait, left)
                if not due and not lost:
                    if wait is not None:
                        wait = min(wait, TICK_S)
                        woke_by = now + wait
                    self._asleep_until = math.inf if woke_by is None else woke_by
                    self._cond.wait(wait)
                    self._asleep_until = None
                    continue
            if lost:
                _log.info(
                    "the process did not run for %.2f s; the deadlines of the PostgreSQL calls "
                    "in flight moved on by that",
                    lost,
                )
            for entry in due:
                try:
                    if entry.stage == 0:
                        _cancel(entry.conn, entry.limited)
                    else:
                        _cut(entry.conn)
                except BaseException:
                    # A failed cancel or cut (a socket error, a host log handler that raised)
                    # must not end this thread: the call's block waits for its entry below.
                    _log.debug("ending a PostgreSQL call past its deadline failed", exc_info=True)
            if due:
                with self._cond:
                    for entry in due:
                        entry.stage += 1
                        entry.deadline = time.monotonic() + CUT_AFTER_S
                        entry.busy = False
                    self._cond.notify_all()


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
