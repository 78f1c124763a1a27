"""Batched renewal chunk by chunk: per-claim outcomes, holder-only writes, ambiguous commits.

A chunk whose every renewal commits is settled on a short path; a chunk with a lost claim or a
failed commit goes through the general one. Both must give each claim what ``renew`` would, and
write nothing but the renewed holders.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence
from typing import Any

from tests.claims.gated import (
    RENEW_MS,
    START_MS,
    TTL_MS,
    GatedStorage,
    WarningSink,
    hold_folded,
    new_registry,
    steal_holder,
    touches,
)
from tests.claims.index_checks import index_violations
from tests.workflows.helpers import expires_at
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_holder, encode_holder
from weft_sync.errors import StorageError
from weft_sync.storage import Storage
from weft_sync.storage.cas import CasRow


def _renewed_from(before: bytes, now: int) -> bytes:
    """The holder a renewal at ``now`` writes over ``before``."""
    record = decode_holder(before)
    assert record is not None
    return encode_holder(dataclasses.replace(record, expires_at=now + TTL_MS))


def test_a_mixed_batch_gets_per_claim_outcomes_and_rewrites_only_the_renewed_holders(
    reg: ClaimRegistry, storage: Storage, clock: ManualClock, sink: WarningSink
) -> None:
    ids = [f"wf-{n:02d}" for n in range(12)]
    hold_folded(reg, storage, ids)
    stolen = {wid: steal_holder(storage, wid) for wid in ("wf-03", "wf-07")}
    before = dict(storage.scan())
    clock.advance(RENEW_MS)
    # Chunks of 4: wf-00..03 and wf-04..07 each lose a claim, wf-08..11 all renew.
    batch = ["never", *ids, "wf-00", "gone"]
    results = reg.renew_many(batch, chunk_size=4)

    expected = {wid: "lost" if wid in stolen else "renewed" for wid in ids}
    assert [(r.workflow_id, r.status) for r in results] == [
        ("never", "not-held"),
        *expected.items(),
        ("wf-00", "renewed"),
        ("gone", "not-held"),
    ]
    assert results[-2] is results[1]
    after = dict(storage.scan())
    changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    renewed = [wid for wid in ids if wid not in stolen]
    assert changed == {keys.workflow_owner_holder(wid) for wid in renewed}
    for wid in renewed:
        holder = keys.workflow_owner_holder(wid)
        assert after[holder] == _renewed_from(before[holder], clock())
    for wid, value in stolen.items():
        assert after[keys.workflow_owner_holder(wid)] == value
    assert sink.lost_ids() == ["wf-03", "wf-07"]
    assert sorted(reg.list_held_workflow_ids()) == renewed

    # The next pass: the lost ones are no longer held, every other chunk commits whole.
    clock.advance(RENEW_MS)
    again = reg.renew_many(ids, chunk_size=4)
    assert [r.status for r in again] == ["not-held" if wid in stolen else "renewed" for wid in ids]
    assert [r for r, wid in zip(again, ids, strict=True) if wid == "wf-00"] == [results[1]]
    assert all(expires_at(storage, wid) == clock() + TTL_MS for wid in renewed)


def test_a_batch_of_held_claims_keeps_the_by_engine_index_exact(
    reg: ClaimRegistry, storage: Storage, clock: ManualClock
) -> None:
    ids = [f"wf-{n:02d}" for n in range(10)]
    hold_folded(reg, storage, ids)
    entries = dict(storage.scan(keys.workflow_owner_by_engine_prefix("engine-a")))
    assert len(entries) == len(ids)
    for _ in range(3):
        clock.advance(RENEW_MS)
        assert {r.status for r in reg.renew_many(ids, chunk_size=3)} == {"renewed"}
    assert dict(storage.scan(keys.workflow_owner_by_engine_prefix("engine-a"))) == entries
    assert index_violations(storage) == []


def test_a_chunk_whose_commit_raised_after_landing_is_adopted_by_the_next_pass(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, clock: ManualClock, sink: WarningSink
) -> None:
    ids = [f"wf-{n}" for n in range(6)]
    hold_folded(reg, storage, ids)
    clock.advance(RENEW_MS)
    first = clock()
    error = StorageError("connection lost during COMMIT")
    gated.raise_on_next_cas(error, after_commit=True, match=touches("wf-0"))
    outcomes = reg.renew_many_outcomes(ids, chunk_size=3)
    assert outcomes[:3] == [error] * 3
    assert [getattr(o, "status", None) for o in outcomes[3:]] == ["renewed"] * 3
    # The commit landed: the store holds the renewal the registry could not confirm.
    assert all(expires_at(storage, wid) == first + TTL_MS for wid in ids)

    clock.advance(RENEW_MS)
    results = reg.renew_many(ids, chunk_size=3)
    assert [r.status for r in results] == ["renewed"] * 6
    assert sink.received == []
    assert all(expires_at(storage, wid) == clock() + TTL_MS for wid in ids)
    assert sorted(reg.list_held_workflow_ids()) == ids


def test_a_chunk_whose_commit_raised_before_landing_is_renewed_by_the_next_pass(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, clock: ManualClock, sink: WarningSink
) -> None:
    ids = [f"wf-{n}" for n in range(4)]
    hold_folded(reg, storage, ids)
    clock.advance(RENEW_MS)
    error = StorageError("disk I/O error")
    gated.raise_on_next_cas(error, match=touches("wf-2"))
    outcomes = reg.renew_many_outcomes(ids, chunk_size=2)
    assert outcomes[2:] == [error, error]
    assert expires_at(storage, "wf-2") == START_MS + TTL_MS
    clock.advance(RENEW_MS)
    assert [r.status for r in reg.renew_many(ids, chunk_size=2)] == ["renewed"] * 4
    assert sink.received == []


class _CollectAtCommit:
    """Delegates to a real store; counts the collector's tracked objects when a batch commits."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner
        self.tracked: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def compare_and_set_many(self, rows: Sequence[CasRow]) -> list[bool]:
        gc.collect()
        self.tracked.append(len(gc.get_objects()))
        result: list[bool] = self._inner.compare_and_set_many(rows)  # type: ignore[attr-defined]
        return result


def test_a_renewal_chunk_keeps_no_collector_tracked_object_per_claim(
    storage: Storage, clock: ManualClock
) -> None:
    # Tracked objects alive through a pass are promoted to older generations and make the
    # collector run full collections over every tracked claim; a chunk must not add one per claim.
    counting = _CollectAtCommit(storage)
    reg = new_registry(counting, clock, "engine-a")
    ids = [f"wf-{n:05d}" for n in range(1_000)]
    hold_folded(reg, storage, ids)
    clock.advance(RENEW_MS)
    reg.renew_many(ids, chunk_size=len(ids))  # the first renewal makes each claim's result
    gc.collect()
    baseline = len(gc.get_objects())
    clock.advance(RENEW_MS)
    assert {r.status for r in reg.renew_many(ids, chunk_size=len(ids))} == {"renewed"}
    assert len(counting.tracked) == 2
    assert counting.tracked[1] - baseline < len(ids) // 10
