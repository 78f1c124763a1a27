"""Clocks: integer milliseconds since the Unix epoch.

A clock is any zero-argument callable returning ``int`` milliseconds. Holders are compared across
processes and hosts, so the default reads the wall clock, not ``time.monotonic``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Clock", "ManualClock", "system_clock"]

Clock = Callable[[], int]


def system_clock() -> int:
    """Return the wall-clock time in milliseconds (``time.time_ns``, so freezegun moves it)."""
    return time.time_ns() // 1_000_000


class ManualClock:
    """A clock that only moves when told to; safe to read and move from many threads.

    :param start_ms: the initial reading in milliseconds.
    """

    def __init__(self, start_ms: int = 0) -> None:
        _check_int("start_ms", start_ms)
        # _lock guards _now_ms.
        self._lock = threading.Lock()
        self._now_ms = start_ms

    def __call__(self) -> int:
        with self._lock:
            return self._now_ms

    def advance(self, ms: int) -> int:
        """Move the clock forward by ``ms`` milliseconds and return the new reading.

        :raises ValueError: if ``ms`` is negative (clocks here never run backwards on request).
        """
        _check_int("ms", ms)
        if ms < 0:
            raise ValueError(f"ManualClock.advance(ms) needs ms >= 0, got {ms}")
        with self._lock:
            self._now_ms += ms
            return self._now_ms

    def set(self, ms: int) -> None:
        """Set the clock to ``ms`` (it may move backwards, to simulate skew)."""
        _check_int("ms", ms)
        with self._lock:
            self._now_ms = ms

    def __repr__(self) -> str:
        return f"ManualClock({self()})"


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of milliseconds, got {value!r}")
