"""Claim time on the store's clock: expiry written and judged in the database's time.

Holder expiries are compared across hosts. With ``time_source="local"`` each engine writes and
judges them on its own clock, so a host whose clock runs ahead sees live claims of the others as
expired and takes them over. With ``time_source="store"`` (the default on PostgreSQL) every
engine reads claim time as its own clock plus an offset to the database server's clock, so all
engines on one database agree on it whatever their host clocks say.

The offset is sampled, never queried per operation: at open, then by :meth:`StoreClock.refresh`
(called once per renewal pass) when :attr:`StoreClock.resample_interval_s` real seconds have
passed. With the system clock, the offset is taken against the monotonic clock, so a step of the
host's wall clock (an NTP correction, an operator's ``date -s``) does not move claim time.
One sample is the best of a few round trips: the engine's clock is read before (``t0``)
and after (``t1``) reading the server's, the offset is ``server - (t0 + t1) / 2`` and the error
bound is half the round trip plus the server's millisecond rounding. The bound is applied in the
safe direction of each use:

- :meth:`StoreClock.upper` (the estimate plus the bound) is the time claims are *written* at: a
  holder's expiry is never earlier than intended, so no one takes it over before its TTL.
- :meth:`StoreClock.lower` (minus the bound) is the time another engine's expiry is *judged*
  at: a holder is seen as expired only once it is expired on every reading the bound allows.

Readings never go backwards: a new sample that would move the clock back holds it until the
engine's clock catches up. A failed resample keeps the previous offset (and is logged).

SQLite is one host's file: it keeps the host clock (``time_source="local"``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final, Literal

from ..clock import Clock, system_clock
from ..storage.base import Storage

_log = logging.getLogger(__name__)

TimeSource = Literal["local", "store"]
TIME_SOURCES: Final[tuple[TimeSource, ...]] = ("local", "store")
DEFAULT_RESAMPLE_INTERVAL_S: Final = 60.0
"""Real seconds between offset samples; host clocks drift far less than a millisecond in it."""
_SAMPLES: Final = 3
_ROUNDING_MS: Final = 1  # the server's reading is rounded to a whole millisecond


class StoreClock:
    """The store server's clock, read as the engine's clock plus a sampled offset (no I/O).

    :param server_time_ms: reads the server's clock in ms (one round trip); it may raise.
    :param local: the engine's clock.
    :param resample_interval_s: real seconds (``time.monotonic``) between samples taken by
        :meth:`refresh`.
    :raises StorageError: the first sample, taken here, failed.
    """

    def __init__(
        self,
        server_time_ms: Callable[[], int],
        local: Clock,
        *,
        resample_interval_s: float = DEFAULT_RESAMPLE_INTERVAL_S,
    ) -> None:
        if not callable(server_time_ms) or not callable(local):
            raise TypeError("server_time_ms and local must be callables returning int ms")
        if not isinstance(resample_interval_s, (int, float)) or not resample_interval_s > 0:
            raise ValueError(
                f"resample_interval_s must be a positive number of seconds, got "
                f"{resample_interval_s!r}"
            )
        self._server_time_ms = server_time_ms
        self._local = local
        self._interval_s = float(resample_interval_s)
        # _lock guards _offset, _error, _last and _sampled_at; no I/O runs under it.
        self._lock = threading.Lock()
        self._offset = 0
        self._error = 0
        self._last: int | None = None
        self._sampled_at = 0.0
        self.sample()

    @property
    def resample_interval_s(self) -> float:
        """Real seconds between the samples :meth:`refresh` takes."""
        return self._interval_s

    @property
    def offset_ms(self) -> int:
        """Server clock minus the engine's clock, as last sampled."""
        with self._lock:
            return self._offset

    @property
    def error_ms(self) -> int:
        """The bound on the offset's error (half the sample's round trip, rounded up, + 1)."""
        with self._lock:
            return self._error

    def sample(self) -> None:
        """Measure the offset now: the best of a few round trips (the shortest wins).

        :raises Exception: whatever reading the server's clock raised (the offset is unchanged).
        """
        best: tuple[int, int] | None = None
        for _ in range(_SAMPLES):
            before = self._local()
            server = int(self._server_time_ms())
            after = self._local()
            if after < before:
                continue  # the engine's clock stepped back mid-sample: no bound from this one
            if best is None or after - before < best[0]:
                best = (after - before, server - (before + after) // 2)
        if best is None:
            return
        round_trip, offset = best
        with self._lock:
            self._offset = offset
            self._error = (round_trip + 1) // 2 + _ROUNDING_MS
            self._sampled_at = time.monotonic()
        _log.debug("store clock offset %d ms (error bound %d ms)", offset, self.error_ms)

    def refresh(self) -> bool:
        """Sample again if the resample interval passed; never raises.

        :returns: whether a new sample was taken.
        """
        with self._lock:
            now = time.monotonic()
            if now - self._sampled_at < self._interval_s:
                return False
            # Claims this interval's sample, so concurrent renewal chunks take only one.
            self._sampled_at = now
        try:
            self.sample()
        except Exception:
            _log.warning(
                "could not sample the store's clock; keeping the previous offset", exc_info=True
            )
            return False
        return True

    def now(self) -> int:
        """The store's time in ms: the engine's clock plus the offset, never going backwards."""
        local = self._local()
        with self._lock:
            reading = local + self._offset
            if self._last is not None and reading < self._last:
                reading = self._last
            self._last = reading
            return reading

    def upper(self) -> int:
        """The latest time the store's clock may read now: the time claims are written at."""
        reading = self.now()
        with self._lock:
            return reading + self._error

    def lower(self) -> int:
        """The earliest time the store's clock may read now: the time others' expiry is judged."""
        reading = self.now()
        with self._lock:
            return reading - self._error

    def __repr__(self) -> str:
        return f"StoreClock(offset={self.offset_ms} ms, error={self.error_ms} ms)"


def resolve_store_clock(
    storage: Storage, time_source: TimeSource | None, clock: Clock
) -> StoreClock | None:
    """The store clock ``time_source`` asks for on ``storage``, sampled once; or ``None``.

    ``None`` picks the default: ``"store"`` where the store can read its own clock (PostgreSQL)
    and ``clock`` is the system clock; ``"local"`` on other stores, and when the host injected a
    clock of its own (a test's ``ManualClock``): that clock is then claim time, unless the host
    also asks for ``time_source="store"``.

    :raises ValueError: ``time_source`` is not one of :data:`TIME_SOURCES` or ``None``, or it is
        ``"store"`` on a store that cannot read a server clock (SQLite).
    :raises StorageError: the first sample failed.
    """
    if time_source is not None and time_source not in TIME_SOURCES:
        raise ValueError(
            f"unknown time_source={time_source!r}: use one of "
            f"{', '.join(repr(t) for t in TIME_SOURCES)} (or None for the backend's default)"
        )
    server_time_ms = getattr(storage, "server_time_ms", None)
    if time_source == "store" and not callable(server_time_ms):
        raise ValueError(
            f"time_source='store' needs a store that can read its server's clock (PostgreSQL); "
            f"{type(storage).__name__} cannot, so use time_source='local' (one host's clock)"
        )
    if time_source == "local" or not callable(server_time_ms):
        return None
    if time_source is None and clock is not system_clock:
        return None
    # Offsets from the monotonic clock make claim time immune to steps of the host's wall
    # clock; an injected clock is used as it is (the host decides how its time moves).
    return StoreClock(server_time_ms, monotonic_ms if clock is system_clock else clock)


def monotonic_ms() -> int:
    """``time.monotonic_ns()`` in whole milliseconds (an arbitrary origin; only offsets matter)."""
    return time.monotonic_ns() // 1_000_000
