"""Interval schedulers: what fires the renewal task's ticks.

The task only needs ``set_interval``/``clear_interval``; tests substitute a scheduler that fires
ticks on demand, production uses :class:`TimerScheduler` (a chain of daemon ``threading.Timer``
threads, so a forgotten task never keeps the process alive).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

_log = logging.getLogger(__name__)

_timer_ids = itertools.count(1)


@runtime_checkable
class IntervalScheduler(Protocol):
    """Calls a callback every ``interval_ms`` milliseconds until cleared.

    - ``set_interval(callback, interval_ms)`` arms a repeating timer whose first call comes after
      one interval (never immediately) and returns an opaque handle.
    - ``clear_interval(handle)`` stops it. Once it returns, the callback is not called again
      (except by a call already running on the calling thread itself).
    """

    def set_interval(self, callback: Callable[[], None], interval_ms: int) -> object: ...

    def clear_interval(self, handle: object) -> None: ...


class TimerScheduler:
    """The default scheduler: a re-arming chain of named, daemon ``threading.Timer`` threads.

    The next timer is armed after the callback returns, so calls never overlap; a slow callback
    delays the next call instead of stacking calls up. A callback that raises is logged and the
    chain continues.
    """

    def set_interval(self, callback: Callable[[], None], interval_ms: int) -> _TimerHandle:
        """Call ``callback`` every ``interval_ms`` ms, first after one interval.

        :raises ValueError: ``interval_ms`` is not a positive integer.
        """
        if isinstance(interval_ms, bool) or not isinstance(interval_ms, int) or interval_ms <= 0:
            raise ValueError(f"interval_ms must be a positive integer, got {interval_ms!r}")
        handle = _TimerHandle(callback, interval_ms / 1000.0, f"weft-timer-{next(_timer_ids)}")
        handle.arm()
        return handle

    def clear_interval(self, handle: object) -> None:
        """Cancel the chain and join its timer threads (except the calling thread).

        :raises TypeError: ``handle`` did not come from :meth:`set_interval`.
        """
        if not isinstance(handle, _TimerHandle):
            raise TypeError(
                f"clear_interval() needs a handle returned by TimerScheduler.set_interval(), got "
                f"{type(handle).__name__} {handle!r}"
            )
        handle.cancel()


class _TimerHandle:
    """One repeating timer: the current ``threading.Timer`` and the ones not yet joined."""

    def __init__(self, callback: Callable[[], None], interval_s: float, name: str) -> None:
        self._callback = callback
        self._interval_s = interval_s
        self._name = name
        # _lock guards _cancelled and _threads (the timers of this chain that may still run).
        self._lock = threading.Lock()
        self._cancelled = False
        self._threads: list[threading.Timer] = []

    def arm(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            timer = threading.Timer(self._interval_s, self._fire)
            timer.name = self._name
            timer.daemon = True
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(timer)
            # Started under the lock so that cancel() never sees a timer it cannot join.
            timer.start()

    def _fire(self) -> None:
        try:
            self._callback()
        except BaseException:
            # Whatever a tick raises (host code runs in it: observers, log handlers), the next
            # tick comes: ending the chain would stop every renewal of the engine.
            _log.exception("weft_sync: interval callback %r raised", self._callback)
        finally:
            self.arm()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            threads = list(self._threads)
            self._threads = []
        current = threading.current_thread()
        for timer in threads:
            timer.cancel()
            if timer is not current:
                timer.join()

    def __repr__(self) -> str:
        return f"<TimerHandle {self._name} every {self._interval_s}s>"
