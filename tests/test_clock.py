"""Clocks (api.md ``weft_sync.clock``)."""

from __future__ import annotations

import threading
import time

import pytest
from freezegun import freeze_time

from weft_sync.clock import ManualClock, system_clock


def test_system_clock_follows_freezegun() -> None:
    with freeze_time("2030-01-01T00:00:00Z") as frozen:
        assert system_clock() == 1_893_456_000_000
        frozen.tick(1.5)
        assert system_clock() == 1_893_456_001_500


def test_system_clock_is_wall_time_in_ms() -> None:
    assert abs(system_clock() - time.time() * 1000) < 5_000


def test_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(1000)
    assert clock() == 1000
    assert clock.advance(500) == 1500
    clock.set(10)
    assert clock() == 10
    with pytest.raises(ValueError, match="ms >= 0"):
        clock.advance(-1)
    with pytest.raises(TypeError, match="milliseconds"):
        clock.set(1.5)  # type: ignore[arg-type]


def test_manual_clock_advances_atomically_across_threads() -> None:
    clock = ManualClock()
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        for _ in range(1000):
            clock.advance(1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock() == 4000
