"""The reclaim target as a batched target: prepare many first attempts, then complete each one.

Engine A (under test) writes through a :class:`Hooked` gated store; its rivals write to the store
directly, so intercepts armed on A's wrapper never touch their writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from tests.claims.gated import (
    PAST_GRACE_MS,
    RENEW_MS,
    START_MS,
    TTL_MS,
    GatedStorage,
    WarningSink,
    new_registry,
    touches,
)
from tests.maintenance.helpers import (
    ManualScheduler,
    claim_attempts,
    complete_workflow,
    write_workflow,
)
from tests.token_match import epoch_numbers, token_shape
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import encode_epoch
from weft_sync.errors import StorageError
from weft_sync.maintenance import BatchReclaimTarget, bootstrap_workflow_lease_ownership
from weft_sync.maintenance.subpasses import run_reclaim_pass
from weft_sync.maintenance.targets import RECLAIM_CHUNK_SIZE, ReclaimOutcomeStatus
from weft_sync.metrics import ClaimMetrics
from weft_sync.reclaim.target import ReclaimTargetHandle, create_reclaim_target
from weft_sync.storage import Storage, open_storage
from weft_sync.storage.reads import storage_get_many


def _import_only(wf_type: str, revision: str | None) -> bool:
    return wf_type == "import"


class Hooked(GatedStorage):
    """A gated store with a native ``get_many`` whose next read naming a key can be made to fail.

    ``fail_next_read_of(key, error)`` makes the next read (``get`` or ``get_many``) naming ``key``
    raise ``error`` without reading; ``before_next_read_of(key, action)`` runs ``action`` right
    before it. ``reads_of(key)`` counts the reads that named ``key``.
    """

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        # _failures_lock guards _failures, _before and _reads.
        self._failures_lock = threading.Lock()
        self._failures: dict[str, BaseException] = {}
        self._before: dict[str, Callable[[], object]] = {}
        self._reads: dict[str, int] = {}

    def fail_next_read_of(self, key: str, error: BaseException) -> None:
        with self._failures_lock:
            self._failures[key] = error

    def before_next_read_of(self, key: str, action: Callable[[], object]) -> None:
        with self._failures_lock:
            self._before[key] = action

    def reads_of(self, key: str) -> int:
        with self._failures_lock:
            return self._reads.get(key, 0)

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys_: Sequence[str]) -> list[bytes | None]:
        self._count("get_many")
        with self._failures_lock:
            for k in keys_:
                self._reads[k] = self._reads.get(k, 0) + 1
            actions = [self._before.pop(k) for k in keys_ if k in self._before]
            errors = [self._failures.pop(k) for k in keys_ if k in self._failures]
        for action in actions:
            action()
        if errors:
            raise errors[0]
        return storage_get_many(self.inner, keys_)


class Drive:
    """An ``on_reclaimed`` callback recording each call; raises the given errors in turn."""

    def __init__(self, *errors: Exception) -> None:
        # _lock guards calls and _errors.
        self._lock = threading.Lock()
        self._errors = list(errors)
        self.calls: list[str] = []

    def __call__(self, workflow_id: str) -> None:
        with self._lock:
            self.calls.append(workflow_id)
            error = self._errors.pop(0) if self._errors else None
        if error is not None:
            raise error


def _prepare_and_complete(target: ReclaimTargetHandle, ids: Sequence[str]) -> list[str]:
    return [
        target.complete_workflow_claim_takeover(p)
        for p in target.prepare_workflow_claim_takeovers(ids)
    ]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def gated(storage: Storage) -> Hooked:
    return Hooked(storage)


@pytest.fixture
def reg(gated: Hooked, clock: ManualClock) -> ClaimRegistry:
    """Engine A's registry, writing through the hooked store."""
    return new_registry(gated, clock, "engine-a", WarningSink())


@pytest.fixture
def rival(storage: Storage, clock: ManualClock) -> ClaimRegistry:
    """Engine B's registry, writing to the store directly."""
    return new_registry(storage, clock, "engine-b", WarningSink())


@pytest.fixture
def metrics() -> ClaimMetrics:
    return ClaimMetrics()


@pytest.fixture
def drive() -> Drive:
    return Drive()


MakeTarget = Callable[..., ReclaimTargetHandle]


@pytest.fixture
def make_target(
    reg: ClaimRegistry, gated: Hooked, metrics: ClaimMetrics, drive: Drive
) -> MakeTarget:
    def make(**kwargs: Any) -> ReclaimTargetHandle:
        kwargs.setdefault("on_reclaimed", drive)
        return create_reclaim_target(reg, gated, metrics, **kwargs)

    return make


@pytest.fixture
def target(make_target: MakeTarget) -> ReclaimTargetHandle:
    return make_target()


def _stranded(storage: Storage, rival: ClaimRegistry, clock: ManualClock, *ids: str) -> None:
    """Running workflows whose rival claims expired past their grace."""
    for wid in ids:
        write_workflow(storage, wid)
        assert rival.acquire(wid).status == "acquired"
    clock.advance(PAST_GRACE_MS)


# -- the protocol ---------------------------------------------------------------------------


def test_the_reclaim_target_is_a_batch_reclaim_target(
    target: ReclaimTargetHandle, storage: Storage, clock: ManualClock
) -> None:
    assert isinstance(target, BatchReclaimTarget)
    engine = bootstrap_workflow_lease_ownership(
        storage=storage,
        clock=clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        scheduler=ManualScheduler(),
        warn=WarningSink(),
    )
    try:
        assert isinstance(engine.reclaim_target, BatchReclaimTarget)
    finally:
        assert engine.renewal_task.close(timeout=10)


def test_a_bootstrapped_pass_makes_the_first_attempts_in_one_transaction(
    storage: Storage, rival: ClaimRegistry, clock: ManualClock
) -> None:
    _stranded(storage, rival, clock, "wf-1", "wf-2")
    gated = GatedStorage(storage)
    driven: list[str] = []
    engine = bootstrap_workflow_lease_ownership(
        storage=gated,
        clock=clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        scheduler=ManualScheduler(),
        warn=WarningSink(),
        engine_id="engine-a",
        on_workflow_claim_reclaimed=driven.append,
    )
    try:
        gated.calls.clear()
        result = engine.renewal_task.run_once()
    finally:
        assert engine.renewal_task.close(timeout=10)
    assert result.reclaim is not None
    assert [(o.workflow_id, o.status) for o in result.reclaim.outcomes] == [
        ("wf-1", "reclaimed"),
        ("wf-2", "reclaimed"),
    ]
    assert sorted(driven) == ["wf-1", "wf-2"]
    assert (gated.calls["conditional_batches"], gated.calls["conditional_batch"]) == (1, 0)
    assert engine.metrics.snapshot().attempts["takeover"] == 2
    assert sorted(engine.registry.list_held_workflow_ids()) == ["wf-1", "wf-2"]


# -- batched == single attempts -------------------------------------------------------------


class _World:
    """Engine A (with its reclaim target), a rival and a competitor on one store."""

    def __init__(self, store: Storage, predicate: Callable[[str, str | None], bool] | None) -> None:
        self.store = store
        self.gated = Hooked(store)
        self.clock = ManualClock(START_MS)
        self.reg = new_registry(self.gated, self.clock, "engine-a", WarningSink())
        self.rival = new_registry(store, self.clock, "engine-b", WarningSink())
        self.competitor = new_registry(store, self.clock, "engine-c", WarningSink())
        self.metrics = ClaimMetrics()
        self.drive = Drive()
        self.target = create_reclaim_target(
            self.reg, self.gated, self.metrics, self.drive, is_eligible=predicate
        )

    def build(self) -> None:
        for wid in ("orphan", "expired", "live", "garbage", "deposed", "raced"):
            write_workflow(self.store, wid)
        write_workflow(self.store, "done", "completed")
        write_workflow(self.store, "export", wf_type="export")
        for wid in ("expired", "done", "export", "raced"):
            assert self.rival.acquire(wid).status == "acquired"
        assert self.reg.acquire("deposed").status == "acquired"
        self.clock.advance(PAST_GRACE_MS)
        assert self.rival.takeover("deposed").status == "acquired"
        self.clock.advance(PAST_GRACE_MS)
        assert self.reg.renew("deposed").status == "lost"  # this engine's cooldown starts
        assert self.rival.acquire("live").status == "acquired"
        self.store.put(keys.workflow_owner_holder("garbage"), b"\xc1 not a holder")
        self.store.put(keys.workflow_owner_epoch("garbage"), encode_epoch(4))
        # A competitor takes "raced" over just before engine A's commit naming it.
        self.gated.before_next_cas(
            lambda: self.competitor.takeover("raced"), match=touches("raced")
        )

    def state(self) -> tuple[object, ...]:
        return (
            epoch_numbers(self.store.scan("")),
            sorted(self.reg.list_held_workflow_ids()),
            {w: token_shape(self.reg.current_epoch_bytes(w)) for w in CANDIDATES},
            self.target.pending_redrive_ids(),
            self.drive.calls,
            claim_attempts(self.metrics),
        )


CANDIDATES = ["orphan", "expired", "live", "done", "ghost", "garbage", "deposed", "export", "raced"]


@pytest.fixture
def twin(storage_url: str) -> Iterator[Storage]:
    """A second, empty store of the backend under test (another table)."""
    url = storage_url.replace("table=t_", "table=u_")
    assert url != storage_url
    store = open_storage(url)
    yield store
    store.close()


@pytest.mark.parametrize("eligible", [None, _import_only], ids=["no-predicate", "import-only"])
def test_prepare_and_complete_match_single_attempts_on_an_identical_store(
    storage: Storage, twin: Storage, eligible: Callable[[str, str | None], bool] | None
) -> None:
    batched, single = _World(storage, eligible), _World(twin, eligible)
    for world in (batched, single):
        world.build()
    assert epoch_numbers(batched.store.scan("")) == epoch_numbers(single.store.scan(""))
    batched.gated.calls.clear()

    results = _prepare_and_complete(batched.target, CANDIDATES)
    one_by_one = [single.target.attempt_workflow_claim_takeover(w) for w in CANDIDATES]

    export = "reclaimed" if eligible is None else "not-eligible"
    assert results == [
        "reclaimed",  # orphan: ownerless, acquired
        "reclaimed",  # expired
        "not-eligible",  # live
        "not-eligible",  # done: taken over, then released
        "not-eligible",  # ghost: no record, no claim
        "reclaimed",  # garbage
        "backoff-skipped",  # deposed
        export,
        "not-eligible",  # raced: lost to the competitor, then live
    ]
    assert results == one_by_one
    assert batched.state() == single.state()
    assert claim_attempts(batched.metrics) == {
        "acquired": 1,
        "takeover": 4 if eligible is None else 3,
        "lost_race": 1,
        "backoff_skipped": 1,
    }
    assert holder_engine(storage, "raced") == "engine-c"
    assert holder_engine(storage, "done") is None
    assert stored_epoch(storage, "done") == 2
    # Every first takeover was committed in one transaction.
    assert batched.gated.calls["conditional_batches"] == 1


# -- completion ---------------------------------------------------------------------------


def test_a_plan_is_completed_once_and_driven_once(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    _stranded(storage, rival, clock, "wf-1")
    (plan,) = target.prepare_workflow_claim_takeovers(["wf-1"])
    assert reg.current_epoch("wf-1") == 2  # the first takeover happened while preparing
    assert drive.calls == []
    assert target.complete_workflow_claim_takeover(plan) == "reclaimed"
    with pytest.raises(ValueError, match="already completed"):
        target.complete_workflow_claim_takeover(plan)
    assert drive.calls == ["wf-1"]
    assert reg.current_epoch("wf-1") == 2


def test_completing_something_that_is_not_a_plan_is_refused(target: ReclaimTargetHandle) -> None:
    with pytest.raises(TypeError, match="ReclaimPlan"):
        target.complete_workflow_claim_takeover("wf-1")


@pytest.mark.parametrize("order", ["in-order", "reversed"])
def test_a_repeated_id_in_one_preparation_is_driven_once(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
    order: str,
) -> None:
    _stranded(storage, rival, clock, "wf-1")
    plans = target.prepare_workflow_claim_takeovers(["wf-1", "wf-1"])
    assert len(plans) == 2
    indexes = [0, 1] if order == "in-order" else [1, 0]
    results = {i: target.complete_workflow_claim_takeover(plans[i]) for i in indexes}
    assert results == {0: "reclaimed", 1: "not-eligible"}
    assert drive.calls == ["wf-1"]
    assert gated.transactions == 1
    assert reg.current_epoch("wf-1") == 2


def test_an_ineligible_workflow_is_decided_while_preparing_and_never_claimed(
    make_target: MakeTarget,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    seen: list[tuple[str, str | None]] = []

    def can_run(wf_type: str, revision: str | None) -> bool:
        seen.append((wf_type, revision))
        return wf_type == "import"

    write_workflow(storage, "other", wf_type="export")
    rival.acquire("other")
    clock.advance(PAST_GRACE_MS)
    target = make_target(is_eligible=can_run)
    assert _prepare_and_complete(target, ["other"]) == ["not-eligible"]
    assert seen == [("export", None)]
    assert gated.transactions == 0
    assert holder_engine(storage, "other") == "engine-b"
    assert drive.calls == []


def test_a_workflow_that_stopped_running_during_the_takeover_is_released(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    metrics: ClaimMetrics,
    drive: Drive,
) -> None:
    _stranded(storage, rival, clock, "wf-1", "wf-2")
    gated.before_next_cas(lambda: complete_workflow(storage, "wf-1"), match=touches("wf-1"))
    assert _prepare_and_complete(target, ["wf-1", "wf-2"]) == ["not-eligible", "reclaimed"]
    assert reg.list_held_workflow_ids() == ["wf-2"]
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert stored_epoch(storage, "wf-1") == 2  # the takeover committed before the release
    assert drive.calls == ["wf-2"]
    assert claim_attempts(metrics) == {"takeover": 2}


def test_the_won_records_are_rechecked_with_one_read_after_the_commit(
    target: ReclaimTargetHandle,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    _stranded(storage, rival, clock, "wf-1", "wf-2", "wf-3")
    committed: list[int] = []
    gated.before_next_cas(lambda: committed.append(gated.calls["get_many"]))
    plans = target.prepare_workflow_claim_takeovers(["wf-1", "wf-2", "wf-3"])
    # The holders read, the commit, then one read of the three records.
    assert committed == [1]
    assert gated.calls["get_many"] == 2
    assert [gated.reads_of(keys.workflow(w)) for w in ("wf-1", "wf-2", "wf-3")] == [1, 1, 1]
    assert [target.complete_workflow_claim_takeover(p) for p in plans] == ["reclaimed"] * 3
    # Completion drives with the record that read returned: nothing is read again.
    assert gated.calls["get_many"] == 2
    assert drive.calls == ["wf-1", "wf-2", "wf-3"]


def test_the_handler_gets_the_record_the_recheck_read(
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    metrics: ClaimMetrics,
) -> None:
    _stranded(storage, rival, clock, "wf-1")
    seen: list[tuple[str, str, str]] = []

    def drive_record(workflow_id: str, record: Any) -> None:
        seen.append((workflow_id, record.type, record.status))

    target = create_reclaim_target(
        reg, gated, metrics, on_reclaimed=Drive(), drive_record=drive_record
    )
    (plan,) = target.prepare_workflow_claim_takeovers(["wf-1"])
    reads = gated.calls["get_many"]
    assert target.complete_workflow_claim_takeover(plan) == "reclaimed"
    assert seen == [("wf-1", "import", "running")]
    assert gated.calls["get_many"] == reads


def test_a_workflow_that_stopped_running_before_the_recheck_is_released_not_driven(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    _stranded(storage, rival, clock, "wf-1", "wf-2")
    # Completed after the takeover committed, right before the records are read back.
    gated.before_next_read_of(keys.workflow("wf-1"), lambda: complete_workflow(storage, "wf-1"))
    plans = target.prepare_workflow_claim_takeovers(["wf-1", "wf-2"])
    assert reg.current_epoch("wf-1") == 2  # won, then found completed
    assert [target.complete_workflow_claim_takeover(p) for p in plans] == [
        "not-eligible",
        "reclaimed",
    ]
    assert drive.calls == ["wf-2"]
    assert reg.list_held_workflow_ids() == ["wf-2"]
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert stored_epoch(storage, "wf-1") == 2
    assert target.pending_redrive_ids() == []


def test_a_workflow_replaced_between_prepare_and_complete_is_not_driven(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    _stranded(storage, rival, clock, "wf-1")
    (plan,) = target.prepare_workflow_claim_takeovers(["wf-1"])
    assert reg.current_epoch("wf-1") == 2
    # This engine's host finishes the old generation and starts a new one under the id; the
    # host drives the new generation itself.
    complete_workflow(storage, "wf-1")
    assert reg.release("wf-1").status == "released"
    write_workflow(storage, "wf-1")
    assert reg.acquire("wf-1").epoch == 3
    assert target.complete_workflow_claim_takeover(plan) == "not-eligible"
    assert drive.calls == []
    assert reg.current_epoch("wf-1") == 3
    assert holder_engine(storage, "wf-1") == "engine-a"


def test_a_failed_recheck_read_is_made_again_at_completion(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    _stranded(storage, rival, clock, "wf-1", "wf-2")
    gated.fail_next_read_of(keys.workflow("wf-1"), StorageError("read failed"))
    plans = target.prepare_workflow_claim_takeovers(["wf-1", "wf-2"])
    assert sorted(reg.list_held_workflow_ids()) == ["wf-1", "wf-2"]
    assert [target.complete_workflow_claim_takeover(p) for p in plans] == ["reclaimed"] * 2
    assert drive.calls == ["wf-1", "wf-2"]
    # Each record was read twice: by the failed batched read and alone at completion.
    assert [gated.reads_of(keys.workflow(w)) for w in ("wf-1", "wf-2")] == [2, 2]
    assert target.pending_redrive_ids() == []


def test_a_recheck_read_failing_twice_keeps_the_won_claim_for_a_redrive(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    _stranded(storage, rival, clock, "wf-1", "wf-2")
    failure = StorageError("read failed")
    gated.fail_next_read_of(keys.workflow("wf-1"), failure)
    plans = target.prepare_workflow_claim_takeovers(["wf-1", "wf-2"])
    gated.fail_next_read_of(keys.workflow("wf-1"), failure)
    with pytest.raises(StorageError, match="read failed"):
        target.complete_workflow_claim_takeover(plans[0])
    assert target.complete_workflow_claim_takeover(plans[1]) == "reclaimed"
    # Neither driven nor dropped: held at the epoch won, retried as a redrive.
    assert reg.current_epoch("wf-1") == 2
    assert holder_engine(storage, "wf-1") == "engine-a"
    assert target.pending_redrive_ids() == ["wf-1"]
    assert drive.calls == ["wf-2"]
    assert target.attempt_workflow_claim_takeover("wf-1") == "reclaimed"
    assert drive.calls == ["wf-2", "wf-1"]
    assert target.pending_redrive_ids() == []


def test_disposal_between_prepare_and_complete_releases_without_driving(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    _stranded(storage, rival, clock, "wf-1", "wf-2")
    write_workflow(storage, "orphan")
    plans = target.prepare_workflow_claim_takeovers(["wf-1", "wf-2", "orphan"])
    assert sorted(reg.list_held_workflow_ids()) == ["wf-1", "wf-2"]
    target.mark_disposing()
    transactions = gated.transactions
    assert [target.complete_workflow_claim_takeover(p) for p in plans] == ["not-eligible"] * 3
    assert drive.calls == []
    assert reg.list_held_workflow_ids() == []
    for wid in ("wf-1", "wf-2"):
        assert storage.get(keys.workflow_owner_holder(wid)) is None
        assert stored_epoch(storage, wid) == 2
    # Only the two releases wrote; the ownerless orphan was not acquired.
    assert gated.transactions - transactions == 2
    assert storage.get(keys.workflow_owner_epoch("orphan")) is None


def test_a_disposing_target_prepares_nothing(
    target: ReclaimTargetHandle,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
) -> None:
    _stranded(storage, rival, clock, "wf-1")
    target.mark_disposing()
    assert _prepare_and_complete(target, ["wf-1"]) == ["not-eligible"]
    assert gated.total_calls == 0
    assert holder_engine(storage, "wf-1") == "engine-b"


def test_a_failed_drive_keeps_the_claim_and_the_next_pass_redrives_it_once(
    make_target: MakeTarget,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
) -> None:
    _stranded(storage, rival, clock, "wf-1")
    failure = RuntimeError("resume failed")
    drive = Drive(failure)
    target = make_target(on_reclaimed=drive)

    first = run_reclaim_pass(target)
    assert [(o.workflow_id, o.status) for o in first.outcomes] == [("wf-1", "error")]
    assert first.outcomes[0].error is failure
    assert reg.current_epoch("wf-1") == 2
    assert target.pending_redrive_ids() == ["wf-1"]

    transactions = gated.transactions
    second = run_reclaim_pass(target)
    assert [(o.workflow_id, o.status) for o in second.outcomes] == [("wf-1", "reclaimed")]
    assert gated.transactions == transactions
    assert target.pending_redrive_ids() == []

    assert run_reclaim_pass(target).outcomes == ()
    assert drive.calls == ["wf-1", "wf-1"]
    assert reg.current_epoch("wf-1") == 2


def test_a_candidate_this_engine_already_holds_is_not_driven_again(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    drive: Drive,
) -> None:
    write_workflow(storage, "wf-1")
    assert target.list_reclaim_candidate_workflow_ids() == ["wf-1"]
    reg.acquire("wf-1")  # this engine's host claimed it after the listing
    transactions = gated.transactions
    assert _prepare_and_complete(target, ["wf-1"]) == ["not-eligible"]
    assert drive.calls == []
    assert gated.transactions == transactions
    assert reg.current_epoch("wf-1") == 1


def test_an_eligibility_predicate_raising_for_one_candidate_fails_only_that_candidate(
    make_target: MakeTarget,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    error = LookupError("unknown revision format")

    def can_run(wf_type: str, revision: str | None) -> bool:
        if wf_type == "weird":
            raise error
        return True

    write_workflow(storage, "weird", wf_type="weird")
    _stranded(storage, rival, clock, "wf-1")
    target = make_target(is_eligible=can_run)
    result = run_reclaim_pass(target)
    # As with one attempt per candidate: the raising predicate is that candidate's error.
    assert [(o.workflow_id, o.status) for o in result.outcomes] == [
        ("wf-1", "reclaimed"),  # listed first: it has a holder
        ("weird", "error"),
    ]
    assert result.outcomes[1].error is error
    assert drive.calls == ["wf-1"]
    assert reg.list_held_workflow_ids() == ["wf-1"]


def test_a_failed_batched_takeover_falls_back_to_single_attempts(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: Hooked,
    storage: Storage,
    clock: ManualClock,
    metrics: ClaimMetrics,
    drive: Drive,
) -> None:
    _stranded(storage, rival, clock, "wf-1", "wf-2")
    gated.raise_on_next_cas(StorageError("batch failed"), match=lambda batches: len(batches) == 2)
    plans = target.prepare_workflow_claim_takeovers(["wf-1", "wf-2"])
    assert reg.list_held_workflow_ids() == []
    assert holder_engine(storage, "wf-1") == "engine-b"
    assert [target.complete_workflow_claim_takeover(p) for p in plans] == ["reclaimed"] * 2
    assert (gated.calls["conditional_batches"], gated.calls["conditional_batch"]) == (1, 2)
    assert drive.calls == ["wf-1", "wf-2"]
    assert sorted(reg.list_held_workflow_ids()) == ["wf-1", "wf-2"]
    assert claim_attempts(metrics) == {"takeover": 2}


# -- the reclaim pass over a batched target -------------------------------------------------


class ScriptedBatchTarget:
    """A batched reclaim target whose preparation of the chunk holding ``bad`` misbehaves.

    :param failure: ``"raise"`` raises :attr:`error`; ``"short"`` returns one plan too few.
    """

    def __init__(self, ids: Sequence[str], bad: str, failure: str) -> None:
        self.ids = list(ids)
        self.bad = bad
        self.failure = failure
        self.error = RuntimeError("prepare failed")
        # _lock guards prepared and completed.
        self._lock = threading.Lock()
        self.prepared: list[list[str]] = []
        self.completed: list[str] = []

    def list_reclaim_candidate_workflow_ids(self) -> list[str]:
        return list(self.ids)

    def attempt_workflow_claim_takeover(self, workflow_id: str) -> str:
        raise AssertionError("a batched target is attempted through prepare and complete")

    def prepare_workflow_claim_takeovers(self, workflow_ids: Sequence[str]) -> list[object]:
        with self._lock:
            self.prepared.append(list(workflow_ids))
        plans: list[object] = [("plan", wid) for wid in workflow_ids]
        if self.bad in workflow_ids:
            if self.failure == "raise":
                raise self.error
            return plans[:-1]
        return plans

    def complete_workflow_claim_takeover(self, plan: object) -> str:
        assert isinstance(plan, tuple)
        with self._lock:
            self.completed.append(plan[1])
        return "reclaimed"


@pytest.mark.parametrize("failure", ["raise", "short"])
def test_a_chunk_whose_preparation_fails_gives_only_its_ids_error_outcomes(failure: str) -> None:
    ids = [f"wf-{n:04d}" for n in range(2 * RECLAIM_CHUNK_SIZE + 50)]
    bad_chunk = ids[RECLAIM_CHUNK_SIZE : 2 * RECLAIM_CHUNK_SIZE]
    target = ScriptedBatchTarget(ids, bad=bad_chunk[0], failure=failure)
    assert isinstance(target, BatchReclaimTarget)

    result = run_reclaim_pass(target)

    assert sorted(len(chunk) for chunk in target.prepared) == [
        50,
        RECLAIM_CHUNK_SIZE,
        RECLAIM_CHUNK_SIZE,
    ]
    assert [o.workflow_id for o in result.outcomes] == ids
    errors = [o for o in result.outcomes if o.status is ReclaimOutcomeStatus.ERROR]
    assert [o.workflow_id for o in errors] == bad_chunk
    if failure == "raise":
        assert all(o.error is target.error for o in errors)
    else:
        assert all(isinstance(o.error, ValueError) for o in errors)
        assert "199 plans for 200 ids" in str(errors[0].error)
    assert sorted(target.completed) == sorted(set(ids) - set(bad_chunk))
    assert result.reclaimed_count == len(ids) - RECLAIM_CHUNK_SIZE


def test_a_completion_returning_an_unknown_result_is_an_error_naming_the_method() -> None:
    class Garbled(ScriptedBatchTarget):
        def complete_workflow_claim_takeover(self, plan: object) -> str:
            assert isinstance(plan, tuple)
            return "maybe" if plan[1] == "wf-2" else "reclaimed"

    target = Garbled(["wf-1", "wf-2", "wf-3"], bad="none", failure="raise")
    result = run_reclaim_pass(target)
    assert [o.status for o in result.outcomes] == ["reclaimed", "error", "reclaimed"]
    error = result.outcomes[1].error
    assert isinstance(error, ValueError)
    assert "complete_workflow_claim_takeover() returned 'maybe'" in str(error)
    assert result.reclaimed_count == 2


def test_a_prepared_chunk_is_completed_while_later_chunks_are_still_being_prepared() -> None:
    # The last chunk's preparation waits until a completion of the first chunk has run: a pass
    # that completed nothing before every chunk was prepared would never get there.
    ids = [f"wf-{n:04d}" for n in range(2 * RECLAIM_CHUNK_SIZE)]
    first_completed = threading.Event()

    class Pipelined(ScriptedBatchTarget):
        def prepare_workflow_claim_takeovers(self, workflow_ids: Sequence[str]) -> list[object]:
            if workflow_ids[0] != ids[0]:
                assert first_completed.wait(10), "no completion ran before the last preparation"
            return super().prepare_workflow_claim_takeovers(workflow_ids)

        def complete_workflow_claim_takeover(self, plan: object) -> str:
            first_completed.set()
            return super().complete_workflow_claim_takeover(plan)

    target = Pipelined(ids, bad="none", failure="raise")
    result = run_reclaim_pass(target)
    assert [o.status for o in result.outcomes] == [ReclaimOutcomeStatus.RECLAIMED] * len(ids)
    assert sorted(target.completed) == ids
