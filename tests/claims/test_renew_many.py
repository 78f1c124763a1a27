"""Batched renewal: ``renew_many`` gives each id what ``renew`` would, in few transactions."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.claims.gated import (
    JOINS_RENEWAL,
    RENEW_MS,
    START_MS,
    TTL_MS,
    BatchesOnly,
    GatedStorage,
    WarningSink,
    hold_folded,
    new_registry,
    pause_in_cas,
    start_until_logged,
    steal_holder,
    touches,
)
from tests.token_match import epoch_numbers, token_shape
from tests.workflows.helpers import expires_at
from weft_sync import keys
from weft_sync.claims.registry import DEFAULT_RENEW_CHUNK_SIZE, ClaimRegistry
from weft_sync.claims.transitions import build_external_rotation_transition
from weft_sync.clock import ManualClock
from weft_sync.errors import StorageCapabilityError, StorageError
from weft_sync.storage import SqliteStorage, Storage


def test_each_id_gets_the_outcome_renew_would_give_it(
    reg: ClaimRegistry, storage: Storage, clock: ManualClock, sink: WarningSink
) -> None:
    hold_folded(reg, storage, ["held", "stolen"])
    steal_holder(storage, "stolen")
    clock.advance(3 * RENEW_MS)
    results = reg.renew_many(["held", "stolen", "never"])
    assert [(r.workflow_id, r.status) for r in results] == [
        ("held", "renewed"),
        ("stolen", "lost"),
        ("never", "not-held"),
    ]
    assert sink.lost_ids() == ["stolen"]
    assert reg.list_held_workflow_ids() == ["held"]
    assert expires_at(storage, "held") == clock() + TTL_MS
    assert reg.takeover("stolen").status == "backoff-skipped"
    assert reg.renew("held").status == "renewed"


def test_a_repeated_id_is_renewed_once_and_shares_its_result_object(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, sink: WarningSink
) -> None:
    hold_folded(reg, storage, ["a", "b"])
    steal_holder(storage, "b")
    before = gated.transactions
    results = reg.renew_many(["a", "b", "a", "b"])
    assert results[0] is results[2]
    assert results[1] is results[3]
    assert [r.status for r in results] == ["renewed", "lost", "renewed", "lost"]
    assert sink.lost_ids() == ["b"]
    assert gated.transactions - before == 1


def test_renewing_held_claims_takes_one_transaction_per_chunk(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, clock: ManualClock
) -> None:
    ids = [f"wf-{n:04d}" for n in range(DEFAULT_RENEW_CHUNK_SIZE + 1)]
    hold_folded(reg, storage, ids)
    clock.advance(RENEW_MS)
    before = gated.transactions
    results = reg.renew_many(ids)
    assert gated.transactions - before == 2
    assert gated.calls["compare_and_set_many"] == 2
    assert all(r.status == "renewed" for r in results)
    assert expires_at(storage, ids[-1]) == clock() + TTL_MS
    before = gated.transactions
    reg.renew_many(ids[:500], chunk_size=100)
    assert gated.transactions - before == 5


def test_renew_many_through_a_store_without_compare_and_set_many_gives_the_same_outcomes(
    storage: Storage, clock: ManualClock, sink: WarningSink
) -> None:
    plain = BatchesOnly(storage)
    reg = new_registry(plain, clock, "engine-a", warn=sink)  # type: ignore[arg-type]
    hold_folded(reg, storage, ["held", "stolen"])
    steal_holder(storage, "stolen")
    clock.advance(RENEW_MS)
    results = reg.renew_many(["held", "stolen", "never"])
    assert [r.status for r in results] == ["renewed", "lost", "not-held"]
    assert plain.batches_calls == 1
    assert sink.lost_ids() == ["stolen"]
    assert expires_at(storage, "held") == clock() + TTL_MS


def test_a_failing_chunk_fails_only_its_own_ids(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, clock: ManualClock, sink: WarningSink
) -> None:
    ids = [f"wf-{n}" for n in range(6)]
    hold_folded(reg, storage, ids)
    clock.advance(RENEW_MS)
    error = StorageError("chunk two failed")
    gated.raise_on_next_cas(error, match=touches("wf-2"))
    outcomes = reg.renew_many_outcomes(ids, chunk_size=2)
    assert outcomes[2] is error
    assert outcomes[3] is error
    assert [getattr(o, "status", None) for o in outcomes] == [
        "renewed",
        "renewed",
        None,
        None,
        "renewed",
        "renewed",
    ]
    assert expires_at(storage, "wf-2") == START_MS + TTL_MS
    assert expires_at(storage, "wf-5") == clock() + TTL_MS
    assert sorted(reg.list_held_workflow_ids()) == ids
    assert sink.received == []
    assert reg.renew("wf-2").status == "renewed"


def test_renew_many_raises_the_first_chunk_error_after_attempting_every_chunk(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, clock: ManualClock
) -> None:
    ids = [f"wf-{n}" for n in range(6)]
    hold_folded(reg, storage, ids)
    clock.advance(RENEW_MS)
    gated.raise_on_next_cas(StorageError("first"), match=touches("wf-0"))
    gated.raise_on_next_cas(StorageError("second"), match=touches("wf-2"))
    with pytest.raises(StorageError, match="first"):
        reg.renew_many(ids, chunk_size=2)
    assert expires_at(storage, "wf-4") == clock() + TTL_MS
    assert expires_at(storage, "wf-5") == clock() + TTL_MS


def test_renew_many_waits_for_a_renewal_another_caller_has_in_flight(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    hold_folded(reg, storage, ["wf-1", "wf-2"])
    single_gate, single = pause_in_cas(gated, "wf-1", lambda: reg.renew("wf-1"), "renew")
    # The batch arrives at its own commit only after registering as a waiter on wf-1.
    batch_gate, batch = pause_in_cas(
        gated, "wf-2", lambda: reg.renew_many(["wf-1", "wf-2"]), "renew-many"
    )
    batch_gate.open()
    single_gate.open()
    single_result = single.result()
    batch_results = batch.result()
    assert batch_results[0] is single_result
    assert batch_results[1].status == "renewed"
    assert gated.calls["compare_and_set_many"] == 1  # the batch committed wf-2 alone


def test_renew_shares_a_renewal_that_renew_many_has_in_flight(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    hold_folded(reg, storage, ["wf-1", "wf-2"])
    gate, batch = pause_in_cas(
        gated, "wf-1", lambda: reg.renew_many(["wf-1", "wf-2"]), "renew-many"
    )
    single = start_until_logged(lambda: reg.renew("wf-1"), "renew", JOINS_RENEWAL)
    gate.open()
    assert single.result() is batch.result()[0]
    assert gated.calls["conditional_batch"] == 0


def test_a_chunk_error_reaches_a_renew_sharing_that_renewal(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    hold_folded(reg, storage, ["wf-1"])
    error = StorageError("batch failed")
    gate, batch = pause_in_cas(
        gated, "wf-1", lambda: reg.renew_many_outcomes(["wf-1"]), "renew-many", error=error
    )
    single = start_until_logged(lambda: reg.renew("wf-1"), "renew", JOINS_RENEWAL)
    gate.open()
    assert single.error() is error
    assert batch.result() == [error]


def test_renew_many_of_nothing_does_nothing(reg: ClaimRegistry, gated: GatedStorage) -> None:
    assert reg.renew_many([]) == []
    assert reg.renew_many(["untracked"])[0].status == "not-held"
    assert gated.total_calls == 0


@pytest.mark.parametrize("chunk_size", [0, -1, 2.5, True])
def test_renew_many_rejects_a_bad_chunk_size(reg: ClaimRegistry, chunk_size: object) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        reg.renew_many(["a"], chunk_size=chunk_size)  # type: ignore[arg-type]


def test_renew_many_on_a_store_without_compare_and_swap_is_refused(
    reg: ClaimRegistry, storage: Storage, clock: ManualClock
) -> None:
    hold_folded(reg, storage, ["a"])
    refusing = new_registry(GatedStorage(storage, conditional_batch=False), clock, "engine-z")
    hold_folded(refusing, storage, ["b"])
    with pytest.raises(StorageCapabilityError, match="conditional_batch"):
        refusing.renew_many(["b"])
    assert refusing.current_epoch("b") == 1


def test_a_raising_warning_sink_fails_only_the_id_it_was_reporting(
    storage: Storage, clock: ManualClock
) -> None:
    heard: list[str] = []

    def sink(warning: Warning) -> None:
        heard.append(getattr(warning, "workflow_id", "?"))
        raise RuntimeError("sink failed")

    reg = new_registry(storage, clock, warn=sink)
    hold_folded(reg, storage, ["a", "b", "c"])
    steal_holder(storage, "a")
    steal_holder(storage, "b")
    outcomes = reg.renew_many_outcomes(["a", "b", "c"])
    assert heard == ["a", "b"]
    assert isinstance(outcomes[0], RuntimeError)
    assert isinstance(outcomes[1], RuntimeError)
    assert getattr(outcomes[2], "status", None) == "renewed"
    assert reg.list_held_workflow_ids() == ["c"]
    steal_holder(storage, "c")
    with pytest.raises(RuntimeError, match="sink failed"):
        reg.renew_many(["a", "c"])
    assert heard == ["a", "b", "c"]


# -- property: renew_many == sequential renew ---------------------------------------------

IDS = ["a", "b", "c", "d", "e"]
ENGINES = ["engine-a", "engine-b", "engine-c"]

_step = st.one_of(
    st.tuples(
        st.sampled_from(["acquire", "takeover", "release", "renew"]),
        st.integers(0, len(ENGINES) - 1),
        st.sampled_from(IDS),
    ),
    st.tuples(st.just("advance"), st.integers(0, 6 * RENEW_MS), st.just("")),
    st.tuples(st.sampled_from(["rotate", "garbage"]), st.just(0), st.sampled_from(IDS)),
)


class _World:
    """One store with three registries driven through the same history."""

    def __init__(self, path: Path) -> None:
        self.store = SqliteStorage(path)
        self.clock = ManualClock(START_MS)
        self.sinks = [WarningSink() for _ in ENGINES]
        self.registries = [
            new_registry(self.store, self.clock, engine, sink)
            for engine, sink in zip(ENGINES, self.sinks, strict=True)
        ]

    def apply(self, step: tuple[str, int, str]) -> None:
        kind, number, wid = step
        if kind == "advance":
            self.clock.advance(number)
        elif kind == "rotate":
            observed = self.store.get(keys.workflow_owner_epoch(wid))
            fragment = build_external_rotation_transition(
                workflow_id=wid, observed_epoch_bytes=observed
            )
            self.store.conditional_batch(fragment.conditions, fragment.operations)
        elif kind == "garbage":
            self.store.put(keys.workflow_owner_holder(wid), b"\x92garbage")
        else:
            getattr(self.registries[number], kind)(wid)

    def local_state(self) -> list[tuple[str, int | None, object]]:
        ours = self.registries[0]
        return [(w, ours.current_epoch(w), token_shape(ours.current_epoch_bytes(w))) for w in IDS]


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    held=st.lists(st.sampled_from(IDS), unique=True),
    history=st.lists(_step, max_size=12),
    ids=st.lists(st.sampled_from([*IDS, "untracked"]), unique=True, min_size=1),
    chunk_size=st.integers(1, 3),
)
def test_renew_many_matches_sequential_renew_on_an_identical_store(
    held: list[str], history: list[tuple[str, int, str]], ids: list[str], chunk_size: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        batched, sequential = _World(Path(tmp) / "one.db"), _World(Path(tmp) / "two.db")
        try:
            for step in [("acquire", 0, wid) for wid in held] + history:
                batched.apply(step)
                sequential.apply(step)
            for world in (batched, sequential):
                world.sinks[0].received.clear()
            ours_batched, ours_sequential = batched.registries[0], sequential.registries[0]

            many = ours_batched.renew_many(ids, chunk_size=chunk_size)
            one_by_one = [ours_sequential.renew(wid) for wid in ids]

            assert many == one_by_one
            assert batched.sinks[0].lost_ids() == sequential.sinks[0].lost_ids()
            assert batched.local_state() == sequential.local_state()
            assert epoch_numbers(batched.store.scan("")) == epoch_numbers(sequential.store.scan(""))
            # Releasing proves the cached holder bytes match too (release conditions on them).
            released = [ours_batched.release(w) for w in IDS]
            assert released == [ours_sequential.release(w) for w in IDS]
            assert epoch_numbers(batched.store.scan("")) == epoch_numbers(sequential.store.scan(""))
        finally:
            batched.store.close()
            sequential.store.close()
