"""The reclaim target over real stores (spec §5.5, §7.11 items 158-178).

Engine A (the one under test) writes through a :class:`GatedStorage`; competitors write to the
same store directly, so intercepts armed on A's wrapper never touch their writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.claims.gated import (
    PAST_GRACE_MS,
    RENEW_MS,
    START_MS,
    TTL_MS,
    GatedStorage,
    WarningSink,
    Worker,
    new_registry,
    pause_in_cas,
    touches,
)
from tests.maintenance.helpers import claim_attempts, complete_workflow, write_workflow
from tests.support.clocks import SwitchedClock
from tests.support.waiting import wait_set
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import (
    decode_holder,
    encode_epoch,
)
from weft_sync.errors import StorageError
from weft_sync.metrics import ClaimMetrics
from weft_sync.reclaim.target import ReclaimTargetHandle, create_reclaim_target
from weft_sync.storage import Storage


class Drive:
    """An ``on_reclaimed`` callback recording each call and the epoch held while it ran."""

    def __init__(self, registry: ClaimRegistry, *errors: Exception) -> None:
        self._registry = registry
        # _lock guards calls, epochs and _errors.
        self._lock = threading.Lock()
        self._errors = list(errors)
        self.calls: list[str] = []
        self.epochs: list[int | None] = []

    def __call__(self, workflow_id: str) -> None:
        epoch = self._registry.current_epoch(workflow_id)
        with self._lock:
            self.calls.append(workflow_id)
            self.epochs.append(epoch)
            error = self._errors.pop(0) if self._errors else None
        if error is not None:
            raise error


class ReadHookStorage(GatedStorage):
    """A gated store that can also run a callback right after one read of a given key.

    The read returns the value seen *before* the callback ran: the caller acts on a stale
    answer, as if it had been paused between the read and its next step.
    """

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        # _hooks_lock guards _hooks.
        self._hooks_lock = threading.Lock()
        self._hooks: dict[str, Callable[[], object]] = {}

    def after_next_get(self, key: str, callback: Callable[[], object]) -> None:
        with self._hooks_lock:
            self._hooks[key] = callback

    def get(self, key: str) -> bytes | None:
        value = super().get(key)
        with self._hooks_lock:
            hook = self._hooks.pop(key, None)
        if hook is not None:
            hook()
        return value


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def gated(storage: Storage) -> ReadHookStorage:
    return ReadHookStorage(storage)


@pytest.fixture
def sink() -> WarningSink:
    return WarningSink()


@pytest.fixture
def reg(gated: ReadHookStorage, clock: ManualClock, sink: WarningSink) -> ClaimRegistry:
    """Engine A's registry, writing through the gated store."""
    return new_registry(gated, clock, "engine-a", sink)


@pytest.fixture
def rival(storage: Storage, clock: ManualClock, sink: WarningSink) -> ClaimRegistry:
    """Engine B's registry, writing to the store directly."""
    return new_registry(storage, clock, "engine-b", sink)


@pytest.fixture
def metrics() -> ClaimMetrics:
    return ClaimMetrics()


@pytest.fixture
def drive(reg: ClaimRegistry) -> Drive:
    return Drive(reg)


MakeTarget = Callable[..., ReclaimTargetHandle]


@pytest.fixture
def make_target(
    reg: ClaimRegistry, gated: ReadHookStorage, metrics: ClaimMetrics, drive: Drive
) -> MakeTarget:
    def make(**kwargs: Any) -> ReclaimTargetHandle:
        kwargs.setdefault("on_reclaimed", drive)
        return create_reclaim_target(reg, gated, metrics, **kwargs)

    return make


@pytest.fixture
def target(make_target: MakeTarget) -> ReclaimTargetHandle:
    return make_target()


def _failed_first_drive(
    make_target: MakeTarget, reg: ClaimRegistry, message: str = "resume failed"
) -> tuple[ReclaimTargetHandle, Drive]:
    """A target whose first drive of ``wf-1`` raised: the claim is held and a redrive is due.

    The attempt re-raises the very ``RuntimeError(message)`` the drive raised.
    """
    failure = RuntimeError(message)
    drive = Drive(reg, failure)
    target = make_target(on_reclaimed=drive)
    with pytest.raises(RuntimeError) as caught:
        target.attempt_workflow_claim_takeover("wf-1")
    assert caught.value is failure
    return target, drive


def _after_workflow_read(
    gated: ReadHookStorage, callback: Callable[[], object], *, after_claim: bool
) -> None:
    """Run ``callback`` right after the next read of ``wf-1``'s record.

    :param after_claim: count only reads after ``wf-1``'s claim CAS (the hook is armed from that
        CAS, so no earlier read trips it).
    """
    if after_claim:
        gated.before_next_cas(
            lambda: gated.after_next_get(keys.workflow("wf-1"), callback), match=touches("wf-1")
        )
    else:
        gated.after_next_get(keys.workflow("wf-1"), callback)


# -- candidates -----------------------------------------------------------------------------


def test_candidates_exclude_claims_this_engine_holds(
    target: ReclaimTargetHandle, reg: ClaimRegistry, rival: ClaimRegistry
) -> None:
    reg.acquire("mine")
    rival.acquire("theirs")
    assert target.list_reclaim_candidate_workflow_ids() == ["theirs"]


def test_id_both_discovered_and_pending_redrive_is_listed_once(
    make_target: MakeTarget,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    storage: Storage,
    clock: ManualClock,
) -> None:
    write_workflow(storage, "wf-1")
    target, _ = _failed_first_drive(make_target, reg, "drive failed")
    clock.advance(PAST_GRACE_MS)
    assert rival.takeover("wf-1").status == "acquired"
    assert reg.renew("wf-1").status == "lost"
    # Now a foreign holder (discovered) and still pending a redrive here.
    assert target.pending_redrive_ids() == ["wf-1"]
    assert target.list_reclaim_candidate_workflow_ids() == ["wf-1"]


# -- ownerless acquire ----------------------------------------------------------------------


def test_ownerless_running_workflow_is_acquired_at_epoch_1_and_driven_once(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    storage: Storage,
    metrics: ClaimMetrics,
    drive: Drive,
) -> None:
    write_workflow(storage, "orphan")
    assert target.list_reclaim_candidate_workflow_ids() == ["orphan"]
    assert target.attempt_workflow_claim_takeover("orphan") == "reclaimed"
    assert drive.calls == ["orphan"]
    assert drive.epochs == [1]  # the claim is held while the drive runs
    assert reg.current_epoch("orphan") == 1
    assert stored_epoch(storage, "orphan") == 1
    assert holder_engine(storage, "orphan") == "engine-a"
    assert claim_attempts(metrics) == {"acquired": 1}
    assert target.list_reclaim_candidate_workflow_ids() == []


def test_competitor_acquiring_just_before_our_acquire_commits_wins(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    metrics: ClaimMetrics,
    drive: Drive,
) -> None:
    write_workflow(storage, "orphan")
    gated.before_next_cas(lambda: rival.acquire("orphan"), match=touches("orphan"))
    # The retry's takeover sees the competitor's live holder and stops.
    assert target.attempt_workflow_claim_takeover("orphan") == "not-eligible"
    assert claim_attempts(metrics) == {"lost_race": 1}
    assert reg.list_held_workflow_ids() == []
    assert drive.calls == []
    assert holder_engine(storage, "orphan") == "engine-b"


def test_never_claimed_workflow_without_a_record_is_not_eligible(
    target: ReclaimTargetHandle, gated: ReadHookStorage, reg: ClaimRegistry
) -> None:
    assert target.attempt_workflow_claim_takeover("ghost") == "not-eligible"
    assert gated.transactions == 0
    assert reg.list_held_workflow_ids() == []


def test_unclaimed_completed_workflow_is_not_eligible_and_gets_no_holder(
    target: ReclaimTargetHandle, gated: ReadHookStorage, storage: Storage
) -> None:
    write_workflow(storage, "done", "completed")
    assert target.attempt_workflow_claim_takeover("done") == "not-eligible"
    assert gated.transactions == 0
    assert storage.get(keys.workflow_owner_holder("done")) is None
    assert storage.get(keys.workflow_owner_epoch("done")) is None


@pytest.mark.parametrize("claimed", [False, True], ids=["ownerless", "expired-holder"])
def test_undecodable_workflow_record_is_not_eligible_and_nothing_stays_tracked(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
    claimed: bool,
) -> None:
    storage.put(keys.workflow("wf-1"), b"\xc1 not msgpack")
    storage.put(keys.workflow_status_index("running", "wf-1"), b"")
    if claimed:
        rival.acquire("wf-1")
        clock.advance(PAST_GRACE_MS)
    assert target.attempt_workflow_claim_takeover("wf-1") == "not-eligible"
    assert reg.list_held_workflow_ids() == []
    assert drive.calls == []
    # A takeover that committed is released again; the epoch it minted stays.
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert stored_epoch(storage, "wf-1") == (2 if claimed else None)


# -- takeover -------------------------------------------------------------------------------


def test_expired_foreign_holder_is_taken_over_tracked_and_driven(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    storage: Storage,
    clock: ManualClock,
    metrics: ClaimMetrics,
    drive: Drive,
) -> None:
    write_workflow(storage, "wf-1")
    rival.acquire("wf-1")
    clock.advance(PAST_GRACE_MS)
    assert target.attempt_workflow_claim_takeover("wf-1") == "reclaimed"
    assert reg.current_epoch("wf-1") == 2
    assert holder_engine(storage, "wf-1") == "engine-a"
    assert drive.calls == ["wf-1"]
    assert drive.epochs == [2]
    assert claim_attempts(metrics) == {"takeover": 1}


def test_live_foreign_holder_is_not_eligible_without_any_cas(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    clock: ManualClock,
    metrics: ClaimMetrics,
) -> None:
    write_workflow(storage, "wf-1")
    rival.acquire("wf-1")
    clock.advance(TTL_MS + 2 * RENEW_MS)  # exactly at the deadline: still live
    assert target.attempt_workflow_claim_takeover("wf-1") == "not-eligible"
    assert gated.transactions == 0
    assert reg.list_held_workflow_ids() == []
    assert claim_attempts(metrics) == {}


@pytest.mark.parametrize(
    ("failures", "expected"), [(4, "reclaimed"), (5, "lost-race")], ids=["4-lost", "5-lost"]
)
def test_takeover_gives_up_after_five_lost_races(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    clock: ManualClock,
    metrics: ClaimMetrics,
    drive: Drive,
    failures: int,
    expected: str,
) -> None:
    write_workflow(storage, "wf-1")
    rival.acquire("wf-1")
    clock.advance(PAST_GRACE_MS)
    for _ in range(failures):
        gated.force_next_cas(False, match=touches("wf-1"))
    assert target.attempt_workflow_claim_takeover("wf-1") == expected
    assert gated.transactions == min(failures + 1, 5)
    assert metrics.snapshot().attempts["lost_race"] == failures
    if expected == "reclaimed":
        assert reg.current_epoch("wf-1") == 2
        assert drive.calls == ["wf-1"]
    else:
        assert reg.list_held_workflow_ids() == []
        assert drive.calls == []
        assert holder_engine(storage, "wf-1") == "engine-b"


def test_attempt_during_this_engines_cooldown_is_backoff_skipped(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    clock: ManualClock,
    metrics: ClaimMetrics,
    sink: WarningSink,
) -> None:
    write_workflow(storage, "wf-1")
    reg.acquire("wf-1")
    clock.advance(PAST_GRACE_MS)
    assert rival.takeover("wf-1").status == "acquired"
    clock.advance(PAST_GRACE_MS)  # the rival's claim is stealable too, but we were just deposed
    assert reg.renew("wf-1").status == "lost"
    assert sink.lost_ids() == ["wf-1"]
    transactions = gated.transactions
    assert target.attempt_workflow_claim_takeover("wf-1") == "backoff-skipped"
    assert gated.transactions == transactions
    assert claim_attempts(metrics) == {"backoff_skipped": 1}
    clock.advance(RENEW_MS)  # cooldown over
    assert target.attempt_workflow_claim_takeover("wf-1") == "reclaimed"


# -- eligibility ----------------------------------------------------------------------------


def test_ineligible_workflow_type_is_never_claimed(
    make_target: MakeTarget, gated: ReadHookStorage, storage: Storage, drive: Drive
) -> None:
    seen: list[tuple[str, str | None]] = []

    def can_run(wf_type: str, revision: str | None) -> bool:
        seen.append((wf_type, revision))
        return wf_type == "import"

    write_workflow(storage, "other", wf_type="export")
    target = make_target(is_eligible=can_run)
    assert target.attempt_workflow_claim_takeover("other") == "not-eligible"
    assert seen == [("export", None)]
    assert gated.transactions == 0
    assert drive.calls == []


def test_eligibility_is_checked_again_after_the_cas(
    make_target: MakeTarget,
    reg: ClaimRegistry,
    storage: Storage,
    metrics: ClaimMetrics,
    drive: Drive,
) -> None:
    answers = iter([True, False])
    write_workflow(storage, "wf-1")
    target = make_target(is_eligible=lambda _type, _revision: next(answers))
    assert target.attempt_workflow_claim_takeover("wf-1") == "not-eligible"
    assert claim_attempts(metrics) == {"acquired": 1}
    assert reg.list_held_workflow_ids() == []
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert drive.calls == []


# -- drives and redrives --------------------------------------------------------------------


def test_failed_drive_keeps_the_claim_and_is_redriven_without_a_cas(
    make_target: MakeTarget, reg: ClaimRegistry, gated: ReadHookStorage, storage: Storage
) -> None:
    write_workflow(storage, "wf-1")
    target, drive = _failed_first_drive(make_target, reg)
    assert reg.current_epoch("wf-1") == 1
    assert holder_engine(storage, "wf-1") == "engine-a"
    assert target.list_reclaim_candidate_workflow_ids() == ["wf-1"]
    transactions = gated.transactions
    assert target.attempt_workflow_claim_takeover("wf-1") == "reclaimed"
    assert gated.transactions == transactions
    assert drive.calls == ["wf-1", "wf-1"]
    assert drive.epochs == [1, 1]
    assert target.list_reclaim_candidate_workflow_ids() == []


def test_pending_redrive_of_a_completed_workflow_releases_the_claim(
    make_target: MakeTarget, reg: ClaimRegistry, storage: Storage
) -> None:
    write_workflow(storage, "wf-1")
    target, drive = _failed_first_drive(make_target, reg)
    complete_workflow(storage, "wf-1")
    assert target.attempt_workflow_claim_takeover("wf-1") == "not-eligible"
    assert drive.calls == ["wf-1"]
    assert reg.list_held_workflow_ids() == []
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert stored_epoch(storage, "wf-1") == 1
    assert target.list_reclaim_candidate_workflow_ids() == []


def test_pending_redrive_of_a_lost_claim_takes_the_takeover_path(
    make_target: MakeTarget,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    storage: Storage,
    clock: ManualClock,
    metrics: ClaimMetrics,
) -> None:
    write_workflow(storage, "wf-1")
    target, drive = _failed_first_drive(make_target, reg)
    clock.advance(PAST_GRACE_MS)
    assert rival.takeover("wf-1").status == "acquired"
    clock.advance(PAST_GRACE_MS)
    assert reg.renew("wf-1").status == "lost"
    # Not a forced redrive: the takeover path applies this engine's cooldown.
    assert target.attempt_workflow_claim_takeover("wf-1") == "backoff-skipped"
    assert drive.calls == ["wf-1"]
    assert target.pending_redrive_ids() == []
    assert holder_engine(storage, "wf-1") == "engine-b"
    assert metrics.snapshot().attempts["backoff_skipped"] == 1


def test_claim_this_engine_holds_without_a_failed_drive_is_not_driven_again(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    drive: Drive,
) -> None:
    # Listed as ownerless, then acquired by this engine's own host before the attempt ran:
    # whoever acquired it drives it.
    write_workflow(storage, "wf-1")
    assert target.list_reclaim_candidate_workflow_ids() == ["wf-1"]
    reg.acquire("wf-1")
    transactions = gated.transactions
    assert target.attempt_workflow_claim_takeover("wf-1") == "not-eligible"
    assert drive.calls == []
    assert gated.transactions == transactions
    assert reg.current_epoch("wf-1") == 1


def test_concurrent_attempts_on_one_candidate_drive_it_once(
    target: ReclaimTargetHandle, reg: ClaimRegistry, storage: Storage, drive: Drive
) -> None:
    write_workflow(storage, "wf-1")
    barrier = threading.Barrier(2)

    def attempt() -> str:
        barrier.wait(10)
        return target.attempt_workflow_claim_takeover("wf-1")

    workers = [Worker(attempt, f"attempt-{n}") for n in range(2)]
    results = sorted(w.result() for w in workers)
    assert results == ["not-eligible", "reclaimed"]
    assert drive.calls == ["wf-1"]
    assert reg.current_epoch("wf-1") == 1


def test_redrive_in_progress_is_not_started_again_by_another_attempt(
    make_target: MakeTarget, storage: Storage
) -> None:
    write_workflow(storage, "wf-1")
    calls: list[str] = []
    entered, proceed = threading.Event(), threading.Event()

    def drive(workflow_id: str) -> None:
        calls.append(workflow_id)
        if len(calls) == 1:
            raise RuntimeError("resume failed")
        entered.set()
        wait_set(proceed, "the test to let the redrive finish")

    target = make_target(on_reclaimed=drive)
    with pytest.raises(RuntimeError):
        target.attempt_workflow_claim_takeover("wf-1")
    worker = Worker(lambda: target.attempt_workflow_claim_takeover("wf-1"), "redrive")
    wait_set(entered, "the redrive")
    assert target.attempt_workflow_claim_takeover("wf-1") == "not-eligible"
    proceed.set()
    assert worker.result() == "reclaimed"
    assert calls == ["wf-1", "wf-1"]


@pytest.mark.parametrize("path", ["redrive", "takeover"])
def test_terminal_read_racing_a_start_new_leaves_the_replacement_claim_alone(
    make_target: MakeTarget,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    clock: ManualClock,
    path: str,
) -> None:
    write_workflow(storage, "wf-1")
    if path == "redrive":
        target, drive = _failed_first_drive(make_target, reg)
        old_epoch = 1
    else:
        drive = Drive(reg)
        target = make_target(on_reclaimed=drive)
        rival.acquire("wf-1")
        clock.advance(PAST_GRACE_MS)
        old_epoch = 2
    complete_workflow(storage, "wf-1")
    replacement: list[int | None] = []

    def start_new() -> None:
        # The same engine finishes the old generation and starts a new one under the same id.
        if path == "takeover":
            assert reg.current_epoch("wf-1") == old_epoch
        reg.release("wf-1")
        write_workflow(storage, "wf-1")
        replacement.append(reg.acquire("wf-1").epoch)

    # Run start_new right after the read that judges the old generation: the redrive's running
    # check, or the takeover's post-CAS check.
    _after_workflow_read(gated, start_new, after_claim=path == "takeover")
    assert target.attempt_workflow_claim_takeover("wf-1") == "not-eligible"
    assert replacement == [old_epoch + 1]
    assert reg.current_epoch("wf-1") == old_epoch + 1
    assert stored_epoch(storage, "wf-1") == old_epoch + 1
    holder = decode_holder(storage.get(keys.workflow_owner_holder("wf-1")))
    assert holder is not None
    assert (holder.engine_id, holder.epoch) == ("engine-a", old_epoch + 1)
    assert drive.calls == (["wf-1"] if path == "redrive" else [])


# -- disposal -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["takeover", "ownerless-acquire"])
def test_disposal_during_the_claim_cas_releases_instead_of_driving(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
    path: str,
) -> None:
    write_workflow(storage, "wf-1")
    if path == "takeover":
        rival.acquire("wf-1")
        clock.advance(PAST_GRACE_MS)
    gate, worker = pause_in_cas(
        gated, "wf-1", lambda: target.attempt_workflow_claim_takeover("wf-1"), "reclaim-attempt"
    )
    target.mark_disposing()
    gate.open()
    assert worker.result() == "not-eligible"
    assert drive.calls == []
    assert reg.list_held_workflow_ids() == []
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    # The claim did commit (a new epoch was minted) before it was released.
    assert stored_epoch(storage, "wf-1") == (2 if path == "takeover" else 1)


def test_disposing_target_lists_nothing_and_claims_nothing(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    write_workflow(storage, "orphan")
    write_workflow(storage, "stranded")
    rival.acquire("stranded")
    clock.advance(PAST_GRACE_MS)
    target.mark_disposing()
    target.mark_disposing()
    assert target.disposing
    assert target.list_reclaim_candidate_workflow_ids() == []
    assert target.attempt_workflow_claim_takeover("orphan") == "not-eligible"
    assert target.attempt_workflow_claim_takeover("stranded") == "not-eligible"
    assert gated.transactions == 0
    assert reg.list_held_workflow_ids() == []
    assert drive.calls == []


def test_disposal_during_a_pending_redrive_does_not_drive(
    make_target: MakeTarget, reg: ClaimRegistry, storage: Storage
) -> None:
    write_workflow(storage, "wf-1")
    target, drive = _failed_first_drive(make_target, reg)
    target.mark_disposing()
    assert target.attempt_workflow_claim_takeover("wf-1") == "not-eligible"
    assert drive.calls == ["wf-1"]
    # The claim stays for the host's own shutdown (release_all) to give up.
    assert reg.current_epoch("wf-1") == 1


def _fail_read() -> None:
    raise StorageError("read failed")


@pytest.mark.parametrize("path", ["after-claim", "redrive"])
def test_failed_workflow_read_keeps_a_held_claim_for_a_redrive(
    make_target: MakeTarget,
    reg: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    path: str,
) -> None:
    write_workflow(storage, "wf-1")
    if path == "redrive":
        target, drive = _failed_first_drive(make_target, reg)
    else:
        drive = Drive(reg)
        target = make_target(on_reclaimed=drive)
    # Fail the redrive's running check, or the read that confirms the workflow after the
    # acquire committed.
    _after_workflow_read(gated, _fail_read, after_claim=path == "after-claim")
    with pytest.raises(StorageError, match="read failed"):
        target.attempt_workflow_claim_takeover("wf-1")
    assert reg.current_epoch("wf-1") == 1
    assert target.pending_redrive_ids() == ["wf-1"]
    assert target.list_reclaim_candidate_workflow_ids() == ["wf-1"]
    assert target.attempt_workflow_claim_takeover("wf-1") == "reclaimed"
    assert drive.calls == (["wf-1", "wf-1"] if path == "redrive" else ["wf-1"])
    assert target.pending_redrive_ids() == []


def test_skipping_live_holders_leaves_them_out_until_they_expire(
    make_target: MakeTarget,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    clock: ManualClock,
) -> None:
    write_workflow(storage, "wf-live")
    write_workflow(storage, "wf-garbage")
    rival.acquire("wf-live")
    storage.put(keys.workflow_owner_holder("wf-garbage"), b"\xc1 not a holder")
    storage.put(keys.workflow_owner_epoch("wf-garbage"), encode_epoch(3))
    skipping = make_target(skip_live_holders=True)
    # An undecodable holder is never live; a decodable unexpired one is left out.
    assert skipping.list_reclaim_candidate_workflow_ids() == ["wf-garbage"]
    assert make_target().list_reclaim_candidate_workflow_ids() == ["wf-garbage", "wf-live"]
    clock.advance(TTL_MS + 2 * RENEW_MS)  # exactly at the deadline: still live
    assert skipping.list_reclaim_candidate_workflow_ids() == ["wf-garbage"]
    clock.advance(1)
    assert skipping.list_reclaim_candidate_workflow_ids() == ["wf-garbage", "wf-live"]


@pytest.mark.parametrize("path", ["single", "batched"])
def test_a_clock_error_after_a_takeover_keeps_the_claim_for_a_redrive(
    gated: ReadHookStorage,
    storage: Storage,
    clock: ManualClock,
    rival: ClaimRegistry,
    metrics: ClaimMetrics,
    sink: WarningSink,
    path: str,
) -> None:
    switched = SwitchedClock(clock)
    reg = new_registry(gated, switched, "engine-a", sink)
    drive = Drive(reg)
    target = create_reclaim_target(reg, gated, metrics, on_reclaimed=drive)
    write_workflow(storage, "wf-1")
    assert rival.acquire("wf-1").status == "acquired"
    clock.advance(PAST_GRACE_MS)
    failure = RuntimeError("the host clock failed")
    if path == "single":
        # From just before the takeover's commit: the takeover keeps its claim as written,
        # and the target's reading of the takeover delay raises.
        gated.before_next_cas(lambda: switched.fail_with(failure), match=touches("wf-1"))
        with pytest.raises(RuntimeError) as caught:
            target.attempt_workflow_claim_takeover("wf-1")
    else:
        (plan,) = target.prepare_workflow_claim_takeovers(["wf-1"])
        switched.fail_with(failure)
        with pytest.raises(RuntimeError) as caught:
            target.complete_workflow_claim_takeover(plan)
    assert caught.value is failure
    assert reg.current_epoch("wf-1") == 2
    assert drive.calls == []
    assert target.pending_redrive_ids() == ["wf-1"]
    switched.fail_with(None)
    assert target.list_reclaim_candidate_workflow_ids() == ["wf-1"]
    assert target.attempt_workflow_claim_takeover("wf-1") == "reclaimed"
    assert drive.calls == ["wf-1"]
    assert drive.epochs == [2]


class HostExit(SystemExit):
    """What host code behind the store raises (a subclass, so nothing else is mistaken for it)."""


def _exit_in_read() -> None:
    raise HostExit(3)


def test_an_exit_in_the_batched_re_check_read_keeps_the_won_claims_for_a_redrive(
    target: ReclaimTargetHandle,
    reg: ClaimRegistry,
    rival: ClaimRegistry,
    gated: ReadHookStorage,
    storage: Storage,
    clock: ManualClock,
    drive: Drive,
) -> None:
    write_workflow(storage, "wf-1")
    assert rival.acquire("wf-1").status == "acquired"
    clock.advance(PAST_GRACE_MS)
    # The re-check read of the claims the batched takeover won raises, so no plan comes back.
    _after_workflow_read(gated, _exit_in_read, after_claim=True)
    with pytest.raises(HostExit):
        target.prepare_workflow_claim_takeovers(["wf-1"])
    assert reg.current_epoch("wf-1") == 2
    assert target.pending_redrive_ids() == ["wf-1"]
    assert target.attempt_workflow_claim_takeover("wf-1") == "reclaimed"
    assert drive.calls == ["wf-1"]
    assert drive.epochs == [2]
