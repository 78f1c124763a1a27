"""A ``claim(id, wait=…)`` waiter's pause ends at a crash the probe notes, even one noted
between the waiter's last look at the dead engines and the start of its pause.

Exercises :class:`~weft_sync.reclaim.crash_detection.CrashDetection` alone: its crash
bookkeeping uses neither the liveness records nor a watcher (both left out).
"""

from __future__ import annotations

import threading
import time
from typing import Any, cast

from weft_sync.reclaim.crash_detection import CrashDetection


def _detection() -> CrashDetection:
    return CrashDetection(cast(Any, None), None, lambda: 0)


def _note_on_another_thread(crash: CrashDetection, engine_id: str) -> None:
    # The record bytes stand for the engine record the verdict was judged on.
    noter = threading.Thread(target=crash.note_dead, args=(engine_id, b"record"))
    noter.start()
    noter.join()


def test_a_crash_noted_after_the_waiters_look_ends_its_next_pause_at_once() -> None:
    crash = _detection()
    seen = crash.death_count()
    assert "engine-b" not in crash.dead_engines()  # the attempt finds the holder alive ...
    _note_on_another_thread(crash, "engine-b")  # ... and the probe sees it crash right after
    started = time.monotonic()
    crash.wait_for_death(5.0, seen)
    assert time.monotonic() - started < 2.5  # the timeout (5 s) was not waited out
    assert "engine-b" in crash.dead_engines()


def test_a_pause_with_no_crash_since_the_look_lasts_its_timeout() -> None:
    crash = _detection()
    _note_on_another_thread(crash, "engine-b")  # an old verdict, seen by the last attempt
    seen = crash.death_count()
    started = time.monotonic()
    crash.wait_for_death(0.2, seen)
    assert time.monotonic() - started >= 0.19


def test_a_crash_noted_during_the_pause_ends_it() -> None:
    crash = _detection()
    seen = crash.death_count()
    timer = threading.Timer(0.1, crash.note_dead, args=("engine-c",))
    started = time.monotonic()
    timer.start()
    try:
        crash.wait_for_death(5.0, seen)
    finally:
        timer.join()
    assert time.monotonic() - started < 2.5  # the timeout (5 s) was not waited out
