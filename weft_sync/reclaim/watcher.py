"""The crash fast path: a thread that notices at once when another engine's session lock goes.

Every ``refresh_ms`` the watcher surveys the engine records and keeps the engines judged
``LIVE`` that hold a session lock; every ``poll_ms`` it probes just those locks (one probe for all
of them, each by the identity its record publishes). When one lock object is proven free (see
:class:`~weft_sync.storage.session_locks.LockState`) it surveys again at once and calls
``on_dead(engine_id)`` for each engine that survey judges ``CRASHED``: a report always comes from
a survey, which hands ``on_records`` the record bytes it judged first. A lock that is merely not
seen (``UNKNOWN``: its file removed, the server restarted) is dropped from the probe until a
survey sees the engine ``LIVE`` again: never reported. Engines without a lock, or on a store
without session locks, are left to the heartbeat and the claim TTL.

What it cannot see: a frozen engine keeps its lock, so it is never reported (its claims expire as
usual). When the watcher finds its own engine's lock gone it takes it again and has the engine
republish its record at once (``retake_own``), so that the others probe the new lock object.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Final

from .._fork import process_bound_class
from ..clock import Clock
from ..errors import ClosedError, StorageError
from ..storage import Storage
from ..storage.session_locks import LockState, SessionLock, storage_session_locks
from .verdicts import EngineVerdict, take_survey

_log = logging.getLogger(__name__)

THREAD_NAME: Final = "weft-liveness-watch"
# A storage error is logged at most once per this many seconds (with the count since).
_ERROR_LOG_EVERY_S: Final = 30.0
_MAX_POLL_MS: Final = 60_000
_MAX_REFRESH_MS: Final = 3_600_000


def _interval(name: str, value: object, limit: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
        raise ValueError(f"{name} must be an int of milliseconds from 1 to {limit}, got {value!r}")
    return value


@process_bound_class
class LivenessWatcher:
    """Probe the session locks of live engines every ``poll_ms``; report each that disappears.

    ``on_dead`` is called on the watcher thread, outside any lock, once per engine per
    disappearance: an engine reported once is reported again only after a survey has seen it
    ``LIVE`` again (its lock re-taken). An exception from ``on_dead`` is logged, even a
    ``BaseException`` such as ``SystemExit``; it never stops the thread, and neither does a
    storage error (logged at most every 30 s) or anything else a step raises; a closed store
    ends it.

    Thread-safe. ``_lock`` guards ``_thread`` and ``_closed``. Only the watcher thread writes
    the map of watched engines, and it replaces the map rather than changing it, so
    :meth:`watched` reads it without a lock.

    :param storage: the store; nothing runs when it offers no session locks.
    :param engine_id: this engine's id, never watched.
    :param on_dead: called with the id of an engine whose lock went.
    :param on_records: called on the watcher thread after every survey, before its reports,
        with the exact record bytes of each engine it read (this engine left out); an
        exception from it is logged like a failed step, and that survey reports nothing.
    :param poll_ms: how often the known locks are probed.
    :param refresh_ms: how often the engine records are surveyed again.
    :param clock: the clock surveys judge heartbeats with.
    :param own_lock: this engine's own session lock, probed along with the others. A probe that
        finds it gone too means the store lost sessions, not engines (a PostgreSQL restart, this
        host cut off): nothing is reported from that probe, and the watcher takes its own lock
        again at once (its engines' peers do the same), rather than at the next heartbeat.
    :param retake_own: called instead of ``own_lock.ensure()`` when the own lock is found gone:
        the engine's re-take that also republishes its record with the new lock identity.
    :raises ValueError: ``poll_ms`` or ``refresh_ms`` out of range, named in the message.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        engine_id: str,
        on_dead: Callable[[str], None],
        on_records: Callable[[Mapping[str, bytes]], None] | None = None,
        poll_ms: int = 50,
        refresh_ms: int = 1000,
        clock: Clock,
        own_lock: SessionLock | None = None,
        retake_own: Callable[[], object] | None = None,
    ) -> None:
        if not callable(on_dead):
            raise TypeError(f"on_dead must be callable, got {on_dead!r}")
        self._storage = storage
        self._engine_id = engine_id
        self._on_dead = on_dead
        self._on_records = on_records
        self._poll_s = _interval("poll_ms", poll_ms, _MAX_POLL_MS) / 1000.0
        self._refresh_s = _interval("refresh_ms", refresh_ms, _MAX_REFRESH_MS) / 1000.0
        self._clock = clock
        self._own_lock = own_lock
        self._retake_own = retake_own
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _thread and _closed
        self._thread: threading.Thread | None = None
        self._closed = False
        self._fork_pid = os.getpid()
        # Watcher thread only: engine id -> (lock name, published identity), and the engines
        # reported dead.
        self._known: dict[str, tuple[str, str]] = {}
        self._reported: set[str] = set()
        self._errors = 0
        self._last_error_log = -_ERROR_LOG_EVERY_S

    @property
    def running(self) -> bool:
        """Whether the watcher thread runs."""
        with self._lock:
            thread = self._thread
        return thread is not None and thread.is_alive()

    def watched(self) -> frozenset[str]:
        """The engines whose locks are probed now (a snapshot)."""
        return frozenset(self._known)

    def start(self) -> bool:
        """Start the watcher thread; a no-op on a store without session locks.

        :returns: whether a thread runs.
        :raises RuntimeError: called after :meth:`close`.
        """
        if storage_session_locks(self._storage) is None:
            return False
        with self._lock:
            if self._closed:
                raise RuntimeError("LivenessWatcher was closed")
            if self._thread is not None:
                return True
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            thread = self._thread
        thread.start()
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and join it (at most ``timeout`` seconds); idempotent."""
        if self._fork_pid != os.getpid():
            self._closed = True  # the thread did not survive the fork
            return
        with self._lock:
            self._closed = True
            thread = self._thread
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                _log.warning("the liveness watcher did not stop within %.1f s", timeout)

    def _run(self) -> None:
        next_refresh = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() >= next_refresh:
                self._guarded(self._refresh)
                next_refresh = time.monotonic() + self._refresh_s
            elif self._known:
                self._guarded(self._poll)
            # With nothing to probe, sleep until the next survey.
            idle = max(0.0, next_refresh - time.monotonic())
            self._stop.wait(self._poll_s if self._known else min(idle, self._refresh_s))

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except ClosedError:
            # The store was closed under the watcher: there is nothing left to watch.
            _log.debug("liveness watcher of engine %s stops: its store is closed", self._engine_id)
            self._stop.set()
        except StorageError as exc:
            self._errors += 1
            now = time.monotonic()
            if now - self._last_error_log >= _ERROR_LOG_EVERY_S:
                _log.warning(
                    "liveness watcher of engine %s: %d storage error(s), the last: %s",
                    self._engine_id,
                    self._errors,
                    exc,
                )
                self._errors = 0
                self._last_error_log = now
        except BaseException:
            # Whatever host code behind a step raised (a custom store, the clock, SystemExit
            # from a callback), the watching goes on: this thread has no caller to hand it to,
            # and ending it would leave the next crashes undetected.
            _log.exception("liveness watcher of engine %s failed a step", self._engine_id)

    def _own_name(self) -> str | None:
        return None if self._own_lock is None else self._own_lock.name

    def _retake_own_lock(self) -> None:
        assert self._own_lock is not None
        if self._retake_own is not None:
            self._retake_own()  # ensure() and republish, on the engine's side
        held = self._own_lock.ensure()
        _log.info(
            "engine %s found its own session lock gone (%s); nothing reported from that probe",
            self._engine_id,
            "taken again" if held else "not taken again yet",
        )

    def _refresh(self) -> None:
        own = self._own_name()
        survey = take_survey(
            self._storage, now=self._clock(), exclude=(self._engine_id,), own_lock=own
        )
        if self._on_records is not None:
            self._on_records({status.engine_id: status.raw for status in survey.statuses})
        if survey.own_lock_held is False:
            self._retake_own_lock()
            return  # no lock can be believed: keep watching what was watched
        statuses = survey.statuses
        known: dict[str, tuple[str, str]] = {}
        dead: list[str] = []
        for status in statuses:
            record = status.record
            if status.verdict is EngineVerdict.LIVE and record is not None and record.lock:
                if status.lock_state is LockState.HELD and record.lock_id is not None:
                    known[status.engine_id] = (record.lock, record.lock_id)
                    self._reported.discard(status.engine_id)
            elif status.verdict is EngineVerdict.CRASHED:
                # Its lock went between two polls, or before this watcher first saw it (engines
                # started at the same moment): reported once either way.
                dead.append(status.engine_id)
        present = {status.engine_id for status in statuses}
        self._reported &= present
        self._known = known
        self._report(dead)

    def _poll(self) -> None:
        locks = storage_session_locks(self._storage)
        if locks is None:
            return
        own = self._own_name()
        asked: dict[str, str | None] = dict(self._known.values())
        if own is not None:
            asked[own] = None  # only whether it is held matters
        states = locks.probe_session_locks(asked)
        if own is not None and states.get(own) is not LockState.HELD:
            self._retake_own_lock()
            return
        if any(states.get(name) is LockState.FREE for name, _ in self._known.values()):
            # Proven free: surveyed again now, so that a report names the record it was judged
            # on (the engine's id may already carry a restarted engine's record).
            self._refresh()
            return
        # Not seen (UNKNOWN): left to the next survey, never reported.
        gone = {e for e, (name, _) in self._known.items() if states.get(name) is not LockState.HELD}
        if gone:
            # A new map, never a mutated one, so that watched() can copy it from any thread.
            self._known = {e: known for e, known in self._known.items() if e not in gone}

    def _report(self, engines: list[str]) -> None:
        # Every engine is reported before anything is logged: a host's log handler that raises
        # cannot cost a report (these engines are no longer watched, so none comes again).
        fresh = [engine for engine in engines if engine not in self._reported]
        self._reported.update(fresh)
        failures: dict[str, BaseException] = {}
        for engine in fresh:
            try:
                self._on_dead(engine)
            except BaseException as exc:
                # SystemExit and the like too: the other engines are still reported.
                failures[engine] = exc
        for engine in fresh:
            failure = failures.get(engine)
            if failure is None:
                _log.info("engine %s lost its session lock: reported dead", engine)
            else:
                _log.error("on_dead(%r) of the liveness watcher failed", engine, exc_info=failure)
