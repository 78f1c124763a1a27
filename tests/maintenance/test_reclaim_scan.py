"""Reclaim candidate discovery over real stores (spec §5.4, §7.10 items 137-152)."""

from __future__ import annotations

from collections.abc import Callable

from weft_sync import keys
from weft_sync.codec import (
    HolderRecord,
    WorkflowRecord,
    encode_epoch,
    encode_holder,
    encode_workflow_record,
)
from weft_sync.reclaim.scan import AUTHORITATIVE_SCAN_LIMIT, list_reclaim_candidates
from weft_sync.storage import Put, Storage


def _hold(storage: Storage, workflow_id: str, engine_id: str = "engine-a") -> None:
    record = HolderRecord(engine_id, 1, expires_at=30_000, claimed_at=0)
    storage.put(keys.workflow_owner_holder(workflow_id), encode_holder(record))
    storage.put(keys.workflow_owner_epoch(workflow_id), encode_epoch(1))


def _record(workflow_id: str, status: str) -> bytes:
    return encode_workflow_record(WorkflowRecord(workflow_id, "import", status))


def _workflow(storage: Storage, workflow_id: str, status: str, *, indexed: bool = True) -> None:
    storage.put(keys.workflow(workflow_id), _record(workflow_id, status))
    if indexed:
        storage.put(keys.workflow_status_index(status, workflow_id), b"")


def test_no_holders_means_no_candidates(storage: Storage) -> None:
    assert list_reclaim_candidates(storage, set()) == []


def test_every_holder_is_a_candidate(storage: Storage) -> None:
    _hold(storage, "wf-1")
    _hold(storage, "wf-2", "engine-b")
    assert list_reclaim_candidates(storage, set()) == ["wf-1", "wf-2"]


def test_excluded_ids_are_left_out(storage: Storage) -> None:
    _hold(storage, "wf-1")
    _hold(storage, "wf-2")
    assert list_reclaim_candidates(storage, {"wf-1"}) == ["wf-2"]


def test_ids_with_reserved_characters_round_trip(storage: Storage) -> None:
    odd = "workflow:with:colons/and%percent"
    _hold(storage, odd)
    assert list_reclaim_candidates(storage, set()) == [odd]


def test_malformed_or_non_canonical_key_components_are_skipped(storage: Storage) -> None:
    holder = encode_holder(HolderRecord("engine-a", 1, 30_000, 0))
    storage.put("wf-owner-holder:%E0%A4%A", holder)
    storage.put("wf-owner-holder:a%41", holder)
    storage.put("wf-owner-holder:", holder)
    _hold(storage, "good")
    assert list_reclaim_candidates(storage, set()) == ["good"]


def test_epoch_keys_are_not_mistaken_for_holders(storage: Storage) -> None:
    storage.put(keys.workflow_owner_epoch("released"), encode_epoch(3))
    assert list_reclaim_candidates(storage, set()) == []


def test_running_workflow_without_a_holder_is_a_candidate(storage: Storage) -> None:
    _workflow(storage, "orphan", "running")
    assert list_reclaim_candidates(storage, set()) == ["orphan"]


def test_running_workflow_with_a_holder_appears_once(storage: Storage) -> None:
    _workflow(storage, "wf-1", "running")
    _hold(storage, "wf-1")
    assert list_reclaim_candidates(storage, set()) == ["wf-1"]


def test_finished_and_excluded_ownerless_workflows_are_not_candidates(storage: Storage) -> None:
    _workflow(storage, "done", "completed")
    _workflow(storage, "mine", "running")
    assert list_reclaim_candidates(storage, {"mine"}) == []


def test_holder_and_ownerless_candidates_are_both_returned(storage: Storage) -> None:
    _hold(storage, "held")
    _workflow(storage, "held", "running")
    _workflow(storage, "ownerless", "running")
    assert list_reclaim_candidates(storage, set()) == ["held", "ownerless"]


def test_rolling_handoff_keeps_a_running_workflow_discoverable(storage: Storage) -> None:
    _workflow(storage, "wf-1", "running")
    _hold(storage, "wf-1")
    assert list_reclaim_candidates(storage, set()) == ["wf-1"]
    storage.delete(keys.workflow_owner_holder("wf-1"))
    assert list_reclaim_candidates(storage, set()) == ["wf-1"]


def test_unindexed_running_workflow_is_found_by_the_authoritative_scan(storage: Storage) -> None:
    _workflow(storage, "legacy", "running", indexed=False)
    assert list_reclaim_candidates(storage, set()) == ["legacy"]


def test_authoritative_scan_skips_held_finished_and_excluded_workflows(storage: Storage) -> None:
    _workflow(storage, "held", "running", indexed=False)
    _hold(storage, "held")
    _workflow(storage, "done", "completed", indexed=False)
    _workflow(storage, "mine", "running", indexed=False)
    storage.put(keys.workflow("garbage"), b"\xc1 not msgpack")
    assert list_reclaim_candidates(storage, {"mine"}) == ["held"]


def test_related_records_under_the_workflow_prefix_are_not_workflows(storage: Storage) -> None:
    running = _record("abc", "running")
    storage.put(keys.workflow("abc"), _record("abc", "completed"))
    storage.put(keys.workflow("abc") + ":ckpt", running)
    storage.put(keys.workflow("abc") + ":ckpt:0000000003", running)
    storage.put(keys.workflow("abc") + ":timeline:0000000001", running)
    assert list_reclaim_candidates(storage, set()) == []


def test_unindexed_rolling_handoff_is_found_after_the_holder_goes(storage: Storage) -> None:
    _workflow(storage, "legacy", "running", indexed=False)
    _hold(storage, "legacy")
    assert list_reclaim_candidates(storage, set()) == ["legacy"]
    storage.delete(keys.workflow_owner_holder("legacy"))
    assert list_reclaim_candidates(storage, set()) == ["legacy"]


def test_authoritative_scan_rotates_through_large_stores(storage: Storage) -> None:
    ids = [f"legacy-{i:04d}" for i in range(AUTHORITATIVE_SCAN_LIMIT + 5)]
    storage.batch([Put(keys.workflow(wid), _record(wid, "running")) for wid in ids])
    first = list_reclaim_candidates(storage, set())
    second = list_reclaim_candidates(storage, set())
    assert 0 < len(first) <= AUTHORITATIVE_SCAN_LIMIT
    assert 0 < len(second) <= AUTHORITATIVE_SCAN_LIMIT
    assert set(first).isdisjoint(second)
    assert sorted(first + second) == ids
    assert list_reclaim_candidates(storage, set()) == first


def test_each_store_object_has_its_own_scan_cursor(
    storage: Storage, open_store: Callable[[], Storage]
) -> None:
    ids = [f"legacy-{i:04d}" for i in range(AUTHORITATIVE_SCAN_LIMIT + 5)]
    storage.batch([Put(keys.workflow(wid), _record(wid, "running")) for wid in ids])
    other = open_store()
    first = list_reclaim_candidates(storage, set())
    assert list_reclaim_candidates(other, set()) == first
    assert set(list_reclaim_candidates(storage, set())).isdisjoint(first)


def test_holders_seen_live_are_skipped_and_not_read_again(storage: Storage) -> None:
    from tests.claims.gated import GatedStorage
    from weft_sync.codec import decode_holder

    live = HolderRecord("engine-a", 1, expires_at=90_000, claimed_at=0)
    expired = HolderRecord("engine-b", 1, expires_at=10_000, claimed_at=0)
    storage.put(keys.workflow_owner_holder("wf-live"), encode_holder(live))
    storage.put(keys.workflow_owner_holder("wf-expired"), encode_holder(expired))
    _workflow(storage, "wf-live", "running")
    _workflow(storage, "wf-expired", "running")

    def is_live(value: bytes) -> bool:
        holder = decode_holder(value)
        return holder is not None and holder.expires_at > 50_000

    gated = GatedStorage(storage)
    assert list_reclaim_candidates(gated, set(), holder_is_live=is_live) == ["wf-expired"]
    # The live workflow is neither a candidate through the index nor point-read for its holder.
    assert gated.calls["get"] == 0
    assert list_reclaim_candidates(storage, set()) == ["wf-expired", "wf-live"]
