"""Claims lost locally: the local renew deadline and a store replaced under the engine.

Every test runs an ``Ownership`` on a real store (both backends) wrapped so that its calls can be
made to fail, with a ``ManualClock`` (TTL 3 s, renew interval 1 s: deadline 2 s) and manual
maintenance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from tests.claims.breakable import BreakableStorage
from tests.claims.gated import GatedStorage, WarningSink, touches, watch_log
from tests.reliability.faulty import WRITE_METHODS
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_holder
from weft_sync.errors import (
    EngineDeposedError,
    StorageError,
    StoreIdentityError,
    WorkflowClaimLostError,
    WorkflowClaimLostWarning,
)
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Storage

TTL_MS = 3_000
RENEW_MS = 1_000
DEADLINE_MS = TTL_MS - RENEW_MS
START_MS = 5_000_000
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def broken(storage: Storage) -> BreakableStorage:
    return BreakableStorage(storage)


@pytest.fixture
def sink() -> WarningSink:
    return WarningSink()


@pytest.fixture
def lost_ids() -> list[str]:
    """The ids the ``own`` fixture's ``on_lost`` callback was called with."""
    return []


@pytest.fixture
def own(
    broken: BreakableStorage, clock: ManualClock, sink: WarningSink, lost_ids: list[str]
) -> Iterator[Ownership]:
    ownership = Ownership.open(broken, options=OPTIONS, clock=clock, background="manual", warn=sink)
    ownership.on_lost(lost_ids.append)
    yield ownership
    broken.error = None
    ownership.close()


def _lost_warnings(sink: WarningSink) -> list[tuple[str, str]]:
    return [
        (w.workflow_id, w.cause) for w in sink.received if isinstance(w, WorkflowClaimLostWarning)
    ]


def _failed_ids(own: Ownership) -> list[str]:
    result = own.run_maintenance()
    return [o.workflow_id for o in result.outcomes if o.status == "failed"]


# -- the local renew deadline ------------------------------------------------------------------


def test_a_claim_whose_renewals_fail_is_lost_at_the_local_deadline(
    own: Ownership,
    broken: BreakableStorage,
    clock: ManualClock,
    sink: WarningSink,
    lost_ids: list[str],
) -> None:
    with pytest.raises(WorkflowClaimLostError), own.claim("wf-1") as handle:
        broken.error = StorageError("store unreachable")
        clock.advance(RENEW_MS)
        assert _failed_ids(own) == ["wf-1"]
        # Before the deadline a failed renewal is only counted, and the claim is still held.
        handle.assert_held()
        assert not handle.lost.is_set()
        assert own.registry.current_epoch("wf-1") == handle.epoch
        assert _lost_warnings(sink) == [] and lost_ids == []

        clock.advance(DEADLINE_MS - RENEW_MS)
        assert _failed_ids(own) == ["wf-1"]
        assert handle.lost.is_set()
        with pytest.raises(WorkflowClaimLostError):
            handle.assert_held()
        assert lost_ids == ["wf-1"]
        assert _lost_warnings(sink) == [("wf-1", "deadline")]
        assert own.registry.list_held_workflow_ids() == []

        # The store comes back: the claim is not renewed again, and fenced writes fail closed.
        broken.error = None
        clock.advance(RENEW_MS)
        assert own.run_maintenance().outcomes == ()
        with pytest.raises(EngineDeposedError):
            own.workflows.save_checkpoint("wf-1", b"step")
    snap = own.metrics.snapshot()
    assert snap.lost == {"deposed": 0, "deadline": 1, "store_identity": 0, "store_rollback": 0}
    assert snap.renewal_failures == 2
    assert snap.attempts["deposed"] == 0


def test_assert_held_gives_up_a_claim_whose_renewal_never_completes(
    own: Ownership, clock: ManualClock, sink: WarningSink, lost_ids: list[str]
) -> None:
    # No renewal pass finishes (a renewal stuck on the store): assert_held() alone sees it.
    with pytest.raises(WorkflowClaimLostError), own.claim("wf-1") as handle:
        clock.advance(DEADLINE_MS - 1)
        handle.assert_held()
        assert _lost_warnings(sink) == []
        clock.advance(1)
        with pytest.raises(WorkflowClaimLostError):
            handle.assert_held()
        assert handle.lost.is_set()
        assert lost_ids == ["wf-1"]
        assert _lost_warnings(sink) == [("wf-1", "deadline")]
        assert own.registry.list_held_workflow_ids() == []
        # Reported once: asking again raises without a second warning.
        with pytest.raises(WorkflowClaimLostError):
            handle.assert_held()
        assert len(_lost_warnings(sink)) == 1
    assert own.metrics.snapshot().lost["deadline"] == 1


def test_the_deadline_counts_from_the_last_successful_renewal(
    own: Ownership, broken: BreakableStorage, clock: ManualClock, sink: WarningSink
) -> None:
    with pytest.raises(WorkflowClaimLostError), own.claim("wf-1") as handle:
        broken.error = StorageError("store unreachable")
        clock.advance(RENEW_MS)
        assert _failed_ids(own) == ["wf-1"]
        broken.error = None
        clock.advance(RENEW_MS)
        assert _failed_ids(own) == []
        # Two failures after that success stay within its deadline.
        broken.error = StorageError("store unreachable")
        clock.advance(RENEW_MS)
        assert _failed_ids(own) == ["wf-1"]
        clock.advance(DEADLINE_MS - RENEW_MS - 1)
        assert _failed_ids(own) == ["wf-1"]
        handle.assert_held()
        assert _lost_warnings(sink) == []
        clock.advance(1)
        assert _failed_ids(own) == ["wf-1"]
        assert handle.lost.is_set()
        assert _lost_warnings(sink) == [("wf-1", "deadline")]
        broken.error = None
        with pytest.raises(WorkflowClaimLostError):
            handle.assert_held()


def test_the_deadline_counts_from_the_start_of_the_last_successful_renewal(
    storage: Storage, clock: ManualClock
) -> None:
    gated = GatedStorage(storage)
    broken = BreakableStorage(gated)
    sink = WarningSink()
    own = Ownership.open(broken, options=OPTIONS, clock=clock, background="manual", warn=sink)
    try:
        with pytest.raises(WorkflowClaimLostError), own.claim("wf-1") as handle:
            clock.advance(RENEW_MS)
            # This renewal takes 900 ms to commit: its holder expires TTL after its start.
            gated.before_next_cas(lambda: clock.advance(900), match=touches("wf-1"))
            assert _failed_ids(own) == []
            holder = decode_holder(storage.get(keys.workflow_owner_holder("wf-1")))
            assert holder is not None and holder.expires_at == START_MS + RENEW_MS + TTL_MS
            broken.error = StorageError("store unreachable")
            clock.set(START_MS + RENEW_MS + DEADLINE_MS)
            assert _failed_ids(own) == ["wf-1"]
            assert handle.lost.is_set()
            assert _lost_warnings(sink) == [("wf-1", "deadline")]
    finally:
        broken.error = None
        own.close()


def test_only_the_claims_past_their_deadline_are_lost(
    own: Ownership, broken: BreakableStorage, clock: ManualClock, sink: WarningSink
) -> None:
    own.workflows.start("old", "job")
    own.drivers.enter("old", 1, "the test's thread")  # driven: only renewal failures end it
    clock.advance(RENEW_MS)
    own.workflows.start("new", "job")
    own.drivers.enter("new", 1, "the test's thread")
    broken.error = StorageError("store unreachable")
    clock.advance(DEADLINE_MS - RENEW_MS)
    assert sorted(_failed_ids(own)) == ["new", "old"]
    assert _lost_warnings(sink) == [("old", "deadline")]
    assert own.registry.list_held_workflow_ids() == ["new"]
    broken.error = None
    clock.advance(RENEW_MS)
    assert _failed_ids(own) == []
    assert own.registry.list_held_workflow_ids() == ["new"]


def test_a_lost_deadline_claim_is_reported_in_the_prometheus_text(
    own: Ownership, broken: BreakableStorage, clock: ManualClock
) -> None:
    from weft_sync.metrics import serialize_prometheus

    own.workflows.start("wf-1", "job")
    broken.error = StorageError("store unreachable")
    clock.advance(DEADLINE_MS)
    _failed_ids(own)
    text = serialize_prometheus(own.metrics.snapshot())
    assert 'weft_workflow_claims_lost_total{cause="deadline"} 1' in text.splitlines()
    assert 'weft_workflow_claims_lost_total{cause="deposed"} 0' in text.splitlines()


# -- a store replaced under the engine ----------------------------------------------------------


def _write_calls(store: BreakableStorage) -> int:
    return sum(n for method, n in store.calls.items() if method in WRITE_METHODS)


def _replaced() -> StoreIdentityError:
    return StoreIdentityError("/srv/weft/claims.db", "the file was replaced (inode 12 -> 57)")


def test_a_replaced_store_loses_every_claim_and_stops_claim_writes(
    own: Ownership,
    broken: BreakableStorage,
    clock: ManualClock,
    sink: WarningSink,
    lost_ids: list[str],
) -> None:
    own.workflows.start("wf-a", "job")
    own.workflows.start("wf-b", "job")
    with pytest.raises(WorkflowClaimLostError), own.claim("wf-c") as handle:
        broken.error = _replaced()
        clock.advance(RENEW_MS)
        with watch_log("weft_sync.claims.registry") as log:
            result = own.run_maintenance()
        assert {o.workflow_id for o in result.outcomes} == {"wf-a", "wf-b", "wf-c"}
        assert all(isinstance(o.error, StoreIdentityError) for o in result.outcomes)
        errors = log.messages(logging.ERROR)
        assert len(errors) == 1 and "/srv/weft/claims.db" in errors[0]
        assert handle.lost.is_set()
        assert sorted(_lost_warnings(sink)) == [
            ("wf-a", "store_identity"),
            ("wf-b", "store_identity"),
            ("wf-c", "store_identity"),
        ]
        assert sorted(lost_ids) == ["wf-a", "wf-b", "wf-c"]
        assert own.registry.list_held_workflow_ids() == []
        # No further claim write is attempted: the engine refuses them itself.
        writes = _write_calls(broken)
        with pytest.raises(StoreIdentityError):
            own.registry.acquire("wf-d")
        with pytest.raises(StoreIdentityError):
            own.registry.takeover("wf-a")
        with pytest.raises(StoreIdentityError):
            own.workflows.start("wf-e", "job")
        assert _write_calls(broken) == writes
        # Maintenance keeps running (a pass raises nothing) and logs no second ERROR.
        clock.advance(RENEW_MS)
        with watch_log("weft_sync.claims.registry") as log:
            assert own.run_maintenance().outcomes == ()
        assert log.messages(logging.ERROR) == []
    assert own.metrics.snapshot().lost == {
        "deposed": 0,
        "deadline": 0,
        "store_identity": 3,
        "store_rollback": 0,
    }


def test_a_fenced_write_that_finds_the_store_replaced_loses_every_claim(
    own: Ownership, broken: BreakableStorage, sink: WarningSink
) -> None:
    own.workflows.start("wf-a", "job")
    own.workflows.start("wf-b", "job")
    broken.error = _replaced()
    with pytest.raises(StoreIdentityError):
        own.workflows.save_checkpoint("wf-a", b"step")
    assert sorted(_lost_warnings(sink)) == [("wf-a", "store_identity"), ("wf-b", "store_identity")]
    assert own.registry.list_held_workflow_ids() == []
    broken.error = None
    with pytest.raises(EngineDeposedError):
        own.workflows.save_checkpoint("wf-b", b"step")


def test_a_replaced_store_in_interval_mode_leaves_the_maintenance_threads_running(
    storage: Storage,
) -> None:
    broken = BreakableStorage(storage)
    sink = WarningSink()
    fast = OwnershipOptions(claim_ttl=300, claim_renew_interval=100)
    own = Ownership.open(broken, options=fast, warn=sink)
    try:
        own.workflows.start("wf-a", "job")
        with watch_log("weft_sync.claims.registry") as log:
            broken.error = _replaced()
            log.wait_for("stops using the store at /srv/weft/claims.db")
        # Later ticks still run their reclaim scans (each refused by the broken store).
        refused = broken.refused
        for _ in range(400):
            if broken.refused >= refused + 3:
                break
            time.sleep(0.01)
        assert broken.refused >= refused + 3
        assert own.started
        assert _lost_warnings(sink) == [("wf-a", "store_identity")]
        assert len(log.messages(logging.ERROR)) == 1
    finally:
        broken.error = None
        own.close()
