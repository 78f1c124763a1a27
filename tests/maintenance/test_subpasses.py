"""Renewal and reclaim sub-passes: positional outcomes, isolation, bounded fan-out (§5.3, §7.9)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.maintenance.helpers import (
    FakeBatchRenewalTarget,
    FakeReclaimTarget,
    FakeRenewalTarget,
    FakeSignalPollTarget,
    FakeUpdatePollTarget,
    Gauge,
)
from tests.support.waiting import wait_set
from weft_sync.clock import ManualClock
from weft_sync.maintenance.subpasses import (
    run_reclaim_pass,
    run_renewal_subpass,
    run_signal_poll_subpass,
    run_update_poll_subpass,
)
from weft_sync.maintenance.targets import (
    RECLAIM_CONCURRENCY,
    RENEWAL_CONCURRENCY,
    ReclaimPassStatus,
    RenewalStatus,
    SubpassStatus,
)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="test-pool")
    yield executor
    executor.shutdown(wait=True)


def _ids(n: int) -> list[str]:
    return [f"wf-{i}" for i in range(n)]


class _Blocker:
    """Blocks every call until released, counting the calls in flight."""

    def __init__(self) -> None:
        self.gauge = Gauge()
        self.release = threading.Event()

    def __call__(self, *_: object) -> None:
        self.gauge.enter()
        try:
            wait_set(self.release, "the test to release the blocked calls")
        finally:
            self.gauge.exit()


def _run_in_thread(fn: object) -> tuple[threading.Thread, list[object]]:
    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())  # type: ignore[operator]
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, name="test-pass", daemon=True)
    thread.start()
    return thread, box


# --- renewal ----------------------------------------------------------------------------------


def test_no_ids_renews_nothing() -> None:
    target = FakeRenewalTarget()
    result = run_renewal_subpass(target, [])
    assert result.outcomes == ()
    assert (result.renewed_count, result.failed_count) == (0, 0)


def test_outcomes_follow_input_order_and_failures_stay_isolated(pool: ThreadPoolExecutor) -> None:
    ids = _ids(20)
    errors = {"wf-3": RuntimeError("boom 3"), "wf-17": RuntimeError("boom 17")}
    target = FakeRenewalTarget(ids, failures=errors)
    result = run_renewal_subpass(target, ids, executor=pool)
    assert [o.workflow_id for o in result.outcomes] == ids
    assert sorted(target.renewed) == sorted(ids)
    for outcome in result.outcomes:
        if outcome.workflow_id in errors:
            assert outcome.status == "failed"
            assert outcome.error is errors[outcome.workflow_id]
        else:
            assert outcome.status is RenewalStatus.RENEWED
            assert outcome.error is None
    assert (result.renewed_count, result.failed_count) == (18, 2)


@pytest.mark.parametrize("with_pool", [False, True], ids=["own-pool", "given-pool"])
def test_forty_renewals_run_sixteen_at_a_time(with_pool: bool, pool: ThreadPoolExecutor) -> None:
    blocker = _Blocker()
    ids = _ids(40)
    target = FakeRenewalTarget(ids, on_renew=blocker)
    executor = pool if with_pool else None
    thread, box = _run_in_thread(lambda: run_renewal_subpass(target, ids, executor=executor))
    blocker.gauge.wait_until(RENEWAL_CONCURRENCY)
    blocker.release.set()
    thread.join(10)
    (result,) = box
    assert blocker.gauge.peak == RENEWAL_CONCURRENCY
    assert result.renewed_count == 40  # type: ignore[attr-defined]


def test_single_id_runs_inline_and_its_failure_is_an_outcome() -> None:
    threads: list[threading.Thread] = []
    error = RuntimeError("store down")
    target = FakeRenewalTarget(
        ["only"],
        failures={"only": error},
        on_renew=lambda _: threads.append(threading.current_thread()),
    )
    result = run_renewal_subpass(target, ["only"])
    assert threads == [threading.current_thread()]
    assert result.outcomes[0].status == "failed"
    assert result.outcomes[0].error is error
    assert (result.renewed_count, result.failed_count) == (0, 1)


def test_pass_completes_while_every_pool_worker_is_busy_elsewhere() -> None:
    busy_release = threading.Event()
    busy = Gauge()

    def occupy() -> None:
        busy.enter()
        wait_set(busy_release, "the pool to be freed")

    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-busy")
    try:
        for _ in range(2):
            executor.submit(occupy)
        busy.wait_until(2)
        ids = _ids(30)
        target = FakeRenewalTarget(ids)
        result = run_renewal_subpass(target, ids, executor=executor)
        assert result.renewed_count == 30
        assert not busy_release.is_set()
    finally:
        busy_release.set()
        executor.shutdown(wait=True)


def test_pass_driven_from_a_worker_of_its_own_pool_does_not_deadlock() -> None:
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-one")
    try:
        ids = _ids(10)
        target = FakeRenewalTarget(ids)
        future = executor.submit(run_renewal_subpass, target, ids, executor=executor)
        assert future.result(timeout=10).renewed_count == 10
    finally:
        executor.shutdown(wait=True)


def test_invalid_chunk_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 0"):
        run_renewal_subpass(FakeRenewalTarget(), [], chunk_size=0)


# --- batched renewal -------------------------------------------------------------------------


def test_batched_target_is_renewed_in_chunks_with_positional_outcomes(
    pool: ThreadPoolExecutor,
) -> None:
    ids = _ids(10)
    lost = RuntimeError("lost wf-4")
    target = FakeBatchRenewalTarget(ids, failures={"wf-4": lost})
    result = run_renewal_subpass(target, ids, executor=pool, chunk_size=3)
    assert sorted(map(len, target.batches)) == [1, 3, 3, 3]
    assert sorted(wid for batch in target.batches for wid in batch) == sorted(ids)
    assert [o.workflow_id for o in result.outcomes] == ids
    assert result.outcomes[4].status == "failed" and result.outcomes[4].error is lost
    assert (result.renewed_count, result.failed_count) == (9, 1)


def test_a_raising_chunk_fails_only_its_own_ids(pool: ThreadPoolExecutor) -> None:
    ids = _ids(6)
    error = RuntimeError("chunk commit failed")

    def on_batch(batch: Sequence[str]) -> None:
        if "wf-3" in batch:
            raise error

    target = FakeBatchRenewalTarget(ids, on_batch=on_batch)
    result = run_renewal_subpass(target, ids, executor=pool, chunk_size=2)
    statuses = [(o.workflow_id, o.status.value, o.error) for o in result.outcomes]
    assert statuses == [
        ("wf-0", "renewed", None),
        ("wf-1", "renewed", None),
        ("wf-2", "failed", error),
        ("wf-3", "failed", error),
        ("wf-4", "renewed", None),
        ("wf-5", "renewed", None),
    ]


def test_a_chunk_answering_with_the_wrong_length_fails_its_ids() -> None:
    target = FakeBatchRenewalTarget(["a", "b"], batch_result=lambda batch: [None])
    result = run_renewal_subpass(target, ["a", "b"])
    assert result.failed_count == 2
    error = result.outcomes[0].error
    assert isinstance(error, ValueError)
    assert "returned 1 results for 2 ids" in str(error)


def test_a_batch_result_that_is_neither_none_nor_an_exception_is_a_failure() -> None:
    target = FakeBatchRenewalTarget(["a", "b"], batch_result=lambda batch: [None, "ok"])
    result = run_renewal_subpass(target, ["a", "b"])
    assert result.outcomes[0].status == "renewed"
    assert result.outcomes[1].status == "failed"
    assert isinstance(result.outcomes[1].error, TypeError)
    assert "'ok'" in str(result.outcomes[1].error)


def test_batched_chunks_spread_over_the_pool(pool: ThreadPoolExecutor) -> None:
    blocker = _Blocker()
    ids = _ids(8)
    target = FakeBatchRenewalTarget(ids, on_batch=blocker)
    thread, box = _run_in_thread(
        lambda: run_renewal_subpass(target, ids, executor=pool, chunk_size=2)
    )
    blocker.gauge.wait_until(4)
    blocker.release.set()
    thread.join(10)
    assert box[0].renewed_count == 8  # type: ignore[attr-defined]
    assert blocker.gauge.peak == 4


# --- reclaim ---------------------------------------------------------------------------------


def test_reclaim_outcomes_are_reported_in_candidate_order(pool: ThreadPoolExecutor) -> None:
    results = {
        "a": "reclaimed",
        "b": "not-eligible",
        "c": "backoff-skipped",
        "d": "lost-race",
    }
    target = FakeReclaimTarget(list(results), results=dict(results))
    result = run_reclaim_pass(target, executor=pool)
    assert result.status is ReclaimPassStatus.COMPLETED
    assert [(o.workflow_id, o.status) for o in result.outcomes] == list(results.items())
    assert result.reclaimed_count == 1
    assert result.error is None


def test_a_raising_attempt_is_an_error_outcome_and_later_candidates_still_run() -> None:
    error = RuntimeError("drive failed")
    target = FakeReclaimTarget(["a", "b", "c"], results={"a": error, "c": "reclaimed"})
    result = run_reclaim_pass(target)
    assert [o.status for o in result.outcomes] == ["error", "not-eligible", "reclaimed"]
    assert result.outcomes[0].error is error
    assert sorted(target.attempts) == ["a", "b", "c"]
    assert result.reclaimed_count == 1


def test_a_raising_candidate_listing_is_discovery_failed() -> None:
    error = RuntimeError("scan failed")
    target = FakeReclaimTarget(list_error=error)
    result = run_reclaim_pass(target)
    assert result.status == "discovery-failed"
    assert result.error is error
    assert result.outcomes == ()
    assert target.attempts == []


def test_an_unknown_attempt_result_is_an_error_outcome() -> None:
    target = FakeReclaimTarget(["a"], results={"a": "taken"})
    (outcome,) = run_reclaim_pass(target).outcomes
    assert outcome.status == "error"
    assert isinstance(outcome.error, ValueError)
    assert "'taken'" in str(outcome.error) and "'reclaimed'" in str(outcome.error)


def test_no_candidates_completes_empty() -> None:
    result = run_reclaim_pass(FakeReclaimTarget())
    assert (result.status, result.outcomes, result.reclaimed_count) == ("completed", (), 0)


def test_reclaim_attempts_run_sixteen_at_a_time(pool: ThreadPoolExecutor) -> None:
    blocker = _Blocker()
    ids = _ids(40)
    target = FakeReclaimTarget(ids, results=dict.fromkeys(ids, "reclaimed"), on_attempt=blocker)
    thread, box = _run_in_thread(lambda: run_reclaim_pass(target, executor=pool))
    blocker.gauge.wait_until(RECLAIM_CONCURRENCY)
    blocker.release.set()
    thread.join(10)
    assert blocker.gauge.peak == RECLAIM_CONCURRENCY
    assert box[0].reclaimed_count == 40  # type: ignore[attr-defined]


# --- poll wrappers ---------------------------------------------------------------------------


def test_signal_poll_subpass_wraps_the_result_or_the_error() -> None:
    clock = ManualClock(7)
    ok = run_signal_poll_subpass(FakeSignalPollTarget([("a", "go")], buffered=[("a", "go")]), clock)
    assert ok.status is SubpassStatus.COMPLETED
    assert ok.result is not None and ok.result.woken_count == 1
    error = RuntimeError("probe failed")
    failed = run_signal_poll_subpass(FakeSignalPollTarget([("a", "go")], probe_error=error), clock)
    assert (failed.status, failed.result, failed.error) == ("failed", None, error)


def test_update_poll_subpass_wraps_the_result_or_the_error() -> None:
    clock = ManualClock(7)
    ok = run_update_poll_subpass(FakeUpdatePollTarget(["a"], pending=["a"]), clock)
    assert ok.status == "completed"
    assert ok.result is not None and ok.result.drained_count == 1
    error = RuntimeError("list failed")

    def fail() -> None:
        raise error

    failed = run_update_poll_subpass(FakeUpdatePollTarget(["a"], on_list=fail), clock)
    assert (failed.status, failed.result, failed.error) == ("failed", None, error)
