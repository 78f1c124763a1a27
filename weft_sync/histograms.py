"""Fixed-bucket histograms for latency metrics, with bucket bounds derived from the claim timing.

A latency only means something next to the timing it threatens: a 400 ms renewal is harmless with
a 30 s TTL and alarming with a 900 ms one. Every histogram here therefore takes its bucket bounds
from the configured TTL and renew interval (:func:`latency_bounds`, :func:`takeover_delay_bounds`),
so the same dashboard reads the same way on every fleet.

:class:`Histogram` is not thread-safe on its own: its owner (a
:class:`~weft_sync.metrics.ClaimMetrics`) guards it with its lock.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


def _clean(bounds: Sequence[float]) -> tuple[float, ...]:
    """Sorted, de-duplicated, positive and finite bounds, rounded to the microsecond."""
    return tuple(sorted({round(b, 6) for b in bounds if math.isfinite(b) and b > 0}))


def latency_bounds(claim_ttl_ms: int, claim_renew_interval_ms: int) -> tuple[float, ...]:
    """Bucket bounds in seconds for an operation that must finish well inside a renew interval.

    From a thousandth of the renew interval up to the interval itself, then the local renew
    deadline (TTL minus one interval) and the TTL: a renewal batch in the top buckets is about to
    cost claims.
    """
    renew, ttl = claim_renew_interval_ms / 1000, claim_ttl_ms / 1000
    fractions = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
    return _clean([renew * f for f in fractions] + [ttl - renew, ttl])


def takeover_delay_bounds(claim_ttl_ms: int, claim_renew_interval_ms: int) -> tuple[float, ...]:
    """Bucket bounds in seconds for the time from a dead holder's expiry to our takeover.

    A takeover is allowed two renew intervals after the expiry (the grace) and normally happens
    within one more interval; the buckets resolve that range finely and then grow to two TTLs.
    """
    renew, ttl = claim_renew_interval_ms / 1000, claim_ttl_ms / 1000
    multiples = (1.0, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 6.0, 10.0)
    return _clean([renew * m for m in multiples] + [ttl + 2 * renew, 2 * ttl])


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A copy of a histogram: per-bucket (non-cumulative) counts, then the ``+Inf`` overflow.

    :param bounds: upper bounds in seconds, ascending; ``counts`` has one more entry (``+Inf``).
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    count: int

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs as the Prometheus exposition writes them."""
        pairs: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            pairs.append((format_bound(bound), running))
        pairs.append(("+Inf", self.count))
        return pairs


def format_bound(bound: float) -> str:
    """A bucket bound as Prometheus clients print it (``0.005``, ``1.0``, ``+Inf``)."""
    if math.isinf(bound):
        return "+Inf"
    return repr(float(bound))


class Histogram:
    """Counts observations (seconds) into fixed buckets; its owner serialises access.

    :param bounds: ascending upper bounds in seconds (see :func:`latency_bounds`).
    :raises ValueError: ``bounds`` is empty, not ascending, or holds a non-finite value.
    """

    __slots__ = ("_bounds", "_count", "_counts", "_total")

    def __init__(self, bounds: Sequence[float]) -> None:
        checked = tuple(float(b) for b in bounds)
        if not checked or any(not math.isfinite(b) for b in checked):
            raise ValueError(f"histogram bounds must be finite numbers, got {bounds!r}")
        if any(b >= c for b, c in itertools.pairwise(checked)):
            raise ValueError(f"histogram bounds must be strictly ascending, got {bounds!r}")
        self._bounds = checked
        self._counts = [0] * (len(checked) + 1)
        self._total = 0.0
        self._count = 0

    @property
    def bounds(self) -> tuple[float, ...]:
        """The upper bounds in seconds."""
        return self._bounds

    def observe(self, seconds: float) -> None:
        """Count one observation; a negative or non-finite value counts as 0 s.

        Clocks step (NTP, a ``ManualClock`` set backwards): a bad sample must not poison ``sum``.
        """
        value = seconds if math.isfinite(seconds) and seconds > 0 else 0.0
        # Prometheus buckets are "less than or equal": bisect_left keeps a value on its bound.
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._total += value
        self._count += 1

    def snapshot(self) -> HistogramSnapshot:
        """An independent copy."""
        return HistogramSnapshot(self._bounds, tuple(self._counts), self._total, self._count)

    def reset(self) -> None:
        """Forget every observation."""
        self._counts = [0] * (len(self._bounds) + 1)
        self._total = 0.0
        self._count = 0
