"""The backfill brings a store written before the index under the invariant, a few keys a step.

Holders written without entries (as an older version wrote them) are given theirs, stale entries
are removed or corrected, concurrent holder changes make a fix lose its condition (skipped,
retried by the next sweep, never left wrong), and a clean sweep writes the marker.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import msgpack
import pytest

from tests.claims.conftest import Factory
from tests.claims.gated import START_MS, GatedStorage, WarningSink, new_registry
from tests.claims.index_checks import ENTRY_PREFIX, assert_index_exact, entries, index_violations
from weft_sync import keys
from weft_sync.claims.engine_index import (
    BackfillStep,
    backfill_step,
    index_marker_present,
    read_engine_entries,
)
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, encode_epoch, encode_holder
from weft_sync.errors import StorageCapabilityError
from weft_sync.storage import Condition, Operation, Put, Storage
from weft_sync.storage.base import Batch

ENTRY = keys.workflow_owner_by_engine


def old_holder(storage: Storage, wid: str, engine_id: str, epoch: int = 1) -> bytes:
    """Write a holder and its epoch as a version without the index did: no entry."""
    holder = encode_holder(HolderRecord(engine_id, epoch, START_MS + 30_000, START_MS))
    storage.batch(
        [
            Put(keys.workflow_owner_epoch(wid), encode_epoch(epoch)),
            Put(keys.workflow_owner_holder(wid), holder),
        ]
    )
    return holder


def run_to_done(
    storage: Storage, budget: int, clock: ManualClock, limit: int = 100
) -> list[BackfillStep]:
    steps: list[BackfillStep] = []
    cursor: str | None = None
    for _ in range(limit):
        step = backfill_step(storage, cursor=cursor, budget=budget, clock=clock)
        steps.append(step)
        if step.done:
            return steps
        cursor = step.cursor
    raise AssertionError(f"the backfill did not finish in {limit} steps: {steps[-3:]}")


def test_an_old_store_is_indexed_in_steps_and_the_marker_written(
    gated: GatedStorage, clock: ManualClock
) -> None:
    for n in range(13):
        old_holder(gated, f"wf-{n:02}", "engine-a" if n % 2 else "engine-b", epoch=n + 1)
    gated.put(keys.workflow_owner_holder("garbage"), b"\xc1")  # a holder that does not decode
    assert not index_marker_present(gated)

    steps = run_to_done(gated, budget=4, clock=clock)

    assert sum(step.written for step in steps) == 13
    assert len(steps) > 4  # 14 holders at 4 a step, then the entries, then a clean sweep
    assert all(step.skipped == 0 for step in steps)
    assert entries(gated) == {
        ("engine-a" if n % 2 else "engine-b", f"wf-{n:02}"): n + 1 for n in range(13)
    }
    assert_index_exact(gated)
    marker = gated.get(keys.OWNER_INDEX_MARKER)
    assert marker is not None
    assert msgpack.unpackb(marker) == {"version": 1, "completed_at": START_MS}
    assert index_marker_present(gated)
    assert (steps[-1].cursor, steps[-1].done) == (None, True)
    # Exactly one step ended a sweep (the first, which fixed entries), then a clean one ended.
    ended = [i for i, step in enumerate(steps) if step.sweep_ended]
    assert len(ended) == 1
    assert sum(step.written for step in steps[: ended[0] + 1]) == 13
    assert not steps[-1].sweep_ended


def test_a_store_with_the_marker_is_not_read_again(gated: GatedStorage, clock: ManualClock) -> None:
    run_to_done(gated, budget=10, clock=clock)  # an empty store: one clean sweep
    scans = gated.calls["scan"]
    assert backfill_step(gated, cursor=None, budget=10) == BackfillStep(None, 0, True)
    assert gated.calls["scan"] == scans


def test_a_store_written_with_the_index_needs_no_fix(
    make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    registry = make("engine-a")
    for n in range(5):
        registry.acquire(f"wf-{n}")
    (step,) = run_to_done(gated, budget=100, clock=clock)
    assert (step.written, step.done) == (0, True)


def test_stale_entries_are_deleted_and_wrong_epochs_corrected(
    make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    make("engine-b").acquire("held-by-b")
    make("engine-a").acquire("wrong-epoch")
    gated.batch(
        [
            Put(ENTRY("engine-a", "no-holder"), encode_epoch(3)),  # its holder is gone
            Put(ENTRY("engine-a", "held-by-b"), encode_epoch(1)),  # names the wrong engine
            Put(ENTRY("engine-a", "wrong-epoch"), encode_epoch(7)),  # names the wrong epoch
            Put(keys.workflow_owner_holder("garbage"), b"\xc1"),
            Put(ENTRY("engine-a", "garbage"), encode_epoch(1)),  # its holder does not decode
        ]
    )
    steps = run_to_done(gated, budget=2, clock=clock)
    assert sum(step.written for step in steps) == 4
    assert entries(gated) == {("engine-b", "held-by-b"): 1, ("engine-a", "wrong-epoch"): 1}
    assert_index_exact(gated)


def test_a_holder_renewed_under_the_fix_is_skipped_then_fixed(
    make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    registry = make("engine-a")
    registry.acquire("wf-1")
    gated.delete(ENTRY("engine-a", "wf-1"))  # as if written before the index
    clock.advance(1_000)
    gated.before_next_cas(lambda: registry.renew("wf-1"))  # the holder's bytes move

    first = backfill_step(gated, cursor=None, budget=1, clock=clock)

    assert (first.written, first.skipped, first.done) == (0, 1, False)
    assert entries(gated) == {}
    steps = run_to_done_from(gated, first, clock)
    assert steps[-1].done
    assert entries(gated) == {("engine-a", "wf-1"): 1}
    assert_index_exact(gated)


def test_a_holder_released_under_the_fix_gets_no_entry(
    make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    registry = make("engine-a")
    registry.acquire("wf-1")
    gated.delete(ENTRY("engine-a", "wf-1"))
    gated.before_next_cas(lambda: registry.release("wf-1"))

    step = backfill_step(gated, cursor=None, budget=1, clock=clock)

    assert step.skipped == 1
    assert gated.get(keys.workflow_owner_holder("wf-1")) is None
    assert entries(gated) == {}
    run_to_done_from(gated, step, clock)
    assert_index_exact(gated)


def test_a_stale_entry_claimed_again_under_its_delete_survives(
    make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    registry = make("engine-a")
    registry.acquire("wf-1")
    registry.release("wf-1")
    gated.put(ENTRY("engine-a", "wf-1"), encode_epoch(1))  # stale: left by an older engine
    # Engine A acquires wf-1 again just before the delete of its stale entry commits.
    gated.before_next_cas(lambda: registry.acquire("wf-1"))

    step = backfill_step(gated, cursor=None, budget=10, clock=clock)

    assert step.skipped == 1
    assert entries(gated) == {("engine-a", "wf-1"): 2}
    run_to_done_from(gated, step, clock)
    assert entries(gated) == {("engine-a", "wf-1"): 2}
    assert_index_exact(gated)


def test_an_old_engine_writing_during_the_sweep_is_caught_by_the_next(
    gated: GatedStorage, clock: ManualClock
) -> None:
    old_holder(gated, "a-first", "engine-old")
    step = backfill_step(gated, cursor=None, budget=1, clock=clock)
    assert step.written == 1
    old_holder(gated, "0-behind-the-cursor", "engine-old")  # sorts before the cursor
    steps = run_to_done_from(gated, step, clock)
    assert steps[-1].done
    assert entries(gated) == {
        ("engine-old", "a-first"): 1,
        ("engine-old", "0-behind-the-cursor"): 1,
    }
    assert_index_exact(gated)


def test_two_engines_backfilling_at_once_both_finish(
    gated: GatedStorage, storage: Storage, clock: ManualClock
) -> None:
    for n in range(9):
        old_holder(gated, f"wf-{n}", f"engine-{n % 3}")
    gated.put(ENTRY("engine-9", "gone"), encode_epoch(1))
    cursors: list[str | None] = [None, None]
    done = [False, False]
    for _ in range(50):
        for i in (0, 1):
            if not done[i]:
                step = backfill_step(gated if i else storage, cursor=cursors[i], budget=2 + i)
                cursors[i], done[i] = step.cursor, step.done
        if all(done):
            break
    assert done == [True, True]
    assert len(entries(gated)) == 9
    assert_index_exact(gated)


class OlderVersion(GatedStorage):
    """A store as an engine without the index writes to it: by-engine operations dropped."""

    def conditional_batch(
        self, conditions: Sequence[Condition], operations: Sequence[Operation]
    ) -> bool:
        return super().conditional_batch(conditions, _no_entries(operations))

    def conditional_batches(self, batches: Sequence[Batch]) -> list[bool]:
        return super().conditional_batches([(c, _no_entries(o)) for c, o in batches])


def _no_entries(operations: Sequence[Operation]) -> list[Operation]:
    return [op for op in operations if not op.key.startswith(ENTRY_PREFIX)]


def test_an_older_engines_release_of_an_indexed_holder_is_repaired_by_the_next_sweep(
    gated: GatedStorage, storage: Storage, clock: ManualClock
) -> None:
    older = new_registry(OlderVersion(storage), clock, "engine-old", WarningSink())
    older.acquire("wf-1")
    older.acquire("wf-2")
    step = backfill_step(gated, cursor=None, budget=10, clock=clock)
    assert entries(gated) == {("engine-old", "wf-1"): 1, ("engine-old", "wf-2"): 1}
    older.release("wf-1")  # leaves its entry behind: it knows nothing of entries
    older.acquire("wf-3")  # a holder without an entry
    assert index_violations(gated) == [
        f"missing {ENTRY('engine-old', 'wf-3')}",
        f"unbacked {ENTRY('engine-old', 'wf-1')}",
    ]
    steps = run_to_done_from(gated, step, clock)
    assert steps[-1].done
    assert entries(gated) == {("engine-old", "wf-2"): 1, ("engine-old", "wf-3"): 1}
    assert_index_exact(gated)


def test_backfill_racing_live_engines_ends_exact(storage: Storage, clock: ManualClock) -> None:
    ids = [f"wf-{n}" for n in range(12)]
    for wid in ids[:6]:
        old_holder(storage, wid, "engine-gone")
    engines = [new_registry(storage, clock, f"engine-{n}", WarningSink()) for n in range(2)]
    failures: list[BaseException] = []

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        registry, other = engines[seed], f"engine-{1 - seed}"
        try:
            for _ in range(150):
                wid = rng.choice(ids)
                action = rng.randrange(4)
                if action == 0:
                    registry.acquire(wid)
                elif action == 1:
                    registry.release(wid)
                elif action == 2:
                    registry.takeover(wid, dead_engines={other, "engine-gone"})
                else:
                    registry.renew_many(registry.list_held_workflow_ids())
        except BaseException as exc:  # re-raised in the test below
            failures.append(exc)

    workers = [threading.Thread(target=churn, args=(n,), name=f"churn-{n}") for n in range(2)]
    for worker in workers:
        worker.start()
    cursor: str | None = None
    while any(worker.is_alive() for worker in workers):
        step = backfill_step(storage, cursor=cursor, budget=3, clock=clock)
        cursor = None if step.done else step.cursor
        if step.done:
            storage.delete(keys.OWNER_INDEX_MARKER)  # keep sweeping while the engines run
    for worker in workers:
        worker.join(timeout=60)
    assert not failures, failures
    # The racing fixes broke nothing the live engines wrote: at most the old holders still wait.
    gone_prefix = f"missing {keys.workflow_owner_by_engine_prefix('engine-gone')}"
    assert [v for v in index_violations(storage) if not v.startswith(gone_prefix)] == []
    storage.delete(keys.OWNER_INDEX_MARKER)
    run_to_done(storage, budget=5, clock=clock)
    assert_index_exact(storage)
    for registry in engines:
        registry.close()
    assert_index_exact(storage)


def test_bad_arguments_are_refused_before_any_io(gated: GatedStorage) -> None:
    with pytest.raises(ValueError, match="budget must be an int >= 1, got 0"):
        backfill_step(gated, cursor=None, budget=0)
    with pytest.raises(ValueError, match="cursor must be None or a cursor returned by"):
        backfill_step(gated, cursor="x1|wf-owner-holder:a", budget=1)
    with pytest.raises(ValueError, match="cursor must be None or a cursor returned by"):
        backfill_step(gated, cursor="e0|wf-owner-holder:a", budget=1)  # a key of the wrong phase
    assert gated.total_calls == 0


def test_a_store_without_conditional_batches_cannot_be_backfilled(storage: Storage) -> None:
    with pytest.raises(StorageCapabilityError):
        backfill_step(GatedStorage(storage, conditional_batch=False), cursor=None, budget=1)


# -- reading one engine's entries --------------------------------------------------------------


def test_read_engine_entries_pages_through_one_engines_entries(
    make: Factory, gated: GatedStorage
) -> None:
    a, b = make("engine:a"), make("engine:a2")
    for n in range(5):
        a.acquire(f"wf-{n}")
        b.acquire(f"wf-{n}")
    gated.put(keys.workflow_owner_by_engine_prefix("engine:a") + "%zz", b"junk")  # not canonical

    first = read_engine_entries(gated, "engine:a", limit=3)
    rest = read_engine_entries(gated, "engine:a", limit=3, after=first[-1][0])

    assert first == [(f"wf-{n}", encode_epoch(1)) for n in range(3)]
    assert rest == [(f"wf-{n}", encode_epoch(1)) for n in (3, 4)]
    assert read_engine_entries(gated, "engine:none", limit=3) == []


@pytest.mark.parametrize(("engine_id", "limit"), [("", 1), ("e", 0), ("e", True)])
def test_read_engine_entries_refuses_bad_arguments(
    gated: GatedStorage, engine_id: str, limit: int
) -> None:
    with pytest.raises(ValueError, match=r"engine_id must be a non-empty str|limit must be"):
        read_engine_entries(gated, engine_id, limit=limit)


def run_to_done_from(
    storage: Storage, step: BackfillStep, clock: ManualClock
) -> list[BackfillStep]:
    steps = [step]
    for _ in range(50):
        if steps[-1].done:
            return steps
        steps.append(backfill_step(storage, cursor=steps[-1].cursor, budget=1, clock=clock))
    raise AssertionError(f"the backfill did not finish: {steps[-3:]}")
