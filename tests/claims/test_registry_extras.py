"""ClaimRegistry: ambiguous renewal commits, folded release, argument checks and fork reset."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.claims.gated import (
    PAST_GRACE_MS,
    RENEW_MS,
    TTL_MS,
    WAITS_FOR_RENEWAL,
    GatedStorage,
    WarningSink,
    pause_in_cas,
    start_until_logged,
    touches,
)
from tests.workflows.helpers import ReadHooks, expires_at
from weft_sync import keys
from weft_sync.claims import build_external_rotation_transition
from weft_sync.claims.registry import ClaimRegistry, ReleasePreparation
from weft_sync.claims.results import RenewResult
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_holder
from weft_sync.errors import StorageError
from weft_sync.options import MAX_CLAIM_TTL_MS
from weft_sync.storage import Condition, Delete, Storage

WF = "wf-1"
HOLDER = keys.workflow_owner_holder(WF)
EPOCH = keys.workflow_owner_epoch(WF)
Factory = Callable[..., ClaimRegistry]


@pytest.fixture
def gated(storage: Storage) -> ReadHooks:
    return ReadHooks(storage)


@pytest.fixture
def reg(make: Factory) -> ClaimRegistry:
    """Engine A's registry, holding WF."""
    registry = make()
    assert registry.acquire(WF).status == "acquired"
    return registry


def _renew_landing_but_raising(reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock) -> None:
    """One renewal of WF that commits in the store but raises to the registry."""
    clock.advance(RENEW_MS)
    gated.raise_on_next_cas(StorageError("lost the reply"), after_commit=True, match=touches(WF))
    with pytest.raises(StorageError, match="lost the reply"):
        reg.renew(WF)
    assert expires_at(gated, WF) == clock() + TTL_MS  # it landed
    assert reg.current_epoch(WF) == 1


# -- ambiguous renewal commits ------------------------------------------------------------


def test_renewal_after_an_ambiguous_commit_adopts_it_and_renews(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock, sink: WarningSink
) -> None:
    _renew_landing_but_raising(reg, gated, clock)
    clock.advance(RENEW_MS)
    assert reg.renew(WF).status == "renewed"
    assert expires_at(gated, WF) == clock() + TTL_MS
    assert sink.received == []
    # Adopted for good: the next renewal is one plain CAS, with no re-read.
    clock.advance(RENEW_MS)
    reads, cas = gated.calls["get"], gated.transactions
    assert reg.renew(WF).status == "renewed"
    assert (gated.calls["get"] - reads, gated.transactions - cas) == (0, 1)
    assert reg.release(WF).status == "released"
    assert gated.get(HOLDER) is None
    assert sink.received == []


def test_release_after_an_ambiguous_renewal_commit_deletes_the_holder(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock, sink: WarningSink
) -> None:
    _renew_landing_but_raising(reg, gated, clock)
    assert reg.release(WF).status == "released"
    assert gated.get(HOLDER) is None
    assert gated.get(EPOCH) is not None
    assert reg.current_epoch(WF) is None
    assert sink.received == []


def test_takeover_after_an_ambiguous_renewal_commit_is_still_lost_with_one_warning(
    reg: ClaimRegistry,
    make: Factory,
    gated: GatedStorage,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    _renew_landing_but_raising(reg, gated, clock)
    clock.advance(PAST_GRACE_MS)
    assert make("engine-b", WarningSink()).takeover(WF).status == "acquired"
    assert reg.renew(WF).status == "lost"
    assert sink.lost_ids() == [WF]
    assert reg.current_epoch(WF) is None
    assert reg.takeover(WF).status == "backoff-skipped"
    assert reg.release(WF).status == "not-held"
    assert sink.lost_ids() == [WF]


def test_release_after_an_ambiguous_renewal_and_a_takeover_is_a_lost_race(
    reg: ClaimRegistry, make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    _renew_landing_but_raising(reg, gated, clock)
    clock.advance(PAST_GRACE_MS)
    assert make("engine-b", WarningSink()).takeover(WF).status == "acquired"
    assert reg.release(WF).status == "lost-race"
    holder = decode_holder(gated.get(HOLDER))
    assert holder is not None and holder.engine_id == "engine-b"


def test_a_failed_then_an_ambiguous_renewal_adopt_the_value_that_landed(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock, sink: WarningSink
) -> None:
    clock.advance(RENEW_MS)
    gated.raise_on_next_cas(StorageError("no connection"), match=touches(WF))
    with pytest.raises(StorageError):
        reg.renew(WF)
    _renew_landing_but_raising(reg, gated, clock)
    clock.advance(RENEW_MS)
    assert reg.renew(WF).status == "renewed"
    assert expires_at(gated, WF) == clock() + TTL_MS
    assert sink.received == []


def test_a_renewal_that_raised_before_committing_costs_no_extra_read_later(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock, sink: WarningSink
) -> None:
    gated.raise_on_next_cas(StorageError("no connection"), match=touches(WF))
    with pytest.raises(StorageError):
        reg.renew(WF)
    reads, cas = gated.calls["get"], gated.transactions
    clock.advance(RENEW_MS)
    assert reg.renew(WF).status == "renewed"
    assert (gated.calls["get"] - reads, gated.transactions - cas) == (0, 1)
    assert sink.received == []


def test_a_re_read_that_raises_fails_the_renewal_and_keeps_the_claim(
    reg: ClaimRegistry, gated: ReadHooks, clock: ManualClock, sink: WarningSink
) -> None:
    _renew_landing_but_raising(reg, gated, clock)

    def fail_read() -> None:
        raise StorageError("read timed out")

    gated.before_next_read_of(HOLDER, fail_read)
    with pytest.raises(StorageError, match="read timed out"):
        reg.renew(WF)
    assert reg.current_epoch(WF) == 1
    assert sink.received == []
    assert reg.renew(WF).status == "renewed"


def test_renew_many_adopts_ambiguous_commits_and_still_reports_a_real_loss(
    make: Factory, gated: GatedStorage, clock: ManualClock, sink: WarningSink
) -> None:
    reg = make()
    ids = ["wf-1", "wf-2", "wf-3"]
    for wid in ids:
        assert reg.acquire(wid).status == "acquired"
    clock.advance(RENEW_MS)
    gated.raise_on_next_cas(StorageError("lost the reply"), after_commit=True)
    outcomes = reg.renew_many_outcomes(ids)
    assert all(isinstance(o, StorageError) for o in outcomes)
    assert all(expires_at(gated, wid) == clock() + TTL_MS for wid in ids)
    rotation = build_external_rotation_transition(
        workflow_id="wf-3", observed_epoch_bytes=gated.get(keys.workflow_owner_epoch("wf-3"))
    )
    assert gated.inner.conditional_batch(rotation.conditions, rotation.operations)
    clock.advance(RENEW_MS)
    batches = gated.calls["compare_and_set_many"]
    results = reg.renew_many(ids)
    assert [r.status for r in results] == ["renewed", "renewed", "lost"]
    assert gated.calls["compare_and_set_many"] - batches == 2  # the chunk, then the retry
    assert all(expires_at(gated, wid) == clock() + TTL_MS for wid in ids[:2])
    assert sink.lost_ids() == ["wf-3"]
    assert sorted(reg.list_held_workflow_ids()) == ["wf-1", "wf-2"]


def test_renew_many_retry_that_raises_fails_only_the_retried_ids(
    make: Factory, gated: GatedStorage, clock: ManualClock, sink: WarningSink
) -> None:
    reg = make()
    for wid in ("wf-1", "wf-2"):
        assert reg.acquire(wid).status == "acquired"
    clock.advance(RENEW_MS)
    gated.raise_on_next_cas(StorageError("lost the reply"), after_commit=True, match=touches(WF))
    with pytest.raises(StorageError):
        reg.renew(WF)
    clock.advance(RENEW_MS)
    # The chunk renews wf-2 and finds wf-1 changed; the retry of wf-1 alone then raises.
    calls = {"n": 0}

    def second_batch(batches: object) -> bool:
        calls["n"] += 1
        return calls["n"] == 2

    gated.raise_on_next_cas(StorageError("retry failed"), match=second_batch)
    outcomes = reg.renew_many_outcomes(["wf-1", "wf-2"])
    assert isinstance(outcomes[0], StorageError) and "retry failed" in str(outcomes[0])
    assert isinstance(outcomes[1], RenewResult) and outcomes[1].status == "renewed"
    assert reg.current_epoch("wf-1") == 1
    assert sink.received == []
    clock.advance(RENEW_MS)
    assert [r.status for r in reg.renew_many(["wf-1", "wf-2"])] == ["renewed", "renewed"]
    assert sink.received == []


# -- folded release -----------------------------------------------------------------------


def test_prepared_release_names_the_cached_bytes_and_blocks_renewals(
    reg: ClaimRegistry, gated: GatedStorage
) -> None:
    epoch_bytes, holder_bytes = gated.get(EPOCH), gated.get(HOLDER)
    prep = reg.prepare_release_fragment(WF, expected_epoch=1)
    assert prep is not None
    assert (prep.workflow_id, prep.epoch) == (WF, 1)
    assert (prep.epoch_bytes, prep.holder_bytes) == (epoch_bytes, holder_bytes)
    assert prep.fragment.conditions == (
        Condition(EPOCH, epoch_bytes),
        Condition(HOLDER, holder_bytes),
    )
    assert prep.fragment.operations == (
        Delete(HOLDER),
        Delete(keys.workflow_owner_by_engine("engine-a", WF)),
    )
    cas = gated.transactions
    assert reg.renew(WF).status == "not-held"
    assert reg.renew_many([WF])[0].status == "not-held"
    assert gated.transactions == cas  # nothing was written while prepared
    assert gated.conditional_batch(prep.fragment.conditions, prep.fragment.operations)
    reg.finish_folded_release(WF, prep, committed=True)
    assert reg.current_epoch(WF) is None
    assert reg.list_held_workflow_ids() == []
    assert reg.renew(WF).status == "not-held"


def test_a_folded_release_that_did_not_commit_keeps_the_claim_renewable(
    reg: ClaimRegistry, gated: GatedStorage
) -> None:
    prep = reg.prepare_release_fragment(WF)
    assert prep is not None
    reg.finish_folded_release(WF, prep, committed=False)
    assert reg.current_epoch(WF) == 1
    assert reg.renew(WF).status == "renewed"
    # Finishing again changes nothing: the mark was cleared exactly once.
    reg.finish_folded_release(WF, prep, committed=True)
    assert reg.current_epoch(WF) == 1
    assert reg.renew(WF).status == "renewed"


@pytest.mark.parametrize("expected_epoch", [2, None])
def test_prepare_of_an_unheld_or_other_epoch_returns_none_and_leaves_renewals_alone(
    make: Factory, reg: ClaimRegistry, expected_epoch: int | None
) -> None:
    other = "wf-other"
    assert reg.prepare_release_fragment(WF, expected_epoch=2) is None
    assert reg.prepare_release_fragment(other, expected_epoch=expected_epoch) is None
    assert reg.renew(WF).status == "renewed"
    assert reg.acquire(other).status == "acquired"
    assert reg.renew(other).status == "renewed"


def test_prepare_waits_for_the_renewal_in_flight_and_names_its_bytes(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock
) -> None:
    clock.advance(RENEW_MS)
    gate, renewal = pause_in_cas(gated, WF, lambda: reg.renew(WF), "renew")
    preparing = start_until_logged(
        lambda: reg.prepare_release_fragment(WF), "prepare", WAITS_FOR_RENEWAL
    )
    gate.open()
    assert renewal.result().status == "renewed"
    prep = preparing.result()
    assert prep is not None
    assert prep.holder_bytes == gated.get(HOLDER)
    assert expires_at(gated, WF) == clock() + TTL_MS
    reg.finish_folded_release(WF, prep, committed=False)


def test_prepare_after_an_ambiguous_renewal_commit_names_the_value_that_landed(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock, sink: WarningSink
) -> None:
    _renew_landing_but_raising(reg, gated, clock)
    prep = reg.prepare_release_fragment(WF)
    assert prep is not None
    assert prep.holder_bytes == gated.get(HOLDER)
    assert gated.conditional_batch(prep.fragment.conditions, prep.fragment.operations)
    reg.finish_folded_release(WF, prep, committed=True)
    assert gated.get(HOLDER) is None
    assert sink.received == []


def test_finishing_a_folded_release_spares_a_newer_generation(
    reg: ClaimRegistry, gated: GatedStorage
) -> None:
    prep = reg.prepare_release_fragment(WF)
    assert prep is not None
    assert gated.conditional_batch(prep.fragment.conditions, prep.fragment.operations)
    assert reg.acquire(WF).status == "acquired"
    reg.finish_folded_release(WF, prep, committed=True)
    assert reg.current_epoch(WF) == 2
    assert reg.renew(WF).status == "renewed"


def test_finish_refuses_a_preparation_of_another_workflow_or_type(reg: ClaimRegistry) -> None:
    assert reg.acquire("wf-2").status == "acquired"
    prep = reg.prepare_release_fragment(WF)
    assert prep is not None
    with pytest.raises(ValueError, match="'wf-1', not 'wf-2'"):
        reg.finish_folded_release("wf-2", prep, committed=True)
    with pytest.raises(TypeError, match="prepare_release_fragment"):
        reg.finish_folded_release(WF, object(), committed=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="committed"):
        reg.finish_folded_release(WF, prep, committed=1)  # type: ignore[arg-type]
    reg.finish_folded_release(WF, prep, committed=False)
    assert sorted(reg.list_held_workflow_ids()) == ["wf-1", "wf-2"]
    assert isinstance(prep, ReleasePreparation)


# -- argument checks and views ------------------------------------------------------------


@pytest.mark.parametrize("ids", ["wf-1", b"wf-1", bytearray(b"wf-1")])
def test_renew_many_refuses_a_single_string_or_bytes_naming_it(
    reg: ClaimRegistry, gated: GatedStorage, ids: object
) -> None:
    before = gated.total_calls
    for method in (reg.renew_many, reg.renew_many_outcomes):
        with pytest.raises(TypeError, match="wf-1") as caught:
            method(ids)  # type: ignore[arg-type]
        assert type(ids).__name__ in str(caught.value)
    assert gated.total_calls == before


def test_forget_local_claim_with_an_expected_epoch_spares_other_generations(
    reg: ClaimRegistry, gated: GatedStorage
) -> None:
    before = gated.total_calls
    reg.forget_local_claim(WF, expected_epoch=2)
    assert reg.current_epoch(WF) == 1
    reg.forget_local_claim(WF, expected_epoch=1)
    assert reg.current_epoch(WF) is None
    assert gated.total_calls == before
    assert gated.get(HOLDER) is not None
    reg.forget_local_claim(WF, expected_epoch=1)  # nothing tracked: a no-op


@pytest.mark.parametrize("expected_epoch", ["1", 1.0, True])
def test_forget_local_claim_refuses_an_expected_epoch_that_is_not_an_int(
    reg: ClaimRegistry, expected_epoch: object
) -> None:
    with pytest.raises(TypeError, match="expected_epoch"):
        reg.forget_local_claim(WF, expected_epoch=expected_epoch)  # type: ignore[arg-type]
    assert reg.current_epoch(WF) == 1


def test_timing_and_clock_are_readable(make: Factory, clock: ManualClock) -> None:
    reg = make()
    assert (reg.clock, reg.claim_ttl_ms, reg.claim_renew_interval_ms) == (clock, TTL_MS, RENEW_MS)


def test_claim_ttl_is_capped_at_365_days(storage: Storage, clock: ManualClock) -> None:
    def build(ttl: int) -> ClaimRegistry:
        return ClaimRegistry(
            storage, engine_id="e", clock=clock, claim_ttl_ms=ttl, claim_renew_interval_ms=RENEW_MS
        )

    assert build(MAX_CLAIM_TTL_MS).claim_ttl_ms == MAX_CLAIM_TTL_MS
    with pytest.raises(ValueError, match=rf"{MAX_CLAIM_TTL_MS + 1}.*365 days"):
        build(MAX_CLAIM_TTL_MS + 1)


# -- fork ---------------------------------------------------------------------------------


def test_after_fork_in_child_forgets_everything_without_storage_io(
    reg: ClaimRegistry, gated: GatedStorage, sink: WarningSink
) -> None:
    assert reg.acquire("wf-lost").status == "acquired"
    gated.delete(keys.workflow_owner_holder("wf-lost"))
    assert reg.renew("wf-lost").status == "lost"  # starts the cooldown
    assert reg.takeover("wf-lost").status == "backoff-skipped"
    assert reg.acquire("wf-2").status == "acquired"
    prep = reg.prepare_release_fragment("wf-2")  # marks wf-2 releasing
    assert prep is not None
    gate, renewal = pause_in_cas(gated, WF, lambda: reg.renew(WF), "renew")
    # A lock held at fork time by a thread that does not exist in the child.
    reg._table.lock.acquire()
    before = gated.total_calls
    reg._after_fork_in_child()
    assert gated.total_calls == before
    assert reg.list_held_workflow_ids() == []
    assert reg.current_epoch(WF) is None
    # Returns at once: the parent's renewal in flight is not joined.
    assert reg.renew(WF).status == "not-held"
    assert reg.takeover("wf-lost").status == "no-claim"  # the cooldown is gone
    assert gated.conditional_batch(prep.fragment.conditions, prep.fragment.operations)
    assert reg.acquire("wf-2").status == "acquired"
    assert reg.renew("wf-2").status == "renewed"  # the releasing mark is gone
    gate.open()
    assert renewal.result().status == "renewed"  # the parent's renewal ends harmlessly
    assert sorted(reg.list_held_workflow_ids()) == ["wf-2"]
    assert sink.lost_ids() == ["wf-lost"]
