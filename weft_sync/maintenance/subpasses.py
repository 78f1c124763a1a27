"""The sub-passes of a maintenance pass: renewal and reclaim fan-out, and the poll wrappers.

Renewal and reclaim fan out over a thread pool with *caller-runs* semantics: the calling thread
works through the items itself while at most ``concurrency - 1`` helper loops do the same on the
pool, and it waits only for items that some thread has already started. So a pass can never wait
for pool work that cannot start — not when the pool is saturated by other passes, and not when
the caller itself happens to be a worker of that pool (no nested-submit deadlock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Final, TypeVar

from ..clock import Clock
from .polls import run_owner_side_signal_poll, run_owner_side_update_poll
from .targets import (
    RECLAIM_CHUNK_SIZE,
    RECLAIM_CONCURRENCY,
    RENEWAL_CHUNK_SIZE,
    RENEWAL_CONCURRENCY,
    BatchReclaimTarget,
    ReclaimAttemptResult,
    ReclaimOutcome,
    ReclaimOutcomeStatus,
    ReclaimPassResult,
    ReclaimPassStatus,
    ReclaimTarget,
    RenewalOutcome,
    RenewalStatus,
    RenewalSubpassResult,
    RenewalTarget,
    SignalPollSubpassResult,
    SignalPollTarget,
    SubpassStatus,
    UpdatePollSubpassResult,
    UpdatePollTarget,
)

_T = TypeVar("_T")
_RENEWED: Final = RenewalStatus.RENEWED
BatchRenewer = Callable[[Sequence[str]], "list[Exception | None]"]


def run_renewal_subpass(
    target: RenewalTarget,
    workflow_ids: Sequence[str],
    *,
    executor: Executor | None = None,
    chunk_size: int = RENEWAL_CHUNK_SIZE,
) -> RenewalSubpassResult:
    """Renew every id, never stopping at a failure; outcomes follow the order of ``workflow_ids``.

    A target with ``renew_workflow_claims`` (:class:`~.targets.BatchRenewalTarget`) is renewed in
    chunks of ``chunk_size`` ids, one call per chunk; a chunk that raises fails only its own ids.
    Otherwise each id gets its own ``renew_workflow_claim`` call. A single item runs inline; more
    run at most :data:`~.targets.RENEWAL_CONCURRENCY` at a time, on ``executor`` when given (the
    caller keeps ownership of it) or on a pool created and joined within this call.

    :raises ValueError: ``chunk_size`` is not a positive integer.
    """
    _check_positive("chunk_size", chunk_size)
    ids = list(workflow_ids)
    renew_many = getattr(target, "renew_workflow_claims", None)
    if callable(renew_many):
        outcomes = _renew_in_chunks(renew_many, ids, executor, chunk_size)
    else:
        outcomes = _renew_one_by_one(target, ids, executor)
    renewed = sum(1 for outcome in outcomes if outcome.status is RenewalStatus.RENEWED)
    return RenewalSubpassResult(tuple(outcomes), renewed, len(outcomes) - renewed)


def _renew_one_by_one(
    target: RenewalTarget, ids: list[str], executor: Executor | None
) -> list[RenewalOutcome]:
    slots: list[RenewalOutcome | None] = [None] * len(ids)

    def renew(index: int) -> None:
        workflow_id = ids[index]
        try:
            target.renew_workflow_claim(workflow_id)
        except Exception as exc:
            slots[index] = RenewalOutcome(workflow_id, RenewalStatus.FAILED, exc)
        else:
            slots[index] = RenewalOutcome(workflow_id, RenewalStatus.RENEWED)

    _fan_out(len(ids), renew, executor=executor, concurrency=RENEWAL_CONCURRENCY)
    return _filled(slots)


def _renew_in_chunks(
    renew_many: BatchRenewer, ids: list[str], executor: Executor | None, chunk_size: int
) -> list[RenewalOutcome]:
    chunks = [ids[start : start + chunk_size] for start in range(0, len(ids), chunk_size)]
    slots: list[list[RenewalOutcome] | None] = [None] * len(chunks)

    def renew_chunk(index: int) -> None:
        chunk = chunks[index]
        try:
            errors = list(renew_many(chunk))
            if len(errors) != len(chunk):
                raise ValueError(
                    f"renew_workflow_claims() returned {len(errors)} results for {len(chunk)} "
                    f"ids; it must return one result (None or the exception) per id, in order"
                )
            slots[index] = [
                RenewalOutcome(wid, _RENEWED) if err is None else _batch_outcome(wid, err)
                for wid, err in zip(chunk, errors, strict=True)
            ]
        except Exception as exc:
            slots[index] = [RenewalOutcome(wid, RenewalStatus.FAILED, exc) for wid in chunk]

    _fan_out(len(chunks), renew_chunk, executor=executor, concurrency=RENEWAL_CONCURRENCY)
    return [outcome for chunk_outcomes in _filled(slots) for outcome in chunk_outcomes]


def _batch_outcome(workflow_id: str, error: object) -> RenewalOutcome:
    if error is None:
        return RenewalOutcome(workflow_id, RenewalStatus.RENEWED)
    if isinstance(error, Exception):
        return RenewalOutcome(workflow_id, RenewalStatus.FAILED, error)
    bad = TypeError(
        f"renew_workflow_claims() returned {error!r} for workflow {workflow_id!r}; each result "
        f"must be None (renewed) or an exception (failed)"
    )
    return RenewalOutcome(workflow_id, RenewalStatus.FAILED, bad)


def run_reclaim_pass(
    target: ReclaimTarget, *, executor: Executor | None = None
) -> ReclaimPassResult:
    """List the reclaim candidates and attempt each exactly once; never raises.

    A listing that raises gives ``discovery-failed`` with the error. Otherwise every candidate is
    attempted (an attempt that raises, or returns something that is not a
    :class:`~.targets.ReclaimAttemptResult` value, becomes an ``error`` outcome and the rest still
    run), at most :data:`~.targets.RECLAIM_CONCURRENCY` at a time, outcomes in candidate order.

    A :class:`~.targets.BatchReclaimTarget` prepares the candidates in chunks of
    :data:`~.targets.RECLAIM_CHUNK_SIZE` (a chunk whose preparation raises gives each of its ids
    an ``error`` outcome) and completes each plan of a chunk as one attempt once that chunk is
    prepared, while the other chunks are still being prepared.
    """
    try:
        ids = list(target.list_reclaim_candidate_workflow_ids())
    except Exception as exc:
        return ReclaimPassResult(ReclaimPassStatus.DISCOVERY_FAILED, error=exc)
    slots: list[ReclaimOutcome | None] = [None] * len(ids)
    if isinstance(target, BatchReclaimTarget):
        _reclaim_in_chunks(target, ids, slots, executor)
    else:

        def run(index: int) -> None:
            _attempt(
                ids,
                slots,
                index,
                lambda: target.attempt_workflow_claim_takeover(ids[index]),
                "attempt_workflow_claim_takeover",
            )

        _fan_out(len(ids), run, executor=executor, concurrency=RECLAIM_CONCURRENCY)
    outcomes = tuple(_filled(slots))
    reclaimed = sum(1 for o in outcomes if o.status is ReclaimOutcomeStatus.RECLAIMED)
    return ReclaimPassResult(ReclaimPassStatus.COMPLETED, outcomes, reclaimed)


def _reclaim_in_chunks(
    target: BatchReclaimTarget,
    ids: list[str],
    slots: list[ReclaimOutcome | None],
    executor: Executor | None,
) -> None:
    """Prepare ``ids`` in chunks over the pool, and complete each chunk's plans as soon as it
    is prepared (its drives start while later chunks still commit); a failed chunk fills its
    ids' error slots. The chunks share :data:`~.targets.RECLAIM_CONCURRENCY` between them."""
    chunks = [
        range(start, min(start + RECLAIM_CHUNK_SIZE, len(ids)))
        for start in range(0, len(ids), RECLAIM_CHUNK_SIZE)
    ]
    outer = min(len(chunks), RECLAIM_CONCURRENCY)
    inner = max(1, RECLAIM_CONCURRENCY // max(1, outer))

    def run_chunk(index: int) -> None:
        chunk = chunks[index]
        try:
            plans = list(target.prepare_workflow_claim_takeovers([ids[i] for i in chunk]))
            if len(plans) != len(chunk):
                raise ValueError(
                    f"prepare_workflow_claim_takeovers() returned {len(plans)} plans for "
                    f"{len(chunk)} ids"
                )
        except Exception as exc:
            for i in chunk:
                slots[i] = ReclaimOutcome(ids[i], ReclaimOutcomeStatus.ERROR, exc)
            return

        def complete(j: int) -> None:
            _attempt(
                ids,
                slots,
                chunk[j],
                lambda: target.complete_workflow_claim_takeover(plans[j]),
                "complete_workflow_claim_takeover",
            )

        _fan_out(len(chunk), complete, executor=executor, concurrency=inner)

    _fan_out(len(chunks), run_chunk, executor=executor, concurrency=outer)


def _attempt(
    ids: list[str],
    slots: list[ReclaimOutcome | None],
    index: int,
    attempt: Callable[[], object],
    method: str,
) -> None:
    """Run one candidate's attempt; its outcome (an ``error`` if it raised) goes to its slot."""
    try:
        status = _reclaim_status(attempt(), method)
    except Exception as exc:
        slots[index] = ReclaimOutcome(ids[index], ReclaimOutcomeStatus.ERROR, exc)
    else:
        slots[index] = ReclaimOutcome(ids[index], status)


def _reclaim_status(value: object, method: str) -> ReclaimOutcomeStatus:
    try:
        member = ReclaimAttemptResult(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in ReclaimAttemptResult)
        raise ValueError(f"{method}() returned {value!r}; it must return one of {valid}") from None
    return ReclaimOutcomeStatus(member.value)


def run_signal_poll_subpass(target: SignalPollTarget, clock: Clock) -> SignalPollSubpassResult:
    """Run the owner-side signal poll: ``completed`` with its result, or ``failed`` if it raised."""
    try:
        result = run_owner_side_signal_poll(target, clock)
    except Exception as exc:
        return SignalPollSubpassResult(SubpassStatus.FAILED, error=exc)
    return SignalPollSubpassResult(SubpassStatus.COMPLETED, result=result)


def run_update_poll_subpass(target: UpdatePollTarget, clock: Clock) -> UpdatePollSubpassResult:
    """Run the owner-side update poll: ``completed`` with its result, or ``failed`` if it raised."""
    try:
        result = run_owner_side_update_poll(target, clock)
    except Exception as exc:
        return UpdatePollSubpassResult(SubpassStatus.FAILED, error=exc)
    return UpdatePollSubpassResult(SubpassStatus.COMPLETED, result=result)


# --------------------------------------------------------------------------------------------
# Fan-out
# --------------------------------------------------------------------------------------------


class _IndexedWork:
    """Items ``0 .. count-1`` handed out one at a time to whichever thread asks next."""

    def __init__(self, count: int, run_item: Callable[[int], None]) -> None:
        self._count = count
        self._run_item = run_item
        # _lock guards _next, _unfinished and _error; _done waits on it for _unfinished == 0.
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._next = 0
        self._unfinished = count
        self._error: BaseException | None = None

    def drain(self) -> None:
        """Run items until none is left to start."""
        while True:
            with self._lock:
                if self._next >= self._count:
                    return
                index = self._next
                self._next += 1
            try:
                self._run_item(index)
            except BaseException as exc:
                with self._lock:
                    if self._error is None:
                        self._error = exc
            finally:
                with self._lock:
                    self._unfinished -= 1
                    if self._unfinished == 0:
                        self._done.notify_all()

    def wait(self) -> None:
        """Block until every item has finished, then re-raise the first escaped exception."""
        with self._lock:
            self._done.wait_for(lambda: self._unfinished == 0)
            error = self._error
        if error is not None:
            raise error


def _fan_out(
    count: int,
    run_item: Callable[[int], None],
    *,
    executor: Executor | None,
    concurrency: int,
) -> None:
    if count <= 1:
        for index in range(count):
            run_item(index)
        return
    work = _IndexedWork(count, run_item)
    helpers = min(concurrency, count) - 1
    own_pool: ThreadPoolExecutor | None = None
    if executor is None:
        own_pool = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="weft-fanout")
        executor = own_pool
    try:
        for _ in range(helpers):
            try:
                executor.submit(work.drain)
            except RuntimeError:
                # The executor is shutting down: the calling thread runs the remaining items.
                break
        work.drain()
        work.wait()
    finally:
        if own_pool is not None:
            own_pool.shutdown(wait=True)


def _filled(slots: Sequence[_T | None]) -> list[_T]:
    filled = [slot for slot in slots if slot is not None]
    if len(filled) != len(slots):
        raise RuntimeError("a fan-out finished with an item that recorded no outcome")
    return filled


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
