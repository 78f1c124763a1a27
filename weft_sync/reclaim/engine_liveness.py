"""One engine's own liveness: its session lock and the record it keeps up to date.

:meth:`EngineLiveness.start` takes the engine's session lock (named by its engine id) when the
store offers session locks, then writes the record; :meth:`~EngineLiveness.beat` runs once per
maintenance pass and rewrites it (one put: the heartbeat, with the claim count and the claims
without a live driver) unless nothing but the time would change and the stored heartbeat is
younger than the TTL less two renew intervals (see :func:`heartbeat_due`);
:meth:`~EngineLiveness.close` deletes it, or marks it ``"closed"`` when claims were left behind,
and then lets go of the lock. The record is written before the lock goes, so that nobody sees
a live record without its lock (which reads as a crash) while the engine is closing in order.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import replace
from typing import Final

from .._fork import process_bound_class
from ..clock import Clock
from ..errors import ClosedError, StorageError
from ..keys import engine_liveness
from ..storage import Storage
from ..storage.session_locks import SessionLock, storage_session_locks
from .engine_records import (
    MAX_ENGINE_ID_LENGTH,
    EngineRecord,
    UndrivenClaims,
    encode_engine_record,
)

_log = logging.getLogger(__name__)

# How long close() waits for a heartbeat already writing, so that it cannot land after close.
_BEAT_DRAIN_S: Final = 10.0


def refresh_after_ms(record: EngineRecord) -> int:
    """How old the stored heartbeat may grow before a beat rewrites it: TTL - 2 renew intervals.

    Never less than half an interval (a record with a TTL under three intervals).
    """
    interval = record.renew_interval_ms
    return max(interval // 2, record.claim_ttl_ms - 2 * interval)


def heartbeat_due(previous: EngineRecord, record: EngineRecord) -> bool:
    """Whether ``record`` must be written over ``previous``, the record last written.

    It must when anything but the heartbeat time changed (the claim count feeds the others'
    fair shares at once, a lock name their crash verdicts, the undriven claims the command
    line), when the clock went back, and when the stored heartbeat is :func:`refresh_after_ms`
    old. An engine whose claims all have a live driver writes no more often than one that
    publishes no driver state. The arithmetic, with TTL ``T``, renew interval ``i``
    (``T >= 3 * i``, checked at open) and refresh age ``R = T - 2 * i``:

    An engine runs a pass (and a beat) at least once per renew interval (its timer does; a
    manual host must call that often). A beat skipped leaves a heartbeat younger than ``R``,
    and the next pass comes at most ``i`` later, so while the engine runs its stored heartbeat
    is younger than ``R + i + d`` (``d``: how long a pass takes to reach its beat, less than an
    interval or the pass overruns). A ``STALE`` verdict needs an age over ``T + 2 * i``: the
    judge's clock must run ``3 * i - d`` (more than ``2 * i``) ahead of the engine's, more than
    the takeover grace a holder's own expiry allows for. And a verdict only picks what
    discovery reads: a stale engine's claims are still judged by their expiry.

    At the defaults (30 s, 5 s) an engine writes its heartbeat every fourth pass.
    """
    if replace(previous, heartbeat_at=record.heartbeat_at) != record:
        return True
    age = record.heartbeat_at - previous.heartbeat_at
    return not 0 <= age < refresh_after_ms(record)


def _positive_ms(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int of milliseconds, got {value!r}")
    return value


@process_bound_class
class EngineLiveness:
    """The liveness record and session lock of one engine.

    Thread-safe. ``_lock`` guards ``_record``, ``_session_lock``, ``_started``, ``_closed``,
    ``_beats`` and ``_failed_beats``; no storage call, lock call or logging runs under it. A
    heartbeat in flight when :meth:`close` starts is waited for (bounded), so a beat never
    rewrites a closed record.

    In a forked child every method but :meth:`close` raises
    :class:`~weft_sync.errors.ClosedError`, and :meth:`close` only drops references: the
    parent's record and lock stay as they are.

    :param storage: the store; its session locks are used when it declares them.
    :param engine_id: the engine's id; also the name of its session lock.
    :param clock: the engine's clock (heartbeats are in its milliseconds).
    :param claim_ttl_ms: the engine's claim TTL, written into the record.
    :param renew_interval_ms: the engine's renew interval, written into the record.
    :param watching: whether the engine probes other engines' locks (written into the record).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        engine_id: str,
        clock: Clock,
        claim_ttl_ms: int,
        renew_interval_ms: int,
        watching: bool = False,
    ) -> None:
        if not isinstance(engine_id, str) or not 0 < len(engine_id) <= MAX_ENGINE_ID_LENGTH:
            raise ValueError(
                f"engine_id must be a str of 1 to {MAX_ENGINE_ID_LENGTH} characters, got "
                f"{engine_id!r:.80}"
            )
        self._storage = storage
        self._engine_id = engine_id
        self._watching = bool(watching)
        self._key = engine_liveness(engine_id)
        self._clock = clock
        self._ttl_ms = _positive_ms("claim_ttl_ms", claim_ttl_ms)
        self._interval_ms = _positive_ms("renew_interval_ms", renew_interval_ms)
        self._lock = threading.Lock()  # guards the fields named in the class docstring
        self._record: EngineRecord | None = None
        self._session_lock: SessionLock | None = None
        self._started = False
        self._closed = False
        self._beats = 0
        self._failed_beats = 0  # consecutive beats whose put failed: the first one warns
        self._beats_done = threading.Event()
        self._beats_done.set()
        self._fork_pid = os.getpid()

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def session_lock(self) -> SessionLock | None:
        """The session lock held, or ``None`` (the store has none, or it could not be taken)."""
        with self._lock:
            return self._session_lock

    def record(self) -> EngineRecord | None:
        """The record last written, or ``None`` before :meth:`start`."""
        with self._lock:
            return self._record

    def start(self) -> EngineRecord:
        """Take the session lock if the store offers one, then write the first record.

        Without a lock (the store has none, or taking it failed: a warning is logged) the engine
        is judged by its heartbeat alone, as if it had no crash signal.

        :raises StorageError: the record could not be written (the lock is released again).
        :raises RuntimeError: called twice, or after :meth:`close`.
        """
        with self._lock:
            if self._started or self._closed:
                raise RuntimeError(f"EngineLiveness for {self._engine_id!r} was already started")
            self._started = True
        lock = self._take_lock()
        now = self._clock()
        record = EngineRecord(
            engine_id=self._engine_id,
            state="live",
            heartbeat_at=now,
            claim_ttl_ms=self._ttl_ms,
            renew_interval_ms=self._interval_ms,
            held=0,
            lock=None if lock is None else lock.name,
            pid=os.getpid(),
            host=socket.gethostname()[:255],
            started_at=now,
            watching=self._watching,
            lock_id=None if lock is None else lock.identity,
        )
        try:
            self._storage.put(self._key, encode_engine_record(record))
        except BaseException:
            if lock is not None:
                lock.release()
            with self._lock:
                self._closed = True
            raise
        with self._lock:
            self._record = record
            self._session_lock = lock
        return record

    def _take_lock(self) -> SessionLock | None:
        locks = storage_session_locks(self._storage)
        if locks is None:
            return None
        try:
            return locks.acquire_session_lock(self._engine_id)
        except (StorageError, ValueError) as exc:  # ValueError: an id no lock can be named by
            _log.warning(
                "engine %s runs without a session lock, so its crash is seen only when its "
                "claims expire: %s",
                self._engine_id,
                exc,
            )
            return None

    def beat(self, held: int, undriven: UndrivenClaims | None = None) -> bool:
        """Write the heartbeat: one put of the record with ``held`` claims and the time now.

        The session lock is checked first (and re-taken if it was lost, then the record written
        with the new lock's identity); while it cannot be, the record names no lock. The put is
        skipped when :func:`heartbeat_due` says the stored record is still current. A storage
        error is logged and swallowed: the next beat tries again.

        :param undriven: the claims held without a live driver now (``None``: none).
        :returns: whether the stored record is current (written now, or not due).
        :raises ValueError: ``held`` is not a non-negative int.
        :raises RuntimeError: called before :meth:`start`.
        """
        if not isinstance(held, int) or isinstance(held, bool) or held < 0:
            raise ValueError(f"held must be a non-negative int of claims, got {held!r}")
        with self._lock:
            if self._closed:
                return False
            if self._record is None:
                raise RuntimeError(f"EngineLiveness for {self._engine_id!r} is not started")
            previous, lock = self._record, self._session_lock
            self._beats += 1
            self._beats_done.clear()
        try:
            return self._write_beat(previous, lock, held, undriven)
        finally:
            with self._lock:
                self._beats -= 1
                if self._beats == 0:
                    self._beats_done.set()

    def _write_beat(
        self,
        previous: EngineRecord,
        lock: SessionLock | None,
        held: int,
        undriven: UndrivenClaims | None,
    ) -> bool:
        lock_name = lock_id = None
        if lock is not None:
            try:
                still = lock.ensure()
            except Exception as exc:  # a lock's own check must not cost the heartbeat
                _log.warning(
                    "engine %s: checking its session lock failed: %r", self._engine_id, exc
                )
                still = False
            if still:
                # A lock taken again is another lock object: its new identity is published at
                # once (heartbeat_due sees the change), so the others' probes find it held.
                lock_name, lock_id = lock.name, lock.identity
            else:
                _log.warning(
                    "engine %s lost its session lock %s and could not take it again; it is "
                    "judged by its heartbeat until it can",
                    self._engine_id,
                    lock.token,
                )
        record = replace(
            previous,
            heartbeat_at=self._clock(),
            held=held,
            lock=lock_name,
            lock_id=lock_id,
            undriven=undriven,
        )
        if not heartbeat_due(previous, record):
            return True
        try:
            self._storage.put(self._key, encode_engine_record(record))
        except (StorageError, ClosedError) as exc:
            with self._lock:
                self._failed_beats += 1
                failed = self._failed_beats
            # One warning per outage: a store that stays down (or that the engine stopped using)
            # would otherwise repeat the same warning every pass.
            _log.log(
                logging.WARNING if failed == 1 else logging.DEBUG,
                "engine %s heartbeat failed (retried next pass%s): %s",
                self._engine_id,
                "" if failed == 1 else f"; {failed} in a row",
                exc,
            )
            return False
        with self._lock:
            if not self._closed:
                self._record = record
            failed, self._failed_beats = self._failed_beats, 0
        if failed:
            _log.info(
                "engine %s heartbeat written again after %d failed attempt%s",
                self._engine_id,
                failed,
                "" if failed == 1 else "s",
            )
        return True

    def close(self, remaining_claims: int = 0) -> None:
        """Delete the record (or mark it ``"closed"`` with claims left), then release the lock.

        Idempotent; storage errors are logged, never raised. In a forked child only references
        are dropped.

        :param remaining_claims: the claims still held after the engine released what it could.
        :raises ValueError: ``remaining_claims`` is not a non-negative int.
        """
        if (
            not isinstance(remaining_claims, int)
            or isinstance(remaining_claims, bool)
            or remaining_claims < 0
        ):
            raise ValueError(
                f"remaining_claims must be a non-negative int, got {remaining_claims!r}"
            )
        if self._fork_pid != os.getpid():
            self._session_lock = None
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            record, lock = self._record, self._session_lock
            self._session_lock = None
        if not self._beats_done.wait(_BEAT_DRAIN_S):
            _log.warning("engine %s closes while a heartbeat is still writing", self._engine_id)
        if record is not None:
            self._write_final(record, remaining_claims)
        if lock is not None:
            lock.release()

    def _write_final(self, record: EngineRecord, remaining: int) -> None:
        try:
            if remaining > 0:
                # A closed engine drives nothing; readers go by its state, not by a last list.
                closed = replace(
                    record,
                    state="closed",
                    heartbeat_at=self._clock(),
                    held=remaining,
                    undriven=None,
                )
                self._storage.put(self._key, encode_engine_record(closed))
                with self._lock:
                    self._record = closed
            else:
                self._storage.delete(self._key)
        except (StorageError, ClosedError) as exc:
            _log.warning(
                "engine %s could not update its liveness record at close: %s", self._engine_id, exc
            )

    def __repr__(self) -> str:
        return f"EngineLiveness({self._engine_id!r})"
