"""Owner-side signal and update polls, and the production signal-poll target (spec §5.8, §7.12)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pytest

from tests.maintenance.helpers import FakeSignalPollTarget, FakeUpdatePollTarget
from weft_sync.maintenance.polls import (
    LiveSignalWaiter,
    ParkedOperation,
    build_owner_side_signal_poll_target,
    run_owner_side_signal_poll,
    run_owner_side_update_poll,
)
from weft_sync.maintenance.targets import ParkedSignalWait, SignalPollStatus, UpdatePollStatus


class _SteppingClock:
    """Returns the given readings in order."""

    def __init__(self, *readings: int) -> None:
        self._readings = list(readings)

    def __call__(self) -> int:
        return self._readings.pop(0)


# --- signal poll -----------------------------------------------------------------------------


def test_signal_poll_with_no_waits_is_empty_and_reads_the_clock_before_and_after() -> None:
    result = run_owner_side_signal_poll(FakeSignalPollTarget(), _SteppingClock(10, 20))
    assert (result.started_at, result.finished_at, result.outcomes, result.woken_count) == (
        10,
        20,
        (),
        0,
    )


def test_signal_poll_wakes_only_buffered_waits() -> None:
    target = FakeSignalPollTarget([("a", "go"), ("b", "go")], buffered=[("b", "go")])
    result = run_owner_side_signal_poll(target, _SteppingClock(10, 20))
    assert [(o.workflow_id, o.signal_name, o.status) for o in result.outcomes] == [
        ("a", "go", SignalPollStatus.NOT_BUFFERED),
        ("b", "go", SignalPollStatus.WOKEN),
    ]
    assert target.woken == ["b"]
    assert result.woken_count == 1


def test_a_failing_wake_is_recorded_and_the_poll_goes_on() -> None:
    error = RuntimeError("resume failed")
    waits = [("wf-1", "s"), ("wf-2", "s"), ("wf-3", "s")]
    target = FakeSignalPollTarget(waits, buffered=waits, wake_errors={"wf-1": error})
    result = run_owner_side_signal_poll(target, _SteppingClock(10, 20))
    assert [o.status for o in result.outcomes] == ["wake-failed", "woken", "woken"]
    assert result.outcomes[0].error is error
    assert result.woken_count == 2


def test_two_waits_of_one_workflow_are_probed_independently() -> None:
    target = FakeSignalPollTarget([("a", "left"), ("a", "right")], buffered=[("a", "right")])
    result = run_owner_side_signal_poll(target, _SteppingClock(10, 20))
    assert target.probes == [("a", "left"), ("a", "right")]
    assert [o.status for o in result.outcomes] == ["not-buffered", "woken"]


def test_a_raising_probe_fails_the_whole_signal_poll() -> None:
    error = RuntimeError("buffer unreadable")
    target = FakeSignalPollTarget([("a", "go")], probe_error=error)
    with pytest.raises(RuntimeError) as excinfo:
        run_owner_side_signal_poll(target, _SteppingClock(10, 20))
    assert excinfo.value is error
    assert target.woken == []


# --- update poll -----------------------------------------------------------------------------


def test_update_poll_with_nothing_held_is_empty() -> None:
    result = run_owner_side_update_poll(FakeUpdatePollTarget(), _SteppingClock(3, 4))
    assert (result.started_at, result.finished_at, result.outcomes, result.drained_count) == (
        3,
        4,
        (),
        0,
    )


def test_update_poll_drains_only_workflows_with_pending_updates() -> None:
    target = FakeUpdatePollTarget(["a", "b", "c"], pending=["a", "c"])
    result = run_owner_side_update_poll(target, _SteppingClock(3, 4))
    assert [(o.workflow_id, o.status) for o in result.outcomes] == [
        ("a", UpdatePollStatus.DRAINED),
        ("b", UpdatePollStatus.NO_PENDING_UPDATES),
        ("c", UpdatePollStatus.DRAINED),
    ]
    assert target.drained == ["a", "c"]
    assert result.drained_count == 2


def test_a_failing_drain_is_recorded_and_the_next_is_drained() -> None:
    error = RuntimeError("handler raised")
    target = FakeUpdatePollTarget(["a", "b"], pending=["a", "b"], drain_errors={"a": error})
    result = run_owner_side_update_poll(target, _SteppingClock(3, 4))
    assert [o.status for o in result.outcomes] == ["drain-failed", "drained"]
    assert result.outcomes[0].error is error
    assert result.drained_count == 1


# --- production signal-poll target -----------------------------------------------------------


class _Sources:
    """A host's view of its parked workflows and live waiters."""

    def __init__(
        self,
        *,
        parked: Iterable[ParkedOperation] = (),
        waiters: Iterable[LiveSignalWaiter] = (),
        buffered: Iterable[tuple[str, str]] = (),
        decision: str = "proceed",
    ) -> None:
        self.parked = list(parked)
        self.waiters = list(waiters)
        self.buffered = set(buffered)
        self.decision = decision
        self.resumed: list[str] = []
        self.woken: list[tuple[str, str]] = []
        self.confirmations: list[str] = []

    def list_checkpoint_parked_operations(self) -> list[ParkedOperation]:
        return list(self.parked)

    def is_checkpoint_parked(self, workflow_id: str) -> bool:
        return any(op.workflow_id == workflow_id for op in self.parked)

    def resume_parked_workflow(self, workflow_id: str) -> None:
        self.resumed.append(workflow_id)

    def list_live_signal_waiters(self) -> list[LiveSignalWaiter]:
        return list(self.waiters)

    def wake_live_waiter(self, workflow_id: str, waiter_key: str) -> None:
        self.woken.append((workflow_id, waiter_key))

    def has_buffered_signal(self, workflow_id: str, signal_name: str) -> bool:
        return (workflow_id, signal_name) in self.buffered

    def confirm_signal_wake_ownership(self, workflow_id: str) -> str:
        self.confirmations.append(workflow_id)
        return self.decision


def test_target_lists_only_checkpoint_parked_signal_waits_and_live_waiters() -> None:
    sources = _Sources(
        parked=[
            ParkedOperation("p1", "wait-signal", "approve"),
            ParkedOperation("p2", "sleep"),
            ParkedOperation("p3", "wait-condition"),
        ],
        waiters=[LiveSignalWaiter("live", "live:go")],
    )
    target = build_owner_side_signal_poll_target(sources)
    assert list(target.list_parked_signal_waits()) == [
        ParkedSignalWait("p1", "approve"),
        ParkedSignalWait("live", "go"),
    ]


def test_waiter_key_is_split_on_the_known_id_prefix_not_on_colons() -> None:
    sources = _Sources(waiters=[LiveSignalWaiter("order:42", "order:42:payment:done")])
    waits = list(build_owner_side_signal_poll_target(sources).list_parked_signal_waits())
    assert waits == [ParkedSignalWait("order:42", "payment:done")]


def test_waiter_key_without_the_id_prefix_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    sources = _Sources(waiters=[LiveSignalWaiter("a", "b:go")])
    with caplog.at_level(logging.WARNING, logger="weft_sync.maintenance.polls"):
        waits = list(build_owner_side_signal_poll_target(sources).list_parked_signal_waits())
    assert waits == []
    assert "'b:go'" in caplog.text


def test_waking_a_checkpoint_parked_workflow_resumes_it() -> None:
    sources = _Sources(parked=[ParkedOperation("p1", "wait-signal", "approve")])
    build_owner_side_signal_poll_target(sources).wake_workflow("p1")
    assert sources.resumed == ["p1"]
    assert sources.woken == []


def test_wake_reaches_only_the_race_branch_whose_signal_is_buffered() -> None:
    sources = _Sources(
        waiters=[LiveSignalWaiter("w", "w:left"), LiveSignalWaiter("w", "w:right")],
        buffered=[("w", "right")],
    )
    build_owner_side_signal_poll_target(sources).wake_workflow("w")
    assert sources.woken == [("w", "w:right")]
    assert sources.confirmations == ["w"]


def test_wake_of_an_unknown_workflow_does_nothing() -> None:
    sources = _Sources(waiters=[LiveSignalWaiter("w", "w:go")], buffered=[("w", "go")])
    build_owner_side_signal_poll_target(sources).wake_workflow("other")
    assert (sources.resumed, sources.woken, sources.confirmations) == ([], [], [])


def test_discarded_ownership_check_wakes_nothing() -> None:
    sources = _Sources(
        waiters=[LiveSignalWaiter("w", "w:go")], buffered=[("w", "go")], decision="discard"
    )
    build_owner_side_signal_poll_target(sources).wake_workflow("w")
    assert sources.confirmations == ["w"]
    assert sources.woken == []


def test_confirmed_ownership_wakes_the_waiter_through_a_full_poll() -> None:
    sources = _Sources(waiters=[LiveSignalWaiter("w", "w:go")], buffered=[("w", "go")])
    target = build_owner_side_signal_poll_target(sources)
    result = run_owner_side_signal_poll(target, _SteppingClock(1, 2))
    assert [o.status for o in result.outcomes] == ["woken"]
    assert sources.woken == [("w", "w:go")]


def test_an_unexpected_ownership_answer_fails_the_wake() -> None:
    sources = _Sources(
        waiters=[LiveSignalWaiter("w", "w:go")], buffered=[("w", "go")], decision="maybe"
    )
    target = build_owner_side_signal_poll_target(sources)
    result = run_owner_side_signal_poll(target, _SteppingClock(1, 2))
    (outcome,) = result.outcomes
    assert outcome.status == "wake-failed"
    assert isinstance(outcome.error, ValueError)
    assert "'maybe'" in str(outcome.error)
    assert sources.woken == []


def test_sources_without_the_ownership_fence_are_rejected() -> None:
    class NoFence(_Sources):
        confirm_signal_wake_ownership = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match="confirm_signal_wake_ownership"):
        build_owner_side_signal_poll_target(NoFence())  # type: ignore[arg-type]
