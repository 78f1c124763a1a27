"""A tick that raises does not stall maintenance: the sub-passes it launched still run, and
the timer chain goes on after any exception, a ``BaseException`` included.

Host code runs inside a tick (observers, log handlers): here a log handler raises on the
"still running" warning a tick logs for a slow sub-pass. Real ``TimerScheduler`` at a short
interval.
"""

from __future__ import annotations

import logging
import threading
import time

from tests.maintenance.helpers import FakeReclaimTarget, FakeRenewalTarget
from tests.support.waiting import wait_until
from weft_sync.clock import ManualClock
from weft_sync.maintenance.scheduler import TimerScheduler
from weft_sync.maintenance.task_factory import create_renewal_task


class OneBadHandler(logging.Handler):
    """A host log handler that fails once on the 'still running' warning."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(level=logging.WARNING)
        self.error = error
        self.raised = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "still running" in record.getMessage() and not self.raised.is_set():
            self.raised.set()
            raise self.error


def _run(error: BaseException) -> None:
    release = threading.Event()

    def slow_reclaim() -> None:
        release.wait(30)

    reclaim = FakeReclaimTarget(on_list=slow_reclaim)
    renewal = FakeRenewalTarget(["wf-1"])
    task = create_renewal_task(
        target=renewal,
        clock=ManualClock(1_000),
        interval_ms=100,
        scheduler=TimerScheduler(),
        reclaim_target=reclaim,
    )
    handler = OneBadHandler(error)
    logger = logging.getLogger("weft_sync.maintenance.task")
    logger.addHandler(handler)
    try:
        task.start()
        assert handler.raised.wait(10), "no tick found the reclaim slot still running"
        release.set()  # the slow reclaim ends now
        before = renewal.list_calls
        wait_until(lambda: renewal.list_calls > before + 2, "renewal passes at later ticks")
    finally:
        release.set()
        logger.removeHandler(handler)
        idle = task.close(timeout=2)
    assert idle, "close() never saw the task idle: a driver counted in flight was never started"


def test_a_tick_whose_warning_raises_still_starts_the_sub_passes_it_launched() -> None:
    _run(RuntimeError("a broken host log handler"))


class HostAbort(BaseException):
    pass


def test_a_tick_that_raises_a_baseexception_is_followed_by_the_next_tick() -> None:
    calls: list[float] = []

    def tick() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise HostAbort("a host hook in the tick raised")

    scheduler = TimerScheduler()
    handle = scheduler.set_interval(tick, 50)
    try:
        wait_until(lambda: len(calls) > 3, "ticks after the one that raised")
    finally:
        scheduler.clear_interval(handle)
