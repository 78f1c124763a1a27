"""``Ownership.claim()``: acquire and release, unavailable claims, and claims lost inside the block.

A claim is lost here the way it is in production: the owner's clock passes the TTL and grace,
another engine's maintenance pass takes it over, and the owner's next renewal reports it lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.claims.gated import GatedStorage, WarningSink, Worker, touches, watch_log
from tests.workflows.helpers import holder_engine
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.codec import WorkflowRecord, decode_epoch, decode_holder, encode_workflow_record
from weft_sync.errors import (
    EngineDeposedError,
    StorageError,
    WorkflowClaimLostError,
    WorkflowClaimLostWarning,
    WorkflowClaimUnavailableError,
)
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.claim_handle import ClaimHandle
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Storage

TTL_MS = 3_000
RENEW_MS = 1_000
START_MS = 1_000_000
PAST_GRACE_MS = TTL_MS + 2 * RENEW_MS + 1
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
WAIT_S = 10.0

MakeOwnership = Callable[..., Ownership]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def make_ownership(storage: Storage, clock: ManualClock) -> Iterator[MakeOwnership]:
    """Open manual-maintenance Ownerships on one shared store; all closed afterwards."""
    opened: list[Ownership] = []

    def make(engine_id: str, **kwargs: Any) -> Ownership:
        kwargs.setdefault("options", OPTIONS)
        kwargs.setdefault("clock", clock)
        kwargs.setdefault("background", "manual")
        kwargs.setdefault("warn", WarningSink())
        # Every engine here may take over the "job" workflows the tests leave running.
        kwargs.setdefault("is_eligible", lambda workflow_type, revision: True)
        ownership = Ownership.open(kwargs.pop("target", storage), engine_id=engine_id, **kwargs)
        opened.append(ownership)
        return ownership

    yield make
    for ownership in opened:
        ownership.close()


def _write_running(storage: Storage, workflow_id: str) -> None:
    record = WorkflowRecord(workflow_id, "job", "running")
    storage.put(keys.workflow(workflow_id), encode_workflow_record(record))
    storage.put(keys.workflow_status_index("running", workflow_id), b"")


def _take_over(thief: Ownership, clock: ManualClock, workflow_id: str) -> None:
    """Let the claim expire, then have ``thief``'s maintenance pass reclaim it."""
    clock.advance(PAST_GRACE_MS)
    result = thief.run_maintenance()
    assert result.reclaim is not None and result.reclaim.reclaimed_count == 1
    assert thief.registry.current_epoch(workflow_id) is not None


class LostLog:
    """An ``on_lost`` callback recording ids (thread-safe)."""

    def __init__(self) -> None:
        # _lock guards ids.
        self._lock = threading.Lock()
        self.ids: list[str] = []

    def __call__(self, workflow_id: str) -> None:
        with self._lock:
            self.ids.append(workflow_id)


# -- acquire and release -------------------------------------------------------------------------


def test_claim_holds_the_workflow_inside_the_block_and_releases_it_on_exit(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    ownership = make_ownership("engine-a")
    with ownership.claim("wf-1") as handle:
        assert (handle.workflow_id, handle.epoch) == ("wf-1", 1)
        assert not handle.lost.is_set()
        handle.assert_held()
        assert ownership.registry.current_epoch("wf-1") == 1
        assert holder_engine(storage, "wf-1") == "engine-a"
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert decode_epoch(storage.get(keys.workflow_owner_epoch("wf-1"))) == 1
    assert ownership.registry.list_held_workflow_ids() == []
    assert not handle.lost.is_set()
    assert ownership.metrics.snapshot().attempts["acquired"] == 1


def test_assert_held_raises_after_the_block_has_exited(make_ownership: MakeOwnership) -> None:
    with make_ownership("engine-a").claim("wf-1") as handle:
        pass
    with pytest.raises(WorkflowClaimLostError):
        handle.assert_held()


def test_claim_held_by_another_engine_raises_unavailable_naming_the_holder(
    make_ownership: MakeOwnership,
) -> None:
    owner = make_ownership("engine-a")
    other = make_ownership("engine-b")
    with (
        owner.claim("wf-1"),
        pytest.raises(WorkflowClaimUnavailableError) as caught,
        other.claim("wf-1"),
    ):
        pytest.fail("the block must not run")
    assert (caught.value.workflow_id, caught.value.held_by) == ("wf-1", "engine-a")
    assert other.metrics.snapshot().attempts["lost_race"] == 1


def test_claiming_an_id_this_ownership_already_claims_raises_unavailable(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership("engine-a")
    with ownership.claim("wf-1") as handle:
        with pytest.raises(WorkflowClaimUnavailableError) as caught, ownership.claim("wf-1"):
            pytest.fail("the block must not run")
        assert caught.value.held_by == "engine-a"
        handle.assert_held()


def test_one_claim_block_entered_twice_refuses_the_second_entry_and_keeps_the_first_claim(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    ownership = make_ownership("engine-a")
    block = ownership.claim("wf-1")
    with block as handle:
        with pytest.raises(RuntimeError, match=r"'wf-1' was entered twice"):
            block.__enter__()
        handle.assert_held()
        assert holder_engine(storage, "wf-1") == "engine-a"
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert ownership.registry.list_held_workflow_ids() == []


def test_claim_checks_its_wait_when_the_block_is_entered(make_ownership: MakeOwnership) -> None:
    ownership = make_ownership("engine-a")
    block = ownership.claim("wf-1", wait=-1)  # nothing happens until the with statement
    with pytest.raises(ValueError, match=r"wait must be a finite number of seconds >= 0"):
        block.__enter__()
    assert ownership.registry.list_held_workflow_ids() == []


def test_nested_claims_of_different_ids_are_held_together_and_both_released(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    ownership = make_ownership("engine-a")
    with ownership.claim("wf-1") as outer, ownership.claim("wf-2") as inner:
        assert sorted(ownership.registry.list_held_workflow_ids()) == ["wf-1", "wf-2"]
        outer.assert_held()
        inner.assert_held()
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert storage.get(keys.workflow_owner_holder("wf-2")) is None


def test_claim_rejects_an_invalid_workflow_id(make_ownership: MakeOwnership) -> None:
    with pytest.raises(ValueError, match="non-empty"), make_ownership("engine-a").claim(""):
        pytest.fail("the block must not run")


# -- lost inside the block -----------------------------------------------------------------------


def test_claim_lost_inside_the_block_sets_lost_runs_callbacks_and_raises_on_exit(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    warnings_seen = WarningSink()
    owner = make_ownership("engine-a", warn=warnings_seen)
    thief = make_ownership("engine-b")
    lost = owner.on_lost(LostLog())
    assert isinstance(lost, LostLog)
    _write_running(storage, "wf-1")

    with pytest.raises(WorkflowClaimLostError) as caught, owner.claim("wf-1") as handle:
        _take_over(thief, clock, "wf-1")
        result = owner.run_maintenance()
        assert result.failed_count == 1
        assert handle.lost.is_set()
        with pytest.raises(WorkflowClaimLostError):
            handle.assert_held()

    assert caught.value.workflow_id == "wf-1"
    assert lost.ids == ["wf-1"]
    assert warnings_seen.lost_ids() == ["wf-1"]
    holder = decode_holder(storage.get(keys.workflow_owner_holder("wf-1")))
    assert holder is not None and (holder.engine_id, holder.epoch) == ("engine-b", 2)


def test_lost_claim_warning_goes_to_warnings_warn_by_default(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    owner = make_ownership("engine-a", warn=None)
    thief = make_ownership("engine-b")
    _write_running(storage, "wf-1")
    with pytest.raises(WorkflowClaimLostError), owner.claim("wf-1") as handle:
        _take_over(thief, clock, "wf-1")
        with pytest.warns(WorkflowClaimLostWarning, match="wf-1"):
            owner.run_maintenance()
        assert handle.lost.is_set()


def test_an_exception_from_the_block_wins_over_a_lost_claim(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    owner = make_ownership("engine-a")
    thief = make_ownership("engine-b")
    _write_running(storage, "wf-1")
    with pytest.raises(KeyError, match="from the body"), owner.claim("wf-1") as handle:
        _take_over(thief, clock, "wf-1")
        owner.run_maintenance()
        raise KeyError("from the body")
    assert handle.lost.is_set()
    assert holder_engine(storage, "wf-1") == "engine-b"


def test_release_finding_the_claim_replaced_marks_it_lost_and_raises_on_exit(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    owner = make_ownership("engine-a")
    thief = make_ownership("engine-b")
    lost = owner.on_lost(LostLog())
    _write_running(storage, "wf-1")
    with pytest.raises(WorkflowClaimLostError), owner.claim("wf-1") as handle:
        # No renewal runs on the owner, so only its release can notice the takeover.
        _take_over(thief, clock, "wf-1")
        handle.assert_held()
    assert handle.lost.is_set()
    assert lost.ids == ["wf-1"]
    assert holder_engine(storage, "wf-1") == "engine-b"


def test_a_fenced_write_after_an_unnoticed_takeover_marks_the_claim_lost(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    owner = make_ownership("engine-a")
    thief = make_ownership("engine-b")
    lost = owner.on_lost(LostLog())
    _write_running(storage, "wf-1")
    with pytest.raises(WorkflowClaimLostError), owner.claim("wf-1") as handle:
        _take_over(thief, clock, "wf-1")
        # No renewal ran on the owner: its registry still tracks the old epoch.
        assert owner.registry.current_epoch("wf-1") == handle.epoch
        with pytest.raises(EngineDeposedError):
            owner.workflows.save_checkpoint("wf-1", b"step-2")
        assert handle.lost.is_set()
    assert lost.ids == ["wf-1"]
    assert storage.get(keys.workflow("wf-1") + ":ckpt") is None


def test_assert_held_marks_lost_when_the_registry_no_longer_holds_the_epoch(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership("engine-a")
    with pytest.raises(WorkflowClaimLostError), ownership.claim("wf-1") as handle:
        ownership.registry.forget_local_claim("wf-1")
        with pytest.raises(WorkflowClaimLostError):
            handle.assert_held()
        assert handle.lost.is_set()


def test_a_raising_on_lost_callback_is_logged_and_the_others_still_run(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    owner = make_ownership("engine-a")
    thief = make_ownership("engine-b")

    def broken(workflow_id: str) -> None:
        raise RuntimeError(f"callback failed for {workflow_id}")

    owner.on_lost(broken)
    lost = owner.on_lost(LostLog())
    _write_running(storage, "wf-1")
    with (
        watch_log("weft_sync.ownership.facade") as log,
        pytest.raises(WorkflowClaimLostError),
        owner.claim("wf-1"),
    ):
        _take_over(thief, clock, "wf-1")
        result = owner.run_maintenance()
    assert result.failed_count == 1
    assert lost.ids == ["wf-1"]
    assert any("on_lost callback" in m for m in log.messages(logging.ERROR))


def test_on_lost_rejects_a_non_callable(make_ownership: MakeOwnership) -> None:
    with pytest.raises(TypeError, match="callable"):
        make_ownership("engine-a").on_lost("print")  # type: ignore[type-var]


def test_interval_renewal_reports_the_loss_on_its_own_thread(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    owner = make_ownership("engine-a", options=OwnershipOptions(300, 100))
    thief = make_ownership("engine-b")
    reported = threading.Event()
    threads: list[str] = []

    def on_lost(workflow_id: str) -> None:
        threads.append(threading.current_thread().name)
        reported.set()

    owner.on_lost(on_lost)
    _write_running(storage, "wf-1")
    with pytest.raises(WorkflowClaimLostError), owner.claim("wf-1") as handle:
        # Interval mode starts after the takeover, so no renewal can race it.
        _take_over(thief, clock, "wf-1")
        owner.start()
        assert handle.lost.wait(WAIT_S), "the interval renewal never reported the loss"
        assert reported.wait(WAIT_S)
    assert threads and threads[0].startswith("weft-maintenance")


# -- release failures and close ------------------------------------------------------------------


def test_a_failed_release_after_a_clean_block_raises_the_storage_error(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    gated = GatedStorage(storage)
    ownership = make_ownership("engine-a", target=gated)
    with pytest.raises(StorageError, match="disk gone"), ownership.claim("wf-1"):
        gated.raise_on_next_cas(StorageError("disk gone"), match=touches("wf-1"))
    assert ownership.registry.list_held_workflow_ids() == []


def test_a_failed_release_does_not_mask_the_exception_of_the_block(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    gated = GatedStorage(storage)
    ownership = make_ownership("engine-a", target=gated)
    with (
        watch_log("weft_sync.ownership.facade") as log,
        pytest.raises(KeyError, match="from the body"),
        ownership.claim("wf-1"),
    ):
        gated.raise_on_next_cas(StorageError("disk gone"), match=touches("wf-1"))
        raise KeyError("from the body")
    assert any("could not release" in m for m in log.messages(logging.WARNING))


def test_close_marks_live_handles_lost_and_their_blocks_raise_on_exit(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    ownership = make_ownership("engine-a")
    entered = threading.Event()
    leave = threading.Event()
    handles: list[ClaimHandle] = []

    def hold() -> None:
        with ownership.claim("wf-1") as handle:
            handles.append(handle)
            entered.set()
            assert leave.wait(WAIT_S)

    worker = Worker(hold, "claim-holder")
    assert entered.wait(WAIT_S)
    ownership.close()
    assert handles[0].lost.is_set()
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    leave.set()
    assert isinstance(worker.error(), WorkflowClaimLostError)
