"""Folded acquire: a prepared fragment committed in the caller's own write (spec §7.4)."""

from __future__ import annotations

import pytest

from tests.claims.gated import RENEW_MS, START_MS, TTL_MS, GatedStorage
from tests.token_match import minted
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, decode_holder, encode_epoch, encode_holder
from weft_sync.storage import Condition, Put, Storage

WF = "wf-fold"
HOLDER = keys.workflow_owner_holder(WF)
EPOCH = keys.workflow_owner_epoch(WF)


def _commit(storage: Storage, reg: ClaimRegistry, extra: list[Put] | None = None) -> bool:
    """Commit a prepared fragment together with the caller's own record write."""
    prep = reg.prepare_acquire_fragment(WF)
    ops = [Put(keys.workflow(WF), b"record"), *(extra or []), *prep.fragment.operations]
    conditions = [Condition(keys.workflow(WF), None), *prep.fragment.conditions]
    committed = storage.conditional_batch(conditions, ops)
    if committed:
        reg.record_folded_acquire(WF, prep)
    return committed


def test_prepare_on_a_fresh_id_mints_epoch_one_and_writes_nothing(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    prep = reg.prepare_acquire_fragment(WF)
    assert (prep.epoch, prep.claimed_at) == (1, START_MS)
    assert prep.fragment.conditions == (Condition(HOLDER, None), Condition(EPOCH, None))
    assert prep.fragment.operations == (
        Put(EPOCH, minted(1)),
        Put(HOLDER, encode_holder(HolderRecord("engine-a", 1, START_MS + TTL_MS, START_MS))),
        Put(keys.workflow_owner_by_engine("engine-a", WF), encode_epoch(1)),
    )
    assert gated.transactions == 0
    assert storage.get(EPOCH) is None
    assert reg.current_epoch(WF) is None


def test_prepare_follows_a_stored_epoch(reg: ClaimRegistry, storage: Storage) -> None:
    storage.put(EPOCH, encode_epoch(7))
    prep = reg.prepare_acquire_fragment(WF)
    assert prep.epoch == 8
    assert Condition(EPOCH, encode_epoch(7)) in prep.fragment.conditions


def test_prepare_rereads_the_epoch_on_every_call(reg: ClaimRegistry, storage: Storage) -> None:
    first = reg.prepare_acquire_fragment(WF)
    assert storage.conditional_batch(first.fragment.conditions, first.fragment.operations)
    storage.delete(HOLDER)
    second = reg.prepare_acquire_fragment(WF)
    assert second.epoch == 2
    assert Condition(EPOCH, minted(1)) in second.fragment.conditions


def test_folded_acquire_is_renewed_and_released_like_any_claim(
    reg: ClaimRegistry, storage: Storage, clock: ManualClock
) -> None:
    assert _commit(storage, reg)
    assert reg.current_epoch(WF) == 1
    clock.advance(RENEW_MS)
    assert reg.renew(WF).status == "renewed"
    assert decode_holder(storage.get(HOLDER)) == HolderRecord(
        "engine-a", 1, START_MS + RENEW_MS + TTL_MS, START_MS
    )
    assert reg.release(WF).status == "released"
    assert storage.get(EPOCH) == minted(1)
    assert storage.get(HOLDER) is None


def test_a_folded_write_that_loses_tracks_nothing(reg: ClaimRegistry, storage: Storage) -> None:
    storage.put(keys.workflow(WF), b"already exists")
    assert not _commit(storage, reg)
    assert reg.current_epoch(WF) is None
    assert storage.get(EPOCH) is None


def test_record_folded_acquire_does_no_io(reg: ClaimRegistry, gated: GatedStorage) -> None:
    prep = reg.prepare_acquire_fragment(WF)
    before = gated.total_calls
    reg.record_folded_acquire(WF, prep)
    assert gated.total_calls == before
    assert reg.current_epoch(WF) == 1
    assert reg.current_epoch_bytes(WF) == minted(1)
    assert gated.inner.get(EPOCH) is None


def test_record_folded_acquire_refuses_a_preparation_for_another_workflow(
    reg: ClaimRegistry,
) -> None:
    prep = reg.prepare_acquire_fragment("other")
    with pytest.raises(ValueError, match="wf-fold"):
        reg.record_folded_acquire(WF, prep)
    assert reg.current_epoch(WF) is None


def test_record_folded_acquire_clears_the_takeover_cooldown(
    reg: ClaimRegistry, storage: Storage, clock: ManualClock
) -> None:
    assert _commit(storage, reg)
    storage.put(HOLDER, encode_holder(HolderRecord("engine-b", 1, 0, 0)))
    clock.advance(3 * RENEW_MS)
    assert reg.renew(WF).status == "lost"
    assert reg.takeover(WF).status == "backoff-skipped"
    storage.delete(HOLDER)
    assert _commit_again(storage, reg)
    storage.put(HOLDER, encode_holder(HolderRecord("engine-b", 2, 0, 0)))
    assert reg.takeover(WF).status == "acquired"


def _commit_again(storage: Storage, reg: ClaimRegistry) -> bool:
    prep = reg.prepare_acquire_fragment(WF)
    committed = storage.conditional_batch(prep.fragment.conditions, prep.fragment.operations)
    if committed:
        reg.record_folded_acquire(WF, prep)
    return committed
