"""One engine's liveness in the store: its record, its session lock and the crash probe.

:func:`build_crash_detection` is called by :func:`weft_sync.ownership.engine.build_engine`.
The parts:

- :class:`~weft_sync.reclaim.engine_liveness.EngineLiveness` takes the engine's session lock (when
  the store has them) and writes its engine record; the renewal sub-pass beats it once per pass
  (with the claim count and the claims without a live driver); at close the record is removed (or
  marked closed when claims are left) and the lock released.
- :class:`~weft_sync.reclaim.watcher.LivenessWatcher` (``background="thread"`` only, unless
  ``crash_poll_interval=None``) probes the other engines' locks and asks the renewal task for an
  immediate reclaim pass when one is gone, so a crashed engine's claims move in milliseconds.

A death is remembered with the exact bytes of the engine record it was judged on, and only as
long as the surveys read that record: an engine id a host reuses after a restart (a pod or host
name) gets a record of its own, and from then on the verdict is gone. A takeover made on it
before a survey saw the new record reads the record again after the holder and finds it changed
(see :mod:`~weft_sync.claims.takeovers`), so only the crashed engine's claims move early.

The object has one lock, guarding which parts run; starting and stopping happen outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from ..clock import Clock
from ..storage.base import Storage
from .engine_liveness import EngineLiveness
from .engine_records import UndrivenClaims
from .watcher import LivenessWatcher

_log = logging.getLogger(__name__)

_REFRESH_MS = 1_000
_WATCHER_JOIN_S = 5.0
_KEPT_DEAD = 1_000

UndrivenReport = Callable[[], UndrivenClaims | None]
"""The claims the engine holds without a live driver now (``None``: none), for its heartbeat."""


def _none_undriven() -> UndrivenClaims | None:
    return None


class CrashDetection:
    """The liveness parts of one engine; see the module docstring."""

    def __init__(
        self,
        liveness: EngineLiveness,
        make_watcher: Callable[[], LivenessWatcher] | None,
        held_count: Callable[[], int],
        remember_dead_s: float = 30.0,
        undriven: UndrivenReport = _none_undriven,
    ) -> None:
        self._remember_dead_s = remember_dead_s
        self._liveness = liveness
        self._held_count = held_count
        self._undriven = undriven
        self._make_watcher = make_watcher
        # _lock guards _watcher, _closed, _dead and _deaths; _death is notified when a crash is
        # noted.
        self._lock = threading.Lock()
        self._death = threading.Condition(self._lock)
        self._watcher: LivenessWatcher | None = None
        self._closed = False
        # Engine id -> (the record bytes its death was judged on, when it was noted: monotonic).
        self._dead: dict[str, tuple[bytes, float]] = {}
        self._deaths = 0

    def note_dead(self, engine_id: str, record: bytes | None = None) -> None:
        """Remember that the probe saw ``engine_id`` crashed, and wake the claim waiters.

        :param record: the exact bytes of the engine record the verdict was judged on; without
            them the crash only wakes the waiters (nothing proves which claims are its own).
        """
        with self._lock:
            self._dead.pop(engine_id, None)
            if record is not None:
                self._dead[engine_id] = (record, time.monotonic())
                while len(self._dead) > _KEPT_DEAD:
                    del self._dead[next(iter(self._dead))]
            self._deaths += 1
            self._death.notify_all()

    def note_records(self, records: Mapping[str, bytes]) -> None:
        """Forget each death whose engine's record a survey read (``records``) as other bytes
        or not at all: the id is another engine's now, or its record was removed."""
        with self._lock:
            for engine_id in [e for e, (raw, _) in self._dead.items() if records.get(e) != raw]:
                del self._dead[engine_id]

    def dead_engines(self) -> dict[str, bytes]:
        """The engines the probe saw crashed within the last claim TTL, each with the record
        bytes its verdict was judged on (a takeover takes their holders early only while the
        record still has those bytes).

        Older verdicts are forgotten (the claims of a crash have expired by then anyway), and
        so is one whose record a survey has read changed since (see :meth:`note_records`).
        """
        horizon = time.monotonic() - self._remember_dead_s
        with self._lock:
            return {e: raw for e, (raw, seen) in self._dead.items() if seen >= horizon}

    def death_count(self) -> int:
        """How many crashes the probe has noted so far; see :meth:`wait_for_death`."""
        with self._lock:
            return self._deaths

    def wait_for_death(self, timeout: float, seen: int) -> None:
        """Sleep up to ``timeout`` seconds, or until more than ``seen`` crashes were noted.

        ``seen`` is :meth:`death_count` from before the caller looked at :meth:`dead_engines`,
        so a crash noted between that look and this call ends the sleep at once.
        """
        with self._lock:
            self._death.wait_for(lambda: self._deaths != seen, timeout)

    def beat(self) -> None:
        """Write the heartbeat with the claims held now and those without a live driver."""
        self._liveness.beat(self._held_count(), self._undriven())

    def start_watching(self) -> None:
        """Start the crash probe (idempotent; nothing when probing is off)."""
        if self._make_watcher is None:
            return
        with self._lock:
            if self._closed or self._watcher is not None:
                return
            watcher = self._watcher = self._make_watcher()
        watcher.start()

    def stop_watching(self, timeout: float | None = None) -> None:
        """Stop and join the crash probe (idempotent)."""
        with self._lock:
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.close(_WATCHER_JOIN_S if timeout is None else timeout)

    def close(self, remaining_claims: int, timeout: float | None = None) -> None:
        """Stop the probe, then remove (or mark closed) the record and release the lock."""
        with self._lock:
            self._closed = True
        self.stop_watching(timeout)
        self._liveness.close(remaining_claims)


def build_crash_detection(
    storage: Storage,
    *,
    engine_id: str,
    clock: Clock,
    claim_ttl_ms: int,
    claim_renew_interval_ms: int,
    poll_ms: int | None,
    request_reclaim: Callable[[], object],
    held_count: Callable[[], int],
    watching: bool,
    undriven: UndrivenReport = _none_undriven,
) -> CrashDetection:
    """Take the lock and write the record now; the probe starts with interval maintenance.

    :param clock: the registry's clock (heartbeats are judged on it, like holders).
    :param poll_ms: the probe interval, or ``None`` for no probe.
    :param request_reclaim: asks for a reclaim pass now (the renewal task's).
    :param held_count: how many claims the engine holds now (published in each heartbeat).
    :param watching: whether interval maintenance runs in the background; the probe runs
        only then (unless off), and the record says whether it does.
    :param undriven: the claims held without a live driver now (published in each heartbeat).
    """
    liveness = EngineLiveness(
        storage,
        engine_id=engine_id,
        clock=clock,
        claim_ttl_ms=claim_ttl_ms,
        renew_interval_ms=claim_renew_interval_ms,
        watching=watching and poll_ms is not None,
    )
    liveness.start()

    noted: list[CrashDetection] = []
    # Watcher thread only: the engine records its last survey read (every report follows one).
    surveyed: dict[str, bytes] = {}

    def on_records(records: Mapping[str, bytes]) -> None:
        surveyed.clear()
        surveyed.update(records)
        for detection in noted:
            detection.note_records(records)

    def on_dead(dead_engine: str) -> None:
        for detection in noted:
            detection.note_dead(dead_engine, surveyed.get(dead_engine))
        request_reclaim()
        # Logged last: a host's log handler that raises cannot cost the reclaim.
        _log.info("weft_sync: engine %s is gone; reclaiming its claims now", dead_engine)

    make_watcher = None
    # Only an engine that says it watches runs the probe: others split a crash's claims with
    # the engines whose records say so, and a probe the record does not announce is left out.
    if poll_ms is not None and watching:
        interval = poll_ms

        def make_watcher() -> LivenessWatcher:
            return LivenessWatcher(
                storage,
                engine_id=engine_id,
                on_dead=on_dead,
                on_records=on_records,
                poll_ms=interval,
                refresh_ms=max(_REFRESH_MS, interval),
                clock=clock,
                own_lock=liveness.session_lock,
                # A lost own lock is taken again and the record republished at once.
                retake_own=lambda: liveness.beat(held_count(), undriven()),
            )

    detection = CrashDetection(
        liveness, make_watcher, held_count, remember_dead_s=claim_ttl_ms / 1000, undriven=undriven
    )
    noted.append(detection)
    return detection
