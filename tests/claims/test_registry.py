"""ClaimRegistry on real stores: acquire, renew, release, takeover, tracking (spec §7.3)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from tests.claims.gated import (
    REGISTRY_LOGGER,
    RENEW_MS,
    START_MS,
    TTL_MS,
    GatedStorage,
    WarningSink,
    new_registry,
    touches,
    watch_log,
)
from tests.token_match import minted
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, decode_holder, encode_epoch, encode_holder
from weft_sync.errors import StorageCapabilityError, StorageError, WorkflowClaimLostWarning
from weft_sync.storage import Storage

WF = "wf-1"
HOLDER = keys.workflow_owner_holder(WF)
EPOCH = keys.workflow_owner_epoch(WF)
Factory = Callable[..., ClaimRegistry]


def _holder(storage: Storage, wid: str = WF) -> HolderRecord | None:
    return decode_holder(storage.get(keys.workflow_owner_holder(wid)))


# -- acquire ------------------------------------------------------------------------------


def test_acquire_of_a_never_seen_id_mints_epoch_one(reg: ClaimRegistry, storage: Storage) -> None:
    result = reg.acquire(WF)
    assert (result.status, result.epoch, result.held_by) == ("acquired", 1, None)
    assert storage.get(EPOCH) == minted(1)
    assert reg.current_epoch(WF) == 1
    assert _holder(storage) == HolderRecord("engine-a", 1, START_MS + TTL_MS, START_MS)


def test_acquire_after_release_mints_the_next_epoch(reg: ClaimRegistry, storage: Storage) -> None:
    reg.acquire(WF)
    reg.release(WF)
    result = reg.acquire(WF)
    assert result.epoch == 2
    assert storage.get(EPOCH) == minted(2)


def test_acquire_against_a_live_foreign_holder_loses_and_names_it(make: Factory) -> None:
    other = make("engine-b")
    other.acquire(WF)
    mine = make("engine-a")
    result = mine.acquire(WF)
    assert (result.status, result.held_by, result.epoch) == ("lost-race", "engine-b", None)
    assert mine.current_epoch(WF) is None
    assert mine.list_held_workflow_ids() == []


def test_acquire_never_steals_even_a_long_expired_holder(make: Factory, clock: ManualClock) -> None:
    make("engine-b").acquire(WF)
    clock.advance(100 * TTL_MS)
    assert make("engine-a").acquire(WF).status == "lost-race"


def test_acquire_against_a_garbage_holder_loses_with_unknown_holder(
    reg: ClaimRegistry, storage: Storage
) -> None:
    storage.put(HOLDER, b"\xff\xfe\x00")
    result = reg.acquire(WF)
    assert (result.status, result.held_by) == ("lost-race", None)
    assert storage.get(HOLDER) == b"\xff\xfe\x00"


def test_forced_lost_cas_with_no_holder_reports_unknown_holder(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    gated.force_next_cas(False)
    result = reg.acquire(WF)
    assert (result.status, result.held_by) == ("lost-race", None)
    assert storage.get(EPOCH) is None
    assert reg.current_epoch(WF) is None


def test_acquire_losing_to_a_competitor_between_read_and_commit_names_the_competitor(
    make: Factory, gated: GatedStorage
) -> None:
    competitor = make("engine-c", store=gated.inner)
    gated.before_next_cas(lambda: competitor.acquire(WF))
    result = make("engine-a").acquire(WF)
    assert (result.status, result.held_by) == ("lost-race", "engine-c")
    assert competitor.current_epoch(WF) == 1


def test_acquire_on_a_store_without_compare_and_swap_is_refused(
    storage: Storage, clock: ManualClock
) -> None:
    reg = new_registry(GatedStorage(storage, conditional_batch=False), clock)
    with pytest.raises(StorageCapabilityError, match="conditional_batch"):
        reg.acquire(WF)
    assert storage.get(EPOCH) is None


# -- renew --------------------------------------------------------------------------------


def test_renew_extends_expiry_and_keeps_epoch_and_claimed_at(
    reg: ClaimRegistry, clock: ManualClock, storage: Storage
) -> None:
    reg.acquire(WF)
    clock.advance(RENEW_MS)
    result = reg.renew(WF)
    assert (result.status, result.workflow_id) == ("renewed", WF)
    assert reg.current_epoch(WF) == 1
    assert _holder(storage) == HolderRecord("engine-a", 1, START_MS + RENEW_MS + TTL_MS, START_MS)


def test_repeated_renewals_each_condition_on_the_bytes_last_written(
    reg: ClaimRegistry, clock: ManualClock
) -> None:
    reg.acquire(WF)
    for _ in range(3):
        clock.advance(RENEW_MS)
        assert reg.renew(WF).status == "renewed"


def test_renew_of_an_untracked_id_is_not_held_without_storage_calls(
    reg: ClaimRegistry, gated: GatedStorage
) -> None:
    before = gated.total_calls
    assert reg.renew(WF).status == "not-held"
    assert gated.total_calls == before


def test_renew_after_another_engine_overwrote_the_holder_reports_lost_once(
    make: Factory, storage: Storage, sink: WarningSink
) -> None:
    reg = make()
    reg.acquire(WF)
    storage.put(HOLDER, encode_holder(HolderRecord("engine-b", 1, 10**9, 0)))
    assert reg.renew(WF).status == "lost"
    assert sink.lost_ids() == [WF]
    assert reg.current_epoch(WF) is None
    assert reg.renew(WF).status == "not-held"
    assert sink.lost_ids() == [WF]


def test_lost_renewal_uses_the_default_warning_when_no_sink_is_given(
    storage: Storage, clock: ManualClock
) -> None:
    reg = new_registry(storage, clock)
    reg.acquire(WF)
    storage.delete(HOLDER)
    with pytest.warns(WorkflowClaimLostWarning) as record:
        assert reg.renew(WF).status == "lost"
    assert [w.message.workflow_id for w in record] == [WF]  # type: ignore[union-attr]


def test_lost_renewal_starts_the_takeover_cooldown(
    make: Factory, clock: ManualClock, gated: GatedStorage, storage: Storage
) -> None:
    reg = make()
    reg.acquire(WF)
    storage.put(HOLDER, encode_holder(HolderRecord("engine-b", 1, 0, 0)))
    clock.advance(3 * RENEW_MS)
    assert reg.renew(WF).status == "lost"
    before = gated.total_calls
    assert reg.takeover(WF).status == "backoff-skipped"
    assert gated.total_calls == before
    clock.advance(RENEW_MS - 1)
    assert reg.takeover(WF).status == "backoff-skipped"
    clock.advance(1)
    assert reg.takeover(WF).status == "acquired"


def test_renew_whose_commit_raises_propagates_without_warning_and_keeps_the_claim(
    reg: ClaimRegistry, gated: GatedStorage, sink: WarningSink, storage: Storage
) -> None:
    reg.acquire(WF)
    gated.raise_on_next_cas(StorageError("disk on fire"))
    with pytest.raises(StorageError, match="disk on fire"):
        reg.renew(WF)
    assert sink.received == []
    assert reg.current_epoch(WF) == 1
    assert reg.takeover(WF).status == "not-expired"
    assert reg.release(WF).status == "released"
    assert storage.get(HOLDER) is None


# -- release ------------------------------------------------------------------------------


def test_release_deletes_the_holder_and_keeps_the_epoch(
    reg: ClaimRegistry, storage: Storage
) -> None:
    reg.acquire(WF)
    result = reg.release(WF)
    assert (result.status, result.workflow_id) == ("released", WF)
    assert storage.get(HOLDER) is None
    assert storage.get(EPOCH) == minted(1)
    assert reg.current_epoch(WF) is None


def test_release_of_an_untracked_id_is_not_held(reg: ClaimRegistry, gated: GatedStorage) -> None:
    assert reg.release(WF).status == "not-held"
    assert gated.transactions == 0


def test_release_with_a_lost_cas_drops_the_local_entry(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    reg.acquire(WF)
    gated.force_next_cas(False)
    assert reg.release(WF).status == "lost-race"
    assert reg.current_epoch(WF) is None
    assert storage.get(HOLDER) is not None


def test_release_with_another_expected_epoch_is_not_held_and_writes_nothing(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    reg.acquire(WF)
    before = gated.transactions
    assert reg.release(WF, expected_epoch=2).status == "not-held"
    assert gated.transactions == before
    assert reg.current_epoch(WF) == 1
    assert reg.release(WF, expected_epoch=1).status == "released"
    assert storage.get(HOLDER) is None


def test_release_whose_commit_raises_drops_the_entry_and_reraises(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    reg.acquire(WF)
    gated.raise_on_next_cas(StorageError("connection reset"))
    with pytest.raises(StorageError, match="connection reset"):
        reg.release(WF)
    assert reg.current_epoch(WF) is None
    assert reg.list_held_workflow_ids() == []
    assert storage.get(HOLDER) is not None


def test_release_that_commits_then_raises_drops_the_entry_and_the_holder(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    reg.acquire(WF)
    gated.raise_on_next_cas(StorageError("lost the reply"), after_commit=True)
    with pytest.raises(StorageError, match="lost the reply"):
        reg.release(WF)
    assert reg.current_epoch(WF) is None
    assert storage.get(HOLDER) is None


def test_release_all_deletes_every_holder_and_clears_tracking(
    reg: ClaimRegistry, storage: Storage
) -> None:
    ids = [f"wf-{n}" for n in range(5)]
    for wid in ids:
        reg.acquire(wid)
    reg.release_all()
    assert reg.list_held_workflow_ids() == []
    assert all(storage.get(keys.workflow_owner_holder(w)) is None for w in ids)


def test_release_all_with_one_release_raising_still_releases_the_others(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    reg.acquire("wf-1")
    reg.acquire("wf-2")
    gated.raise_on_next_cas(StorageError("boom"), match=touches("wf-1"))
    reg.release_all()
    assert reg.list_held_workflow_ids() == []
    assert storage.get(keys.workflow_owner_holder("wf-2")) is None
    assert storage.get(keys.workflow_owner_holder("wf-1")) is not None


def test_release_all_with_nothing_held_does_nothing(
    reg: ClaimRegistry, gated: GatedStorage
) -> None:
    reg.release_all()
    assert gated.total_calls == 0


def test_forget_local_claim_drops_only_the_local_entry(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    reg.acquire(WF)
    before = gated.total_calls
    reg.forget_local_claim(WF)
    reg.forget_local_claim("never-seen")
    assert gated.total_calls == before
    assert reg.current_epoch(WF) is None
    assert storage.get(HOLDER) is not None
    assert reg.renew(WF).status == "not-held"


# -- takeover -----------------------------------------------------------------------------


def test_takeover_of_a_never_claimed_id_is_no_claim(reg: ClaimRegistry) -> None:
    assert reg.takeover(WF).status == "no-claim"


def test_takeover_of_a_holder_without_an_epoch_is_no_claim(
    reg: ClaimRegistry, storage: Storage
) -> None:
    storage.put(HOLDER, encode_holder(HolderRecord("engine-b", 1, 0, 0)))
    assert reg.takeover(WF).status == "no-claim"
    assert reg.current_epoch(WF) is None


def test_takeover_exactly_at_the_grace_deadline_is_not_expired(
    make: Factory, clock: ManualClock
) -> None:
    make("engine-b").acquire(WF)
    expires_at = START_MS + TTL_MS
    clock.set(expires_at + 2 * RENEW_MS)
    result = make("engine-a").takeover(WF)
    assert (result.status, result.held_by, result.expires_at) == (
        "not-expired",
        "engine-b",
        expires_at,
    )


def test_takeover_one_ms_after_the_grace_deadline_mints_the_next_epoch(
    make: Factory, clock: ManualClock, storage: Storage
) -> None:
    make("engine-b").acquire(WF)
    clock.set(START_MS + TTL_MS + 2 * RENEW_MS + 1)
    reg = make("engine-a")
    result = reg.takeover(WF)
    assert (result.status, result.epoch) == ("acquired", 2)
    assert reg.current_epoch(WF) == 2
    assert _holder(storage) == HolderRecord("engine-a", 2, clock() + TTL_MS, clock())


def test_takeover_steals_a_garbage_holder_at_once_following_the_epoch_key(
    reg: ClaimRegistry, storage: Storage
) -> None:
    storage.put(HOLDER, b"not a holder")
    storage.put(EPOCH, encode_epoch(4))
    result = reg.takeover(WF)
    assert (result.status, result.epoch) == ("acquired", 5)
    assert storage.get(EPOCH) == minted(5)


def test_takeover_ignores_the_epoch_the_stale_holder_claims(
    reg: ClaimRegistry, storage: Storage, clock: ManualClock
) -> None:
    storage.put(HOLDER, encode_holder(HolderRecord("engine-b", 999, 0, 0)))
    storage.put(EPOCH, encode_epoch(12))
    clock.set(2 * RENEW_MS + 1)
    assert reg.takeover(WF).epoch == 13


def test_takeover_losing_to_a_competitor_names_the_competitor(
    make: Factory, clock: ManualClock, gated: GatedStorage
) -> None:
    make("engine-x", store=gated.inner).acquire(WF)
    clock.advance(TTL_MS + 2 * RENEW_MS + 1)
    competitor = make("engine-c", store=gated.inner)
    gated.before_next_cas(lambda: competitor.takeover(WF))
    reg = make("engine-a")
    result = reg.takeover(WF)
    assert (result.status, result.held_by) == ("lost-race", "engine-c")
    assert competitor.current_epoch(WF) == 2
    assert reg.current_epoch(WF) is None


def test_takeover_of_this_engines_own_live_claim_is_not_expired(reg: ClaimRegistry) -> None:
    reg.acquire(WF)
    result = reg.takeover(WF)
    assert (result.status, result.held_by) == ("not-expired", "engine-a")
    assert reg.current_epoch(WF) == 1


# -- local views --------------------------------------------------------------------------


def test_unknown_ids_have_no_epoch(reg: ClaimRegistry) -> None:
    assert reg.current_epoch("nope") is None
    assert reg.current_epoch_bytes("nope") is None


def test_epoch_bytes_handed_out_cannot_change_the_cached_fence(
    reg: ClaimRegistry, clock: ManualClock
) -> None:
    reg.acquire(WF)
    copy = bytearray(reg.current_epoch_bytes(WF) or b"")
    copy[7] = 9
    clock.advance(RENEW_MS)
    reg.renew(WF)
    assert reg.current_epoch_bytes(WF) == minted(1)


def test_list_held_is_a_snapshot_of_tracked_ids(reg: ClaimRegistry) -> None:
    assert reg.list_held_workflow_ids() == []
    reg.acquire("a")
    reg.acquire("b")
    snapshot = reg.list_held_workflow_ids()
    assert sorted(snapshot) == ["a", "b"]
    reg.acquire("c")
    assert sorted(snapshot) == ["a", "b"]
    reg.release("a")
    assert sorted(reg.list_held_workflow_ids()) == ["b", "c"]


def test_engine_id_is_exposed(reg: ClaimRegistry) -> None:
    assert reg.engine_id == "engine-a"


def test_ids_needing_percent_encoding_round_trip(reg: ClaimRegistry, storage: Storage) -> None:
    wid = "workflow:with:colons/and%percent é"
    assert reg.acquire(wid).status == "acquired"
    assert storage.get(keys.workflow_owner_epoch(wid)) == minted(1)
    assert reg.list_held_workflow_ids() == [wid]
    assert reg.release(wid).status == "released"


# -- validation and logging ---------------------------------------------------------------

_METHODS: list[tuple[str, Callable[[ClaimRegistry, object], object]]] = [
    ("acquire", lambda r, w: r.acquire(w)),  # type: ignore[arg-type]
    ("renew", lambda r, w: r.renew(w)),  # type: ignore[arg-type]
    ("renew_many", lambda r, w: r.renew_many(["ok", w])),  # type: ignore[list-item]
    ("release", lambda r, w: r.release(w)),  # type: ignore[arg-type]
    ("takeover", lambda r, w: r.takeover(w)),  # type: ignore[arg-type]
    ("current_epoch", lambda r, w: r.current_epoch(w)),  # type: ignore[arg-type]
    ("prepare", lambda r, w: r.prepare_acquire_fragment(w)),  # type: ignore[arg-type]
    ("forget", lambda r, w: r.forget_local_claim(w)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "call"), _METHODS, ids=[m[0] for m in _METHODS])
@pytest.mark.parametrize(
    ("bad", "error", "pattern"),
    [
        ("", ValueError, "non-empty"),
        ("bad\ud800id", ValueError, "lone surrogate"),
        (42, TypeError, "must be str"),
    ],
    ids=["empty", "surrogate", "not-str"],
)
def test_invalid_workflow_ids_are_rejected_before_any_storage_call(
    reg: ClaimRegistry,
    gated: GatedStorage,
    name: str,
    call: Callable[[ClaimRegistry, object], object],
    bad: object,
    error: type[Exception],
    pattern: str,
) -> None:
    with pytest.raises(error, match=pattern):
        call(reg, bad)
    assert gated.total_calls == 0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"engine_id": ""}, "engine_id"),
        ({"claim_ttl_ms": 0}, "claim_ttl_ms"),
        ({"claim_renew_interval_ms": -5}, "claim_renew_interval_ms"),
        ({"claim_ttl_ms": 1.5}, "claim_ttl_ms"),
    ],
)
def test_constructor_rejects_bad_settings_naming_them(
    storage: Storage, kwargs: dict[str, object], pattern: str
) -> None:
    settings: dict[str, object] = {
        "engine_id": "engine-a",
        "clock": ManualClock(),
        "claim_ttl_ms": TTL_MS,
        "claim_renew_interval_ms": RENEW_MS,
    }
    settings.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        ClaimRegistry(storage, **settings)  # type: ignore[arg-type]


def test_log_levels_follow_ownership_changes(
    make: Factory, storage: Storage, clock: ManualClock
) -> None:
    reg = make()
    with watch_log(REGISTRY_LOGGER) as log:
        reg.acquire(WF)
        clock.advance(RENEW_MS)
        reg.renew(WF)
        storage.delete(HOLDER)
        reg.renew(WF)
    assert any("acquired workflow 'wf-1'" in m for m in log.messages(logging.INFO))
    assert any("renewed the claim on workflow 'wf-1'" in m for m in log.messages(logging.DEBUG))
    assert any("lost its claim on workflow 'wf-1'" in m for m in log.messages(logging.WARNING))
