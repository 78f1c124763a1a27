"""The renewal task's immediate reclaim: ``request_reclaim``, urgent rounds and the heartbeat hook.

The scheduler here never ticks on its own, so every reclaim sub-pass seen was started by a
request (or by the urgent rounds that follow one).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.maintenance.helpers import (
    FakeReclaimTarget,
    FakeRenewalTarget,
    ManualScheduler,
    PassRecorder,
)
from tests.support.waiting import wait_set
from weft_sync.clock import ManualClock
from weft_sync.maintenance.targets import PassKind, PassResult
from weft_sync.maintenance.task import URGENT_RECLAIM_ROUNDS, RenewalTask
from weft_sync.maintenance.task_factory import create_renewal_task

MakeTask = Callable[..., RenewalTask]


@pytest.fixture
def make_task() -> Iterator[MakeTask]:
    tasks: list[RenewalTask] = []

    def make(**kwargs: Any) -> RenewalTask:
        kwargs.setdefault("target", FakeRenewalTarget())
        kwargs.setdefault("clock", ManualClock(1_000))
        kwargs.setdefault("interval_ms", 5_000)
        kwargs.setdefault("scheduler", ManualScheduler())
        task = create_renewal_task(**kwargs)
        tasks.append(task)
        return task

    yield make
    for task in tasks:
        assert task.close(timeout=10)


class DeadWorkTarget(FakeReclaimTarget):
    """A reclaim target that always reports claims of dead engines left over."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dead_left = True

    def dead_work_left(self) -> bool:
        return self.dead_left


class Beats:
    """A heartbeat hook that counts its calls and can raise."""

    def __init__(self, error: Exception | None = None) -> None:
        self._lock = threading.Lock()  # guards calls
        self.calls = 0
        self.error = error

    def __call__(self) -> None:
        with self._lock:
            self.calls += 1
        if self.error is not None:
            raise self.error


def test_a_request_runs_a_reclaim_sub_pass_without_a_tick(make_task: MakeTask) -> None:
    target = FakeReclaimTarget(["wf-1"])
    recorder = PassRecorder()
    task = make_task(reclaim_target=target, on_pass_complete=recorder)
    task.start()

    assert task.request_reclaim() is True

    (result,) = recorder.wait_for(PassKind.RECLAIM)
    assert result.reclaim is not None and result.reclaim.outcomes[0].workflow_id == "wf-1"
    assert task.wait_idle(10)
    assert target.attempts == ["wf-1"]
    assert recorder.of_kind(PassKind.RENEWAL) == []  # only the reclaim slot ran


def test_requests_during_a_reclaim_queue_exactly_one_more(make_task: MakeTask) -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def on_list() -> None:
        calls.append(1)
        if len(calls) == 1:
            entered.set()
            wait_set(release, "the test releasing the first reclaim")

    target = FakeReclaimTarget(on_list=on_list)
    task = make_task(reclaim_target=target)
    task.start()
    assert task.request_reclaim()
    wait_set(entered, "the first reclaim")

    assert [task.request_reclaim() for _ in range(3)] == [True, True, True]
    release.set()

    assert task.wait_idle(10)
    assert target.list_calls == 2


def test_a_request_is_refused_when_stopped_closed_or_without_a_reclaim_target(
    make_task: MakeTask,
) -> None:
    target = FakeReclaimTarget()
    task = make_task(reclaim_target=target)
    assert task.request_reclaim() is False  # interval mode is off
    task.start()
    task.stop()
    assert task.request_reclaim() is False
    task.close(timeout=10)
    assert task.request_reclaim() is False
    assert target.list_calls == 0

    bare = make_task()
    bare.start()
    assert bare.request_reclaim() is False


def test_urgent_rounds_stop_after_their_limit(make_task: MakeTask) -> None:
    target = DeadWorkTarget()
    # A long interval: the rounds' own limit ends the slot, not half an interval of them.
    task = make_task(reclaim_target=target, interval_ms=600_000)
    task.start()

    assert task.request_reclaim()

    assert task.wait_idle(10)
    assert target.list_calls == URGENT_RECLAIM_ROUNDS


def test_urgent_rounds_end_when_dead_work_is_done(make_task: MakeTask) -> None:
    target = DeadWorkTarget()

    def on_list() -> None:
        if target.list_calls == 2:
            target.dead_left = False

    target.on_list = on_list
    task = make_task(reclaim_target=target)
    task.start()
    assert task.request_reclaim()
    assert task.wait_idle(10)
    assert target.list_calls == 2


def test_stop_ends_the_urgent_rounds(make_task: MakeTask) -> None:
    target = DeadWorkTarget()
    first = threading.Event()
    target.on_list = first.set
    task = make_task(reclaim_target=target)
    task.start()
    assert task.request_reclaim()
    wait_set(first, "the first urgent round")

    task.stop()  # during the first round or the pause after it

    assert task.wait_idle(10)
    assert target.list_calls == 1


def test_the_heartbeat_follows_renewal_and_a_reclaim_that_reclaimed(make_task: MakeTask) -> None:
    beats = Beats()
    target = FakeReclaimTarget(["wf-1"], results={"wf-1": "not-eligible"})
    task = make_task(reclaim_target=target, heartbeat=beats)

    task.run_once()
    assert beats.calls == 1  # after the renewal only: nothing was reclaimed

    target.results["wf-1"] = "reclaimed"
    task.run_once()
    assert beats.calls == 3  # after the renewal, and after the reclaim that took wf-1


def test_a_heartbeat_that_raises_is_logged_and_the_pass_goes_on(
    make_task: MakeTask, caplog: pytest.LogCaptureFixture
) -> None:
    beats = Beats(RuntimeError("the record write failed"))
    target = FakeReclaimTarget(["wf-1"], results={"wf-1": "reclaimed"})
    task = make_task(target=FakeRenewalTarget(["held"]), reclaim_target=target, heartbeat=beats)

    with caplog.at_level(logging.ERROR, logger="weft_sync.maintenance.task"):
        result = task.run_once()

    assert beats.calls == 2
    assert result.renewed_count == 1
    assert result.reclaim is not None and result.reclaim.reclaimed_count == 1
    raised = [r for r in caplog.records if "heartbeat hook raised" in r.getMessage()]
    assert len(raised) == 2 and all(r.exc_info is not None for r in raised)


def test_a_heartbeat_that_is_not_callable_is_refused(make_task: MakeTask) -> None:
    with pytest.raises(TypeError, match="heartbeat must be callable or None, got 'beat'"):
        make_task(heartbeat="beat")


def test_urgent_rounds_stop_after_half_an_interval(make_task: MakeTask) -> None:
    # With a 150 ms interval, the first 100 ms pause already passes half of it.
    target = DeadWorkTarget()
    task = make_task(reclaim_target=target, interval_ms=150)
    task.start()

    assert task.request_reclaim()

    assert task.wait_idle(10)
    assert target.list_calls == 1


def test_a_request_made_while_the_slot_reports_its_result_is_followed_by_a_reclaim() -> None:
    """A request that comes after the slot left its loop, while it reports its result (still
    busy), runs a reclaim sub-pass right after that one ends."""
    reporting, go = threading.Event(), threading.Event()

    def on_pass_complete(result: PassResult) -> None:
        if result.kind is PassKind.RECLAIM and not reporting.is_set():
            reporting.set()
            wait_set(go, "the test letting the first reclaim finish")

    target = FakeReclaimTarget()
    task = create_renewal_task(
        target=FakeRenewalTarget(),
        clock=ManualClock(1_000),
        interval_ms=5_000,
        scheduler=ManualScheduler(),
        reclaim_target=target,
        on_pass_complete=on_pass_complete,
    )
    try:
        task.start()
        assert task.request_reclaim()
        wait_set(reporting, "the first reclaim reporting its result")
        # An engine is seen dead now (the crash probe's on_dead): the slot is still busy.
        assert task.request_reclaim() is True  # "started or queued"
        go.set()
        assert task.wait_idle(10)
        assert target.list_calls == 2, "the request made while the slot was busy never ran"
    finally:
        go.set()
        assert task.close(timeout=10)


def test_a_request_made_during_the_last_urgent_round_is_followed_by_a_reclaim() -> None:
    """A request made in each round, the last of the ``URGENT_RECLAIM_ROUNDS`` included (a
    rolling crash), gets a sub-pass of its own."""
    task_box: list[RenewalTask] = []
    requested: list[bool] = []

    def on_list() -> None:
        # An engine dies during every round (a rolling crash); asked from another thread,
        # like the liveness watcher does.
        if len(requested) < URGENT_RECLAIM_ROUNDS:
            t = threading.Thread(target=lambda: requested.append(task_box[0].request_reclaim()))
            t.start()
            t.join()

    target = FakeReclaimTarget(on_list=on_list)
    task = create_renewal_task(
        target=FakeRenewalTarget(),
        clock=ManualClock(1_000),
        interval_ms=600_000,
        scheduler=ManualScheduler(),
        reclaim_target=target,
    )
    task_box.append(task)
    try:
        task.start()
        assert task.request_reclaim()
        assert task.wait_idle(10)
        assert requested == [True] * URGENT_RECLAIM_ROUNDS
        # One sub-pass for the first request, and one after each request made during one.
        assert target.list_calls == URGENT_RECLAIM_ROUNDS + 1
    finally:
        assert task.close(timeout=10)
