"""Interval mode: four single-flight slots, the timer, shutdown and threads (spec §5.3, §7.9)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.maintenance.helpers import (
    FakeReclaimTarget,
    FakeRenewalTarget,
    FakeSignalPollTarget,
    FakeUpdatePollTarget,
    Gauge,
    ManualScheduler,
    PassRecorder,
)
from tests.support.waiting import wait_set
from weft_sync.clock import ManualClock
from weft_sync.errors import ClosedError
from weft_sync.maintenance.scheduler import TimerScheduler
from weft_sync.maintenance.targets import RENEWAL_CONCURRENCY, PassKind
from weft_sync.maintenance.task import RenewalTask
from weft_sync.maintenance.task_factory import create_renewal_task

RENEWAL, RECLAIM = PassKind.RENEWAL, PassKind.RECLAIM


class Harness:
    """A task on a manual scheduler with a pass recorder; tests fire ticks by hand."""

    def __init__(self, **kwargs: Any) -> None:
        self.scheduler = ManualScheduler()
        self.recorder = PassRecorder()
        kwargs.setdefault("target", FakeRenewalTarget())
        kwargs.setdefault("clock", ManualClock(1_000))
        self.task = create_renewal_task(
            interval_ms=5_000, scheduler=self.scheduler, on_pass_complete=self.recorder, **kwargs
        )

    def fire(self) -> None:
        self.scheduler.fire()


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        h = Harness(**kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        assert h.task.close(timeout=10)


class _Park:
    """A hook that parks its caller until released; ``entered`` is set on each entry."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.armed = True

    def __call__(self, *_: object) -> None:
        if not self.armed:
            return
        self.entered.set()
        wait_set(self.release, "the parked call to be released")

    def open(self) -> None:
        """Release the parked call and let every later call through."""
        self.armed = False
        self.release.set()


# --- lifecycle -------------------------------------------------------------------------------


def test_a_tick_renews_and_the_first_tick_waits_one_interval(
    harness: Callable[..., Harness],
) -> None:
    target = FakeRenewalTarget(["a"])
    h = harness(target=target)
    h.task.start()
    assert h.scheduler.set_calls == [5_000]
    assert target.list_calls == 0
    h.fire()
    (result,) = h.recorder.wait_for(RENEWAL)
    assert [o.workflow_id for o in result.outcomes] == ["a"]
    assert (result.reclaim, result.signal_poll, result.update_poll) == (None, None, None)


def test_start_and_stop_are_idempotent_and_restartable(harness: Callable[..., Harness]) -> None:
    target = FakeRenewalTarget(["a"])
    h = harness(target=target)
    h.task.stop()
    assert h.scheduler.cleared == []
    h.task.start()
    h.task.start()
    assert len(h.scheduler.set_calls) == 1
    assert h.task.started
    late_tick = h.scheduler.callbacks()[0]
    h.task.stop()
    h.task.stop()
    assert len(h.scheduler.cleared) == 1
    assert h.scheduler.active == 0
    late_tick()
    assert h.task.wait_idle(10)
    assert target.list_calls == 0
    h.task.start()
    assert len(h.scheduler.set_calls) == 2
    h.fire()
    h.recorder.wait_for(RENEWAL)
    assert target.list_calls == 1


def test_a_tick_of_an_older_start_does_nothing(harness: Callable[..., Harness]) -> None:
    target = FakeRenewalTarget(["a"])
    h = harness(target=target)
    h.task.start()
    old_tick = h.scheduler.callbacks()[0]
    h.task.stop()
    h.task.start()
    old_tick()
    assert h.task.wait_idle(10)
    assert target.list_calls == 0


def test_start_after_close_is_refused_and_close_is_idempotent(
    harness: Callable[..., Harness],
) -> None:
    h = harness()
    h.task.start()
    assert h.task.close()
    assert h.task.close()
    assert h.scheduler.active == 0
    with pytest.raises(ClosedError):
        h.task.start()


def test_before_stop_runs_on_every_stop_before_the_timer_is_cleared(
    harness: Callable[..., Harness],
) -> None:
    seen: list[int] = []
    h = harness(before_stop=lambda: seen.append(len(h.scheduler.cleared)))
    h.task.stop()
    h.task.start()
    h.task.stop()
    assert seen == [0, 0]
    assert len(h.scheduler.cleared) == 1


def test_a_raising_before_stop_still_stops_the_timer(harness: Callable[..., Harness]) -> None:
    error = RuntimeError("dispose failed")
    failures = [error]

    def fail_once() -> None:
        if failures:
            raise failures.pop()

    h = harness(before_stop=fail_once)
    h.task.start()
    with pytest.raises(RuntimeError) as excinfo:
        h.task.stop()
    assert excinfo.value is error
    assert not h.task.started
    assert h.scheduler.active == 0


# --- single-flight slots ---------------------------------------------------------------------


def test_overlapping_tick_skips_a_renewal_still_in_flight(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    park = _Park()
    target = FakeRenewalTarget(["a"], on_list=park)
    h = harness(target=target)
    h.task.start()
    h.fire()
    wait_set(park.entered, "the renewal to start")
    with caplog.at_level(logging.WARNING, logger="weft_sync.maintenance.task"):
        h.fire()
    assert target.list_calls == 1
    assert "still running" in caplog.text
    park.open()
    h.recorder.wait_for(RENEWAL)
    assert h.task.wait_idle(10)
    h.fire()
    h.recorder.wait_for(RENEWAL, 2)
    assert target.list_calls == 2


def test_renewal_keeps_ticking_while_a_reclaim_listing_hangs(
    harness: Callable[..., Harness],
) -> None:
    park = _Park()
    reclaim = FakeReclaimTarget(["x"], on_list=park)
    h = harness(target=FakeRenewalTarget(["a"]), reclaim_target=reclaim)
    h.task.start()
    h.fire()
    wait_set(park.entered, "the reclaim listing to start")
    (first,) = h.recorder.wait_for(RENEWAL)
    assert first.reclaim is None
    assert h.recorder.of_kind(RECLAIM) == []
    h.fire()
    h.recorder.wait_for(RENEWAL, 2)
    assert reclaim.list_calls == 1
    park.open()
    (reclaimed,) = h.recorder.wait_for(RECLAIM)
    assert reclaimed.reclaim is not None and reclaimed.reclaim.status == "completed"
    assert (reclaimed.outcomes, reclaimed.renewed_count, reclaimed.failed_count) == ((), 0, 0)


def test_the_reclaim_slot_is_single_flight(harness: Callable[..., Harness]) -> None:
    park = _Park()
    reclaim = FakeReclaimTarget(on_list=park)
    h = harness(reclaim_target=reclaim)
    h.task.start()
    h.fire()
    wait_set(park.entered, "the reclaim listing to start")
    h.fire()
    h.fire()
    assert reclaim.list_calls == 1
    park.open()
    h.recorder.wait_for(RECLAIM)
    assert h.task.wait_idle(10)
    h.fire()
    h.recorder.wait_for(RECLAIM, 2)
    assert reclaim.list_calls == 2


def test_a_tick_meeting_a_requested_reclaim_does_not_warn_of_an_overrun_until_the_next(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    park = _Park()
    reclaim = FakeReclaimTarget(on_list=park)
    h = harness(reclaim_target=reclaim)
    h.task.start()
    assert h.task.request_reclaim()
    wait_set(park.entered, "the requested reclaim to start")
    renewals = len(h.recorder.of_kind(RENEWAL))
    with caplog.at_level(logging.DEBUG, logger="weft_sync.maintenance.task"):
        h.fire()
        # Less than one interval after the request: skipped, but no overrun.
        assert [r.levelname for r in caplog.records if "still running" in r.message] == ["DEBUG"]
        assert "asked for between ticks" in caplog.text
        # This tick's renewal ends before the next tick (a loaded machine may take a while):
        # the next tick's only overrun is the reclaim's.
        h.recorder.wait_for(RENEWAL, renewals + 1)
        caplog.clear()
        h.fire()
        # One whole interval later it is an overrun like any other.
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert [r.getMessage() for r in warnings] == [
            "weft_sync: the reclaim sub-pass is still running after one interval (5000 ms); "
            "skipping it this tick"
        ]
    assert reclaim.list_calls == 1
    park.open()
    h.recorder.wait_for(RECLAIM)
    assert h.task.wait_idle(10)


def test_every_configured_slot_reports_its_own_partial_result(
    harness: Callable[..., Harness],
) -> None:
    h = harness(
        target=FakeRenewalTarget(["a"]),
        reclaim_target=FakeReclaimTarget(["b"], results={"b": "reclaimed"}),
        signal_poll_target=FakeSignalPollTarget([("c", "go")], buffered=[("c", "go")]),
        update_poll_target=FakeUpdatePollTarget(["a"], pending=["a"]),
    )
    h.task.start()
    h.fire()
    (renewal,) = h.recorder.wait_for(PassKind.RENEWAL)
    (reclaim,) = h.recorder.wait_for(PassKind.RECLAIM)
    (signal,) = h.recorder.wait_for(PassKind.SIGNAL_POLL)
    (update,) = h.recorder.wait_for(PassKind.UPDATE_POLL)
    assert renewal.renewed_count == 1 and renewal.reclaim is None
    assert reclaim.reclaim is not None and reclaim.reclaim.reclaimed_count == 1
    assert signal.signal_poll is not None and signal.signal_poll.result is not None
    assert signal.signal_poll.result.woken_count == 1 and signal.reclaim is None
    assert update.update_poll is not None and update.update_poll.result is not None
    assert update.update_poll.result.drained_count == 1 and update.outcomes == ()


def test_a_raising_renewal_slot_is_logged_and_retried_on_the_next_tick(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    failures = [RuntimeError("registry unavailable")]

    def fail_once() -> None:
        if failures:
            raise failures.pop()

    target = FakeRenewalTarget(["a"], on_list=fail_once)
    h = harness(target=target)
    h.task.start()
    with caplog.at_level(logging.ERROR, logger="weft_sync.maintenance.task"):
        h.fire()
        assert h.task.wait_idle(10)
    assert h.recorder.of_kind(RENEWAL) == []
    assert "renewal maintenance sub-pass failed" in caplog.text
    assert "registry unavailable" in caplog.text
    h.fire()
    (result,) = h.recorder.wait_for(RENEWAL)
    assert result.renewed_count == 1


class HostExit(SystemExit):
    """What host code raises (a subclass, so nothing else is mistaken for it)."""


def test_a_slot_ended_by_system_exit_from_host_code_is_logged_and_runs_again(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    failures = [HostExit(3)]

    def exit_once() -> None:
        if failures:
            raise failures.pop()

    target = FakeRenewalTarget(["a"], on_list=exit_once)
    h = harness(target=target)
    h.task.start()
    with caplog.at_level(logging.ERROR, logger="weft_sync.maintenance.task"):
        h.fire()
        assert h.task.wait_idle(10)
    assert "renewal maintenance sub-pass failed" in caplog.text
    h.fire()
    (result,) = h.recorder.wait_for(RENEWAL)
    assert result.renewed_count == 1


def test_a_clock_failure_in_the_reclaim_slot_is_retried_on_the_next_tick(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(1_000)
    broken = threading.Event()
    broken.set()

    def flaky_clock() -> int:
        if broken.is_set():
            raise OSError("clock unavailable")
        return clock()

    reclaim = FakeReclaimTarget(["b"])
    h = harness(clock=flaky_clock, reclaim_target=reclaim)
    h.task.start()
    with caplog.at_level(logging.ERROR, logger="weft_sync.maintenance.task"):
        h.fire()
        assert h.task.wait_idle(10)
    assert reclaim.list_calls == 0
    assert "clock unavailable" in caplog.text
    broken.clear()
    h.fire()
    h.recorder.wait_for(RECLAIM)
    assert reclaim.attempts == ["b"]


def test_run_once_runs_while_an_interval_pass_is_parked(harness: Callable[..., Harness]) -> None:
    park = _Park()
    reclaim = FakeReclaimTarget(["x"], on_list=park)
    h = harness(target=FakeRenewalTarget(["a"]), reclaim_target=reclaim)
    h.task.start()
    h.fire()
    wait_set(park.entered, "the interval reclaim to park")
    park.armed = False
    result = h.task.run_once()
    assert result.renewed_count == 1
    assert result.reclaim is not None and result.reclaim.status == "completed"
    park.release.set()


# --- pool and threads ------------------------------------------------------------------------


def test_a_pass_of_blocked_items_cannot_starve_its_own_pool(
    harness: Callable[..., Harness],
) -> None:
    gauge, release = Gauge(), threading.Event()

    def block(_: str) -> None:
        gauge.enter()
        try:
            wait_set(release, "the blocked renewals to be released")
        finally:
            gauge.exit()

    ids = [f"wf-{i}" for i in range(40)]
    h = harness(target=FakeRenewalTarget(ids, on_renew=block))
    h.task.start()
    h.fire()
    gauge.wait_until(RENEWAL_CONCURRENCY)
    release.set()
    (result,) = h.recorder.wait_for(RENEWAL)
    assert result.renewed_count == 40
    assert gauge.peak == RENEWAL_CONCURRENCY


def test_renewal_completes_while_reclaim_attempts_hold_the_pool(
    harness: Callable[..., Harness],
) -> None:
    gauge, release = Gauge(), threading.Event()

    def block(_: str) -> None:
        gauge.enter()
        wait_set(release, "the blocked reclaim attempts to be released")

    candidates = [f"c-{i}" for i in range(40)]
    ids = [f"wf-{i}" for i in range(40)]
    h = harness(
        target=FakeRenewalTarget(ids),
        reclaim_target=FakeReclaimTarget(candidates, on_attempt=block),
    )
    h.task.start()
    h.fire()
    gauge.wait_until(RENEWAL_CONCURRENCY)
    (renewal,) = h.recorder.wait_for(RENEWAL)
    assert renewal.renewed_count == 40
    assert h.recorder.of_kind(RECLAIM) == []
    release.set()
    h.recorder.wait_for(RECLAIM)


def test_no_thread_survives_stop_once_passes_finish(harness: Callable[..., Harness]) -> None:
    before = set(threading.enumerate())
    ids = [f"wf-{i}" for i in range(40)]
    h = harness(
        target=FakeRenewalTarget(ids),
        reclaim_target=FakeReclaimTarget(ids),
        signal_poll_target=FakeSignalPollTarget(),
        update_poll_target=FakeUpdatePollTarget(),
    )
    h.task.start()
    h.fire()
    for kind in PassKind:
        if kind is not PassKind.FULL:
            h.recorder.wait_for(kind)
    assert set(threading.enumerate()) - before
    h.task.stop()
    assert h.task.wait_idle(10)
    assert set(threading.enumerate()) - before == set()


def test_close_waits_for_a_pass_in_flight_and_joins_its_threads(
    harness: Callable[..., Harness],
) -> None:
    before = set(threading.enumerate())
    park = _Park()
    ids = [f"wf-{i}" for i in range(20)]
    h = harness(target=FakeRenewalTarget(ids), reclaim_target=FakeReclaimTarget(ids, on_list=park))
    h.task.start()
    h.fire()
    wait_set(park.entered, "the reclaim to park")
    assert not h.task.close(timeout=0.01)
    park.release.set()
    assert h.task.close(timeout=10)
    assert h.recorder.wait_for(RECLAIM)
    assert set(threading.enumerate()) - before == set()


def test_wait_idle_from_inside_a_pass_is_refused(harness: Callable[..., Harness]) -> None:
    seen: list[BaseException] = []
    task_box: list[RenewalTask] = []

    def sink(_: object) -> None:
        try:
            task_box[0].close()
        except RuntimeError as exc:
            seen.append(exc)

    task = create_renewal_task(
        target=FakeRenewalTarget(["a"]),
        clock=ManualClock(),
        interval_ms=5_000,
        scheduler=ManualScheduler(),
        on_pass_complete=sink,
    )
    task_box.append(task)
    try:
        task.run_once()
    finally:
        assert task.close(timeout=10)
    assert len(seen) == 1 and "inside a maintenance pass" in str(seen[0])


def test_after_fork_in_child_forgets_the_timer_without_clearing_it(
    harness: Callable[..., Harness],
) -> None:
    h = harness(target=FakeRenewalTarget(["a"]))
    h.task.start()
    h.task._after_fork_in_child()
    assert not h.task.started
    assert h.scheduler.cleared == []
    h.task.start()
    assert len(h.scheduler.set_calls) == 2
    h.task.stop()
    assert len(h.scheduler.cleared) == 1
    # The parent's timer (never cleared by the child) is the test's to drop.
    h.scheduler.clear_interval(1)


# --- the real timer --------------------------------------------------------------------------


def test_default_scheduler_starts_and_stops_without_waiting_for_a_tick() -> None:
    before = set(threading.enumerate())
    target = FakeRenewalTarget(["a"])
    task = create_renewal_task(target=target, clock=ManualClock(), interval_ms=60_000)
    task.start()
    assert any(t.name.startswith("weft-timer-") and t.daemon for t in threading.enumerate())
    task.stop()
    assert task.close(timeout=10)
    assert target.list_calls == 0
    assert set(threading.enumerate()) - before == set()


def test_timer_scheduler_repeats_until_cleared_and_survives_a_raising_callback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = TimerScheduler()
    calls: list[int] = []
    done = threading.Event()

    def tick() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first tick fails")
        if len(calls) >= 3:
            done.set()

    with caplog.at_level(logging.ERROR, logger="weft_sync.maintenance.scheduler"):
        handle = scheduler.set_interval(tick, 1)
        wait_set(done, "three timer ticks")
        scheduler.clear_interval(handle)
    assert "first tick fails" in caplog.text
    assert _timer_threads() == []


def test_timer_scheduler_can_be_cleared_from_its_own_callback() -> None:
    scheduler = TimerScheduler()
    fired = threading.Event()
    handles: list[object] = []

    def tick() -> None:
        scheduler.clear_interval(handles[0])
        fired.set()

    handles.append(scheduler.set_interval(tick, 1))
    wait_set(fired, "the self-clearing tick")
    for thread in _timer_threads():
        thread.join(10)
    assert _timer_threads() == []


def test_timer_scheduler_rejects_bad_arguments() -> None:
    scheduler = TimerScheduler()
    with pytest.raises(ValueError, match="interval_ms must be a positive integer, got 0"):
        scheduler.set_interval(lambda: None, 0)
    with pytest.raises(TypeError, match=r"TimerScheduler\.set_interval"):
        scheduler.clear_interval(object())


def _timer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("weft-timer-") and t.is_alive()]
