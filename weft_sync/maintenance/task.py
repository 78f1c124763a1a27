"""The claim-renewal lifecycle task: renewal, reclaim and the owner-side polls, run on demand
or on a timer.

Threading model:

- ``run_once()`` runs a full pass (renewal → reclaim → signal poll → update poll) on the calling
  thread; concurrent callers share the pass in flight and all get the same result object.
- Interval mode (``start()``) arms one repeating timer. Each tick starts up to four independent
  single-flight *slots* — renewal, reclaim, signal poll, update poll — each on its own named
  daemon driver thread, and returns at once. A slot whose previous run is still going is skipped
  for that tick, so a hanging reclaim scan can never delay renewals.
- Renewal and reclaim fan out over one worker pool owned by the task (created on first use).
  Drivers are never pool workers and work through items themselves as well (see
  :mod:`.subpasses`), so a pass cannot wait for pool work that cannot start.
- Threads exist only while interval mode is on or a pass is in flight: the pool is shut down and
  joined as soon as the task is idle and stopped, and ``wait_idle()`` joins finished drivers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from ..clock import Clock
from ..errors import ClosedError
from .observer import FULL_PASS, PassObserver, notify_skipped, observed
from .scheduler import IntervalScheduler
from .subpasses import (
    run_reclaim_pass,
    run_renewal_subpass,
    run_signal_poll_subpass,
    run_update_poll_subpass,
)
from .targets import (
    PassKind,
    PassResult,
    ReclaimPassResult,
    ReclaimTarget,
    RenewalSubpassResult,
    RenewalTarget,
    SignalPollTarget,
    UpdatePollTarget,
)

_log = logging.getLogger(__name__)

PassCallback = Callable[[PassResult], None]

URGENT_RECLAIM_ROUNDS = 5
"""Reclaim sub-passes one slot runs while crashed or closed engines still hold claims (and at
most for half an interval, so that the slot does not overrun into the next tick)."""

URGENT_RECLAIM_GAP_MS = 100
"""The pause between those sub-passes, in which the other survivors take their shares."""
_Result = TypeVar("_Result")


class RenewalTask:
    """Runs maintenance passes; build it with :func:`.task_factory.create_renewal_task`."""

    def __init__(
        self,
        *,
        target: RenewalTarget,
        clock: Clock,
        interval_ms: int,
        scheduler: IntervalScheduler,
        reclaim_target: ReclaimTarget | None,
        signal_poll_target: SignalPollTarget | None,
        update_poll_target: UpdatePollTarget | None,
        on_pass_complete: PassCallback | None,
        executor_workers: int,
        before_stop: Callable[[], None] | None = None,
        observers: tuple[PassObserver, ...] = (),
        verify_store: Callable[[], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        self._heartbeat = heartbeat
        self._target = target
        self._observers = observers
        self._verify_store = verify_store
        self._clock = clock
        self._interval_ms = interval_ms
        self._scheduler = scheduler
        self._reclaim_target = reclaim_target
        self._signal_poll_target = signal_poll_target
        self._update_poll_target = update_poll_target
        self._on_pass_complete = on_pass_complete
        self._executor_workers = executor_workers
        self._before_stop = before_stop
        self._slot_bodies: dict[PassKind, Callable[[], PassResult]] = {
            PassKind.RENEWAL: self._renewal_slot
        }
        if reclaim_target is not None:
            self._slot_bodies[PassKind.RECLAIM] = self._reclaim_slot
        if signal_poll_target is not None:
            self._slot_bodies[PassKind.SIGNAL_POLL] = self._signal_poll_slot
        if update_poll_target is not None:
            self._slot_bodies[PassKind.UPDATE_POLL] = self._update_poll_slot
        self._closed = False
        self._reset_runtime_state()

    def _reset_runtime_state(self) -> None:
        # _lock guards the lifecycle (_started, _generation, _handle, _closed), the worker pool
        # (_pool, _pool_shutdowns) and the passes in flight (_in_flight, _shared_pass, _busy,
        # _between_ticks, _drivers).
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # Notified by stop(): ends the pause between urgent reclaim rounds.
        self._stopping = threading.Condition(self._lock)
        self._started = False
        self._generation = 0
        self._handle: object | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_shutdowns = 0
        self._in_flight = 0
        self._shared_pass: Future[PassResult] | None = None
        self._busy = dict.fromkeys(self._slot_bodies, False)
        # Busy slots whose pass began between ticks (request_reclaim) and no tick has met yet:
        # the first tick to find one busy comes less than one interval after its start.
        self._between_ticks: set[PassKind] = set()
        self._drivers: set[threading.Thread] = set()
        # Reclaim rounds asked for while the reclaim slot was busy.
        self._reclaim_requested = False
        # Marks threads running a pass of this task (drivers, pool workers, run_once callers).
        self._local = threading.local()

    @property
    def interval_ms(self) -> int:
        """The interval between ticks in interval mode."""
        return self._interval_ms

    @property
    def started(self) -> bool:
        """Whether interval mode is on."""
        with self._lock:
            return self._started

    # ----------------------------------------------------------------------------------------
    # Manual mode
    # ----------------------------------------------------------------------------------------

    def run_once(self) -> PassResult:
        """Run one full pass now and return its result (also handed to ``on_pass_complete``).

        Held ids are read once, then renewal, reclaim, signal poll and update poll run in that
        order. A caller arriving while a ``run_once()`` pass is in flight waits for it and gets
        the same result object (or the same exception). Interval-mode slots do not delay it.

        :raises Exception: whatever ``list_held_workflow_ids()`` or the clock raised.
        :raises ClosedError: the task was closed.
        :raises RuntimeError: called from inside a pass of this task (it would wait for itself).
        """
        self._refuse_reentry("run_once()")
        with self._lock:
            if self._closed:
                raise ClosedError("run_once() was called on a closed renewal task")
            shared = self._shared_pass
            leader = shared is None
            if shared is None:
                shared = self._shared_pass = Future()
                self._in_flight += 1
        if not leader:
            return shared.result()
        self._local.in_pass = True
        try:
            result = self._run_full_pass()
        except BaseException as exc:
            self._settle_shared(shared)
            shared.set_exception(exc)
            raise
        else:
            self._settle_shared(shared)
            shared.set_result(result)
            return result
        finally:
            self._local.in_pass = False
            self._pass_finished(None)

    def _settle_shared(self, shared: Future[PassResult]) -> None:
        # Cleared before the result is published, so a caller arriving later starts a new pass.
        with self._lock:
            if self._shared_pass is shared:
                self._shared_pass = None

    def _run_full_pass(self) -> PassResult:
        return self._timed(FULL_PASS, self._full_pass_body)

    def _full_pass_body(self) -> PassResult:
        started_at = self._clock()
        pool = self._executor()
        renewal = self._timed("renewal", lambda: self._renew_held(pool))
        reclaim = signal_poll = update_poll = None
        if (reclaim_target := self._reclaim_target) is not None:
            reclaim = self._timed("reclaim", lambda: self._reclaim(reclaim_target, pool))
        if (signal_target := self._signal_poll_target) is not None:
            signal_poll = self._timed(
                "signal_poll", lambda: run_signal_poll_subpass(signal_target, self._clock)
            )
        if (update_target := self._update_poll_target) is not None:
            update_poll = self._timed(
                "update_poll", lambda: run_update_poll_subpass(update_target, self._clock)
            )
        result = PassResult(
            started_at,
            self._clock(),
            renewal.outcomes,
            renewal.renewed_count,
            renewal.failed_count,
            reclaim,
            signal_poll,
            update_poll,
            PassKind.FULL,
        )
        self._report(result)
        return result

    # ----------------------------------------------------------------------------------------
    # Interval mode
    # ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Turn interval mode on; idempotent. The first tick comes after one interval.

        :raises ClosedError: the task was closed.
        """
        with self._lock:
            if self._closed:
                raise ClosedError("start() was called on a closed renewal task")
            if self._started:
                return
            self._started = True
            self._generation += 1
            generation = self._generation
        try:
            handle = self._scheduler.set_interval(lambda: self._tick(generation), self._interval_ms)
        except BaseException:
            with self._lock:
                if self._generation == generation:
                    self._started = False
            raise
        with self._lock:
            current = self._started and self._generation == generation
            if current:
                self._handle = handle
        if not current:
            # stop() ran while the timer was being armed: this timer belongs to no one.
            self._scheduler.clear_interval(handle)

    def stop(self) -> None:
        """Turn interval mode off; idempotent and safe before ``start()``.

        Calls ``before_stop`` first (every time), then cancels the timer: passes already running
        finish (see :meth:`wait_idle`). If ``before_stop`` raises, the timer is still cancelled
        and the exception propagates.
        """
        try:
            if self._before_stop is not None:
                self._before_stop()
        finally:
            self._stop_timer()

    def _stop_timer(self) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
            self._stopping.notify_all()
            handle, self._handle = self._handle, None
            pool = self._take_idle_pool()
        if handle is not None:
            self._scheduler.clear_interval(handle)
        self._release_pool(pool)

    def _tick(self, generation: int) -> None:
        launched: list[tuple[PassKind, threading.Thread]] = []
        skipped: list[tuple[PassKind, bool]] = []
        with self._lock:
            if not self._started or self._generation != generation:
                return
            self._drivers = {t for t in self._drivers if t.ident is None or t.is_alive()}
            for kind in self._slot_bodies:
                if self._busy[kind]:
                    skipped.append((kind, kind in self._between_ticks))
                    self._between_ticks.discard(kind)
                    continue
                launched.append((kind, self._new_driver(kind)))
        # Started before the skip reports: observers and log handlers are host code, and a
        # driver counted as busy but never started would keep its slot from running again.
        self._start_drivers(launched)
        for kind, between_ticks in skipped:
            notify_skipped(self._observers, kind.value)
            if between_ticks:
                _log.debug(
                    "weft_sync: the %s sub-pass asked for between ticks is still running; "
                    "skipping it this tick",
                    kind.value,
                )
                continue
            _log.warning(
                "weft_sync: the %s sub-pass is still running after one interval (%d ms); "
                "skipping it this tick",
                kind.value,
                self._interval_ms,
            )

    def request_reclaim(self) -> bool:
        """Run a reclaim sub-pass now rather than at the next tick (interval mode only).

        Called when another engine is seen dead. A reclaim already running is followed by
        another one as soon as it ends, so the request is never lost.

        :returns: whether a pass was started or queued (``False`` when stopped or without a
            reclaim target).
        """
        with self._lock:
            if not self._started or self._closed or PassKind.RECLAIM not in self._slot_bodies:
                return False
            if self._busy[PassKind.RECLAIM]:
                self._reclaim_requested = True
                return True
            launched = [(PassKind.RECLAIM, self._new_driver(PassKind.RECLAIM))]
            self._between_ticks.add(PassKind.RECLAIM)
        self._start_drivers(launched)
        return True

    def _new_driver(self, kind: PassKind) -> threading.Thread:
        # Caller holds _lock.
        thread = threading.Thread(
            target=self._drive_slot,
            args=(kind,),
            name=f"weft-maintenance-{kind.value}",
            daemon=True,
        )
        self._busy[kind] = True
        self._in_flight += 1
        self._drivers.add(thread)
        return thread

    def _start_drivers(self, launched: list[tuple[PassKind, threading.Thread]]) -> None:
        for kind, thread in launched:
            try:
                thread.start()
            except Exception:
                _log.exception("weft_sync: could not start the %s sub-pass thread", kind.value)
                with self._lock:
                    self._drivers.discard(thread)
                self._pass_finished(kind)

    def _drive_slot(self, kind: PassKind) -> None:
        self._local.in_pass = True
        try:
            result = self._slot_bodies[kind]()
            self._report(result)
        except BaseException:
            # SystemExit and the like from host code (a drive, on_pass_complete) too: this
            # thread has no caller to hand it to, and threading drops a SystemExit unsaid.
            _log.exception("weft_sync: the %s maintenance sub-pass failed", kind.value)
        finally:
            self._pass_finished(kind)

    def _timed(self, subpass: str, body: Callable[[], _Result]) -> _Result:
        """Run one sub-pass (or the full pass) inside the observers' contexts."""
        if not self._observers:
            return body()
        with observed(self._observers, subpass):
            return body()

    def _check_store(self) -> None:
        if self._verify_store is None:
            return
        try:
            self._verify_store()
        except Exception as exc:
            # The store keeps failing every call from now on: the renewal's writes meet the
            # same error and the registry acts on it there.
            _log.debug("weft_sync: the store identity check failed: %s", exc)

    def _renew_held(self, pool: ThreadPoolExecutor) -> RenewalSubpassResult:
        self._check_store()
        held = list(self._target.list_held_workflow_ids())
        result = run_renewal_subpass(self._target, held, executor=pool)
        self._beat()
        return result

    def _reclaim(self, target: ReclaimTarget, pool: ThreadPoolExecutor) -> ReclaimPassResult:
        result = run_reclaim_pass(target, executor=pool)
        if result.reclaimed_count:
            self._beat()  # others' fair shares count what this engine holds now
        return result

    def _beat(self) -> None:
        if self._heartbeat is None:
            return
        try:
            self._heartbeat()
        except Exception:
            _log.exception("weft_sync: the heartbeat hook raised")

    def _renewal_slot(self) -> PassResult:
        started_at = self._clock()
        renewal = self._timed("renewal", lambda: self._renew_held(self._executor()))
        return PassResult(
            started_at,
            self._clock(),
            renewal.outcomes,
            renewal.renewed_count,
            renewal.failed_count,
            kind=PassKind.RENEWAL,
        )

    def _reclaim_slot(self) -> PassResult:
        target = self._reclaim_target
        if target is None:
            raise RuntimeError("the reclaim slot runs only with a reclaim target")
        started_at = self._clock()
        slot_started = time.monotonic()
        for round_number in range(URGENT_RECLAIM_ROUNDS):
            reclaim = self._timed("reclaim", lambda: self._reclaim(target, self._executor()))
            dead_left = getattr(target, "dead_work_left", None)
            urgent = callable(dead_left) and dead_left()
            with self._lock:
                again = self._reclaim_requested
                if urgent and not again:
                    # The other survivors take their fair shares meanwhile; what is left after
                    # the pause is taken whatever the share.
                    self._stopping.wait_for(lambda: not self._started, URGENT_RECLAIM_GAP_MS / 1000)
                if not self._started or not (again or urgent):
                    break
                if round_number == URGENT_RECLAIM_ROUNDS - 1:
                    break  # a request left here is run by _pass_finished
                if again:
                    self._reclaim_requested = False
            if urgent and not again and time.monotonic() - slot_started > self._interval_ms / 2000:
                break  # the next tick goes on; a slot never overruns its interval for this
        return PassResult(
            started_at, self._clock(), (), 0, 0, reclaim=reclaim, kind=PassKind.RECLAIM
        )

    def _signal_poll_slot(self) -> PassResult:
        target = self._signal_poll_target
        if target is None:
            raise RuntimeError("the signal-poll slot runs only with a signal-poll target")
        started_at = self._clock()
        poll = self._timed("signal_poll", lambda: run_signal_poll_subpass(target, self._clock))
        return PassResult(
            started_at, self._clock(), (), 0, 0, signal_poll=poll, kind=PassKind.SIGNAL_POLL
        )

    def _update_poll_slot(self) -> PassResult:
        target = self._update_poll_target
        if target is None:
            raise RuntimeError("the update-poll slot runs only with an update-poll target")
        started_at = self._clock()
        poll = self._timed("update_poll", lambda: run_update_poll_subpass(target, self._clock))
        return PassResult(
            started_at, self._clock(), (), 0, 0, update_poll=poll, kind=PassKind.UPDATE_POLL
        )

    # ----------------------------------------------------------------------------------------
    # Shutdown
    # ----------------------------------------------------------------------------------------

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no pass is in flight and their driver threads have ended.

        :param timeout: seconds to wait at most (``None``: no bound).
        :returns: ``True`` if idle, ``False`` if the timeout expired first.
        :raises RuntimeError: called from inside a pass of this task (it would wait for itself).
        """
        self._refuse_reentry("wait_idle()")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if not self._idle.wait_for(self._is_idle, timeout):
                return False
            drivers = [t for t in self._drivers if t.ident is not None]
        for thread in drivers:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(remaining)
            if thread.is_alive():
                return False
        with self._lock:
            self._drivers.difference_update(drivers)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Stop, wait for passes in flight, and release every thread the task started.

        Idempotent; afterwards ``start()`` and ``run_once()`` raise
        :class:`~weft_sync.errors.ClosedError`.

        :param timeout: seconds to wait for passes in flight (``None``: no bound). Passes still
            running when it expires finish on their own; the last one shuts the pool down.
        :returns: ``True`` if every pass finished in time.
        """
        self._refuse_reentry("close()")
        try:
            self.stop()
        finally:
            with self._lock:
                self._closed = True
            idle = self.wait_idle(timeout)
        if not idle:
            _log.warning(
                "weft_sync: maintenance passes were still running %s s after close(); they "
                "finish in the background",
                timeout,
            )
        return idle

    def _after_fork_in_child(self) -> None:
        """Forget the parent's timer, pool, slots and passes without touching them.

        Those threads do not exist in a forked child and the parent's lock may have been held at
        fork time, so the runtime state is rebuilt from scratch; the child starts stopped.
        """
        self._reset_runtime_state()

    # ----------------------------------------------------------------------------------------
    # Helpers
    # ----------------------------------------------------------------------------------------

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self._executor_workers,
                    thread_name_prefix="weft-maintenance-worker",
                    initializer=self._mark_pool_thread,
                )
            return self._pool

    def _mark_pool_thread(self) -> None:
        self._local.in_pass = True

    def _pass_finished(self, kind: PassKind | None) -> None:
        relaunch: list[tuple[PassKind, threading.Thread]] = []
        with self._lock:
            if kind is not None:
                self._busy[kind] = False
                self._between_ticks.discard(kind)
            self._in_flight -= 1
            if (
                kind is PassKind.RECLAIM
                and self._reclaim_requested
                and self._started
                and not self._closed
            ):
                # Asked for while this slot was busy: followed by another one at once.
                self._reclaim_requested = False
                relaunch.append((kind, self._new_driver(kind)))
                self._between_ticks.add(kind)
            pool = self._take_idle_pool()
            if self._is_idle():
                self._idle.notify_all()
        self._release_pool(pool)
        self._start_drivers(relaunch)

    def _is_idle(self) -> bool:
        # Caller holds _lock.
        return self._in_flight == 0 and self._pool_shutdowns == 0

    def _take_idle_pool(self) -> ThreadPoolExecutor | None:
        # Caller holds _lock. The pool lives only while interval mode is on or passes run; a
        # pool taken here counts in _pool_shutdowns until it is joined, so wait_idle() waits.
        if self._started or self._in_flight != 0 or self._pool is None:
            return None
        pool, self._pool = self._pool, None
        self._pool_shutdowns += 1
        return pool

    def _release_pool(self, pool: ThreadPoolExecutor | None) -> None:
        if pool is None:
            return
        try:
            pool.shutdown(wait=True)
        finally:
            with self._lock:
                self._pool_shutdowns -= 1
                if self._is_idle():
                    self._idle.notify_all()

    def _report(self, result: PassResult) -> None:
        if self._on_pass_complete is None:
            return
        try:
            self._on_pass_complete(result)
        except Exception:
            _log.exception(
                "weft_sync: on_pass_complete raised while reporting a %s maintenance pass",
                result.kind.value,
            )

    def _refuse_reentry(self, what: str) -> None:
        if getattr(self._local, "in_pass", False):
            raise RuntimeError(
                f"{what} was called from inside a maintenance pass of this renewal task (from "
                f"on_pass_complete, a target or a reclaim drive); it would wait for the pass it "
                f"is running in, so call it from another thread"
            )
