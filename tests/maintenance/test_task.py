"""The renewal task's full pass, ``run_once()`` (spec §5.3, §7.9 items 108-123, 131, 136)."""

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
    ManualScheduler,
    PassRecorder,
)
from tests.support.waiting import wait_set, wait_until
from weft_sync.clock import ManualClock
from weft_sync.errors import ClosedError
from weft_sync.maintenance.targets import PassKind, PassResult, ReclaimPassStatus
from weft_sync.maintenance.task import RenewalTask
from weft_sync.maintenance.task_factory import create_renewal_task

MakeTask = Callable[..., RenewalTask]


@pytest.fixture
def make_task() -> Iterator[MakeTask]:
    """Build tasks with a manual scheduler and a manual clock; every task is closed afterwards."""
    tasks: list[RenewalTask] = []

    def make(**kwargs: Any) -> RenewalTask:
        kwargs.setdefault("clock", ManualClock(1_000))
        kwargs.setdefault("interval_ms", 5_000)
        kwargs.setdefault("scheduler", ManualScheduler())
        task = create_renewal_task(**kwargs)
        tasks.append(task)
        return task

    yield make
    for task in tasks:
        assert task.close(timeout=10)


def _in_thread(fn: Callable[[], object], name: str) -> tuple[threading.Thread, list[object]]:
    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, box


def _wait_for_followers(task: RenewalTask, count: int) -> None:
    """Wait until ``count`` callers block on the shared ``run_once()`` pass in flight.

    Looks inside the pass's future (a ``concurrent.futures.Future`` whose ``result()`` waits on
    its condition), the only place where a caller that joined the pass is visible.
    """

    def joined() -> bool:
        shared = task._shared_pass
        return shared is not None and len(shared._condition._waiters) >= count  # type: ignore[attr-defined]

    wait_until(joined, f"{count} caller(s) to join the pass in flight", poll_s=0.001)


def test_empty_held_set_gives_an_empty_pass(make_task: MakeTask) -> None:
    target = FakeRenewalTarget()
    result = make_task(target=target).run_once()
    assert result.outcomes == ()
    assert (result.renewed_count, result.failed_count) == (0, 0)
    assert result.started_at == result.finished_at == 1_000
    assert target.list_calls == 1
    assert result.kind is PassKind.FULL


def test_every_held_id_is_renewed_in_order(make_task: MakeTask) -> None:
    target = FakeRenewalTarget(["a", "b", "c"])
    result = make_task(target=target).run_once()
    assert [(o.workflow_id, o.status) for o in result.outcomes] == [
        ("a", "renewed"),
        ("b", "renewed"),
        ("c", "renewed"),
    ]
    assert result.renewed_count == 3


def test_a_failing_renewal_is_recorded_with_its_exact_error(make_task: MakeTask) -> None:
    error = RuntimeError("lost b")
    target = FakeRenewalTarget(["a", "b", "c"], failures={"b": error})
    result = make_task(target=target).run_once()
    assert [o.status for o in result.outcomes] == ["renewed", "failed", "renewed"]
    assert result.outcomes[1].error is error
    assert sorted(target.renewed) == ["a", "b", "c"]
    assert (result.renewed_count, result.failed_count) == (2, 1)


def test_all_renewals_failing_counts_every_failure(make_task: MakeTask) -> None:
    target = FakeRenewalTarget(["a", "b"], failures={"a": OSError("x"), "b": OSError("y")})
    result = make_task(target=target).run_once()
    assert (result.renewed_count, result.failed_count) == (0, 2)


def test_pass_times_come_from_the_injected_clock(make_task: MakeTask) -> None:
    clock = ManualClock(5_042)
    target = FakeRenewalTarget(["a"], on_renew=lambda _: clock.advance(8))
    result = make_task(target=target, clock=clock).run_once()
    assert (result.started_at, result.finished_at) == (5_042, 5_050)


def test_held_ids_are_read_once_per_pass(make_task: MakeTask) -> None:
    target = FakeRenewalTarget(["a", "b"])
    target.on_renew = lambda wid: target.held.append("late") if wid == "a" else None
    result = make_task(target=target).run_once()
    assert [o.workflow_id for o in result.outcomes] == ["a", "b"]
    assert "late" not in target.renewed
    assert target.list_calls == 1


def test_on_pass_complete_receives_the_returned_result(make_task: MakeTask) -> None:
    recorder = PassRecorder()
    result = make_task(target=FakeRenewalTarget(["a"]), on_pass_complete=recorder).run_once()
    assert len(recorder.results) == 1
    assert recorder.results[0] is result


def test_a_raising_pass_sink_is_logged_and_the_pass_still_returns(
    make_task: MakeTask, caplog: pytest.LogCaptureFixture
) -> None:
    error = RuntimeError("sink broke")

    def sink(_: PassResult) -> None:
        raise error

    task = make_task(target=FakeRenewalTarget(["a"]), on_pass_complete=sink)
    with caplog.at_level(logging.ERROR, logger="weft_sync.maintenance.task"):
        result = task.run_once()
    assert result.renewed_count == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert errors[0].exc_info is not None and errors[0].exc_info[1] is error
    assert "on_pass_complete" in errors[0].getMessage()


def test_a_raising_held_id_listing_makes_run_once_raise(make_task: MakeTask) -> None:
    error = RuntimeError("registry gone")

    def fail() -> None:
        raise error

    task = make_task(target=FakeRenewalTarget(on_list=fail))
    with pytest.raises(RuntimeError) as excinfo:
        task.run_once()
    assert excinfo.value is error


def test_unconfigured_sub_passes_are_absent_from_the_result(make_task: MakeTask) -> None:
    result = make_task(target=FakeRenewalTarget(["a"])).run_once()
    assert (result.reclaim, result.signal_poll, result.update_poll) == (None, None, None)


def test_reclaim_outcomes_are_part_of_the_pass(make_task: MakeTask) -> None:
    results = {"a": "reclaimed", "b": "not-eligible", "c": "backoff-skipped", "d": "lost-race"}
    reclaim = FakeReclaimTarget(list(results), results=dict(results))
    result = make_task(target=FakeRenewalTarget(), reclaim_target=reclaim).run_once()
    assert result.reclaim is not None
    assert result.reclaim.status is ReclaimPassStatus.COMPLETED
    assert [(o.workflow_id, o.status) for o in result.reclaim.outcomes] == list(results.items())
    assert result.reclaim.reclaimed_count == 1


def test_a_raising_reclaim_attempt_does_not_stop_later_candidates(make_task: MakeTask) -> None:
    error = RuntimeError("takeover exploded")
    reclaim = FakeReclaimTarget(["a", "b"], results={"a": error, "b": "reclaimed"})
    result = make_task(target=FakeRenewalTarget(), reclaim_target=reclaim).run_once()
    assert result.reclaim is not None
    assert [o.status for o in result.reclaim.outcomes] == ["error", "reclaimed"]
    assert result.reclaim.outcomes[0].error is error


def test_failed_discovery_is_reported_while_renewals_still_count(make_task: MakeTask) -> None:
    error = RuntimeError("scan failed")
    reclaim = FakeReclaimTarget(list_error=error)
    result = make_task(target=FakeRenewalTarget(["a", "b"]), reclaim_target=reclaim).run_once()
    assert result.reclaim is not None
    assert (result.reclaim.status, result.reclaim.error) == ("discovery-failed", error)
    assert result.renewed_count == 2


def test_a_buffered_parked_wait_is_woken_by_the_pass(make_task: MakeTask) -> None:
    signals = FakeSignalPollTarget([("a", "go")], buffered=[("a", "go")])
    result = make_task(target=FakeRenewalTarget(), signal_poll_target=signals).run_once()
    assert result.signal_poll is not None and result.signal_poll.status == "completed"
    assert result.signal_poll.result is not None
    assert result.signal_poll.result.woken_count == 1
    assert signals.woken == ["a"]


def test_a_raising_signal_probe_fails_only_the_signal_poll(make_task: MakeTask) -> None:
    error = RuntimeError("probe failed")
    signals = FakeSignalPollTarget([("a", "go")], probe_error=error)
    task = make_task(target=FakeRenewalTarget(["x"]), signal_poll_target=signals)
    result = task.run_once()
    assert result.signal_poll is not None
    assert (result.signal_poll.status, result.signal_poll.error) == ("failed", error)
    assert result.renewed_count == 1


def test_one_pass_runs_every_sub_pass_in_order(make_task: MakeTask) -> None:
    calls: list[str] = []
    renewal = FakeRenewalTarget(["r"], on_renew=lambda _: calls.append("renew"))
    reclaim = FakeReclaimTarget(["c"], on_attempt=lambda _: calls.append("reclaim"))
    signals = FakeSignalPollTarget(on_list=lambda: calls.append("signal-poll"))
    updates = FakeUpdatePollTarget(["u"], pending=["u"], on_list=lambda: calls.append("update"))
    result = make_task(
        target=renewal,
        reclaim_target=reclaim,
        signal_poll_target=signals,
        update_poll_target=updates,
    ).run_once()
    assert calls == ["renew", "reclaim", "signal-poll", "update"]
    assert result.update_poll is not None and result.update_poll.result is not None
    assert result.update_poll.result.drained_count == 1


def test_concurrent_run_once_calls_share_one_pass(make_task: MakeTask) -> None:
    entered, release = threading.Event(), threading.Event()

    def park() -> None:
        entered.set()
        wait_set(release, "the first pass to be released")

    target = FakeRenewalTarget(["a"], on_list=park)
    task = make_task(target=target)
    first, first_box = _in_thread(task.run_once, "test-first")
    wait_set(entered, "the first pass to start")
    target.on_list = None
    second, second_box = _in_thread(task.run_once, "test-second")
    _wait_for_followers(task, 1)
    release.set()
    first.join(10)
    second.join(10)
    assert isinstance(first_box[0], PassResult)
    assert first_box[0] is second_box[0]
    assert target.list_calls == 1
    assert task.run_once() is not first_box[0]


def test_concurrent_run_once_callers_share_the_exception(make_task: MakeTask) -> None:
    entered, release = threading.Event(), threading.Event()
    error = RuntimeError("listing failed")

    def park_then_fail() -> None:
        entered.set()
        wait_set(release, "the first pass to be released")
        raise error

    task = make_task(target=FakeRenewalTarget(on_list=park_then_fail))
    first, first_box = _in_thread(task.run_once, "test-first")
    wait_set(entered, "the first pass to start")
    second, second_box = _in_thread(task.run_once, "test-second")
    _wait_for_followers(task, 1)
    release.set()
    first.join(10)
    second.join(10)
    assert first_box == [error]
    assert second_box == [error]


def test_run_once_from_inside_a_pass_is_refused(make_task: MakeTask) -> None:
    seen: list[BaseException] = []
    task: RenewalTask | None = None

    def sink(_: PassResult) -> None:
        assert task is not None
        try:
            task.run_once()
        except RuntimeError as exc:
            seen.append(exc)

    task = make_task(target=FakeRenewalTarget(["a"]), on_pass_complete=sink)
    task.run_once()
    assert len(seen) == 1
    assert "inside a maintenance pass" in str(seen[0])


def test_run_once_leaves_no_thread_behind(make_task: MakeTask) -> None:
    before = set(threading.enumerate())
    ids = [f"wf-{i}" for i in range(40)]
    result = make_task(
        target=FakeRenewalTarget(ids), reclaim_target=FakeReclaimTarget(ids)
    ).run_once()
    assert result.renewed_count == 40
    assert set(threading.enumerate()) - before == set()


def test_run_once_after_close_is_refused(make_task: MakeTask) -> None:
    task = make_task(target=FakeRenewalTarget())
    task.close()
    with pytest.raises(ClosedError, match="closed"):
        task.run_once()


def test_construction_rejects_bad_arguments() -> None:
    target = FakeRenewalTarget()
    clock = ManualClock()
    with pytest.raises(ValueError, match="interval_ms must be a positive integer, got 0"):
        create_renewal_task(target=target, clock=clock, interval_ms=0)
    with pytest.raises(ValueError, match="executor_workers"):
        create_renewal_task(target=target, clock=clock, interval_ms=5, executor_workers=0)
    with pytest.raises(TypeError, match="renew_workflow_claim"):
        create_renewal_task(target=object(), clock=clock, interval_ms=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="clock"):
        create_renewal_task(target=target, clock=5, interval_ms=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="attempt_workflow_claim_takeover"):
        create_renewal_task(
            target=target,
            clock=clock,
            interval_ms=5,
            reclaim_target=object(),  # type: ignore[arg-type]
        )
