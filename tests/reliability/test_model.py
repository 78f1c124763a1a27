"""Model-based test: three registries on one store against a reference model of the claim rules.

A hypothesis state machine drives three :class:`ClaimRegistry` instances — each on its own
storage instance of one shared store — and a shared :class:`ManualClock` through random acquires,
folded acquires, renewals (single and batched), releases, takeovers, forgets, clock moves and
external epoch rotations committed straight to the store. A small pure-Python model predicts
every result; after every step the test checks the store against the model and these invariants:

- at most one live owner per workflow: one registry at most believes it holds the stored epoch
  *and* wrote the stored holder bytes, and no two registries believe in the same epoch;
- the epoch key never goes down, every new owner generation gets a strictly larger epoch, and a
  replaced generation never comes back;
- a present holder has a present epoch key, and its ``epoch`` field equals the decoded key;
- a registry's belief is never newer than the store (cached epoch <= stored epoch);
- each lost claim produced exactly one warning;
- the by-engine index is exact: every holder has its engine's entry at its epoch, and no entry
  outlives its holder (a takeover moves the entry to the new engine).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.claims.gated import WarningSink
from tests.claims.index_checks import assert_index_exact
from tests.token_match import minted
from weft_sync import keys
from weft_sync.claims import ClaimRegistry, TakeoverResult, build_external_rotation_transition
from weft_sync.claims.engine_index import release_entry_ops
from weft_sync.clock import ManualClock
from weft_sync.codec import (
    HolderRecord,
    decode_epoch,
    decode_holder,
    encode_holder,
)
from weft_sync.storage import Storage, open_storage

TTL_MS = 3_000
RENEW_MS = 1_000
START_MS = 1_000_000
ENGINES = ("engine-0", "engine-1", "engine-2")
NAMES = ("alpha", "beta", "gamma")
MACHINE_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
POSTGRES_SETTINGS = settings(MACHINE_SETTINGS, max_examples=40)

_runs = itertools.count()

registries = st.integers(0, len(ENGINES) - 1)
names = st.sampled_from(NAMES)
clock_moves = st.sampled_from(
    [0, 1, RENEW_MS, TTL_MS, TTL_MS + 2 * RENEW_MS, TTL_MS + 2 * RENEW_MS + 1, 3 * TTL_MS]
)


@dataclass
class Model:
    """The store and each registry's view as the claim rules say they must be."""

    epoch: dict[str, int] = field(default_factory=dict)
    holder: dict[str, HolderRecord] = field(default_factory=dict)
    beliefs: list[dict[str, HolderRecord]] = field(default_factory=lambda: [{} for _ in ENGINES])
    cooldown_until: list[dict[str, int]] = field(default_factory=lambda: [{} for _ in ENGINES])
    lost: list[Counter[str]] = field(default_factory=lambda: [Counter() for _ in ENGINES])

    def mint(self, wid: str, engine: int, now: int) -> HolderRecord:
        record = HolderRecord(ENGINES[engine], self.epoch.get(wid, 0) + 1, now + TTL_MS, now)
        self.epoch[wid] = record.epoch
        self.holder[wid] = record
        self.beliefs[engine][wid] = record
        self.cooldown_until[engine].pop(wid, None)
        return record

    def renew(self, engine: int, wid: str, now: int) -> str:
        belief = self.beliefs[engine].get(wid)
        if belief is None:
            return "not-held"
        if self.holder.get(wid) != belief:
            del self.beliefs[engine][wid]
            self.cooldown_until[engine][wid] = now + RENEW_MS
            self.lost[engine][wid] += 1
            return "lost"
        renewed = HolderRecord(belief.engine_id, belief.epoch, now + TTL_MS, belief.claimed_at)
        self.holder[wid] = renewed
        self.beliefs[engine][wid] = renewed
        return "renewed"


class ClaimMachine(RuleBasedStateMachine):
    """Base machine; :func:`machine_for` binds it to the stores of one backend."""

    stores: tuple[Storage, ...] = ()
    observer: Storage

    def __init__(self) -> None:
        super().__init__()
        run = next(_runs)
        self.ids = {name: f"run{run}/{name}" for name in NAMES}
        self.clock = ManualClock(START_MS)
        self.sinks = [WarningSink() for _ in ENGINES]
        self.registries = [
            ClaimRegistry(
                store,
                engine_id=engine,
                clock=self.clock,
                claim_ttl_ms=TTL_MS,
                claim_renew_interval_ms=RENEW_MS,
                warn=sink,
            )
            for store, engine, sink in zip(self.stores, ENGINES, self.sinks, strict=True)
        ]
        self.model = Model()
        self.max_epoch: dict[str, int] = {}
        self.generation: dict[str, tuple[str, int] | None] = {}
        self.retired: dict[str, set[tuple[str, int]]] = {name: set() for name in NAMES}

    @initialize()
    def start_empty(self) -> None:
        for wid in self.ids.values():
            assert self.observer.get(keys.workflow_owner_epoch(wid)) is None

    # -- rules -----------------------------------------------------------------------------

    @rule(engine=registries, name=names)
    def acquire(self, engine: int, name: str) -> None:
        wid, now = self.ids[name], self.clock()
        result = self.registries[engine].acquire(wid)
        present = self.model.holder.get(wid)
        if present is None:
            record = self.model.mint(wid, engine, now)
            assert (result.status, result.epoch) == ("acquired", record.epoch)
        else:
            assert (result.status, result.held_by) == ("lost-race", present.engine_id)

    @rule(engine=registries, name=names)
    def folded_acquire(self, engine: int, name: str) -> None:
        wid, now = self.ids[name], self.clock()
        registry = self.registries[engine]
        preparation = registry.prepare_acquire_fragment(wid)
        fragment = preparation.fragment
        committed = registry.storage.conditional_batch(fragment.conditions, fragment.operations)
        if self.model.holder.get(wid) is None:
            record = self.model.mint(wid, engine, now)
            assert committed
            assert (preparation.epoch, preparation.claimed_at) == (record.epoch, now)
            registry.record_folded_acquire(wid, preparation)
        else:
            assert not committed

    @rule(engine=registries, name=names)
    def renew(self, engine: int, name: str) -> None:
        wid, now = self.ids[name], self.clock()
        result = self.registries[engine].renew(wid)
        assert result.status == self.model.renew(engine, wid, now)

    @rule(engine=registries, chosen=st.lists(names, max_size=5))
    def renew_many(self, engine: int, chosen: list[str]) -> None:
        wids = [self.ids[name] for name in chosen]
        now = self.clock()
        results = self.registries[engine].renew_many(wids)
        expected = {wid: self.model.renew(engine, wid, now) for wid in dict.fromkeys(wids)}
        assert [r.status for r in results] == [expected[wid] for wid in wids]
        assert [r.workflow_id for r in results] == wids
        first = {wid: results[wids.index(wid)] for wid in expected}
        assert all(result is first[wid] for wid, result in zip(wids, results, strict=True))

    @rule(engine=registries, name=names, expected_epoch=st.none() | st.integers(1, 6))
    def release(self, engine: int, name: str, expected_epoch: int | None) -> None:
        wid = self.ids[name]
        result = self.registries[engine].release(wid, expected_epoch=expected_epoch)
        belief = self.model.beliefs[engine].get(wid)
        if belief is None or (expected_epoch is not None and expected_epoch != belief.epoch):
            assert result.status == "not-held"
            return
        del self.model.beliefs[engine][wid]
        if self.model.holder.get(wid) == belief and self.model.epoch.get(wid) == belief.epoch:
            del self.model.holder[wid]
            assert result.status == "released"
        else:
            assert result.status == "lost-race"

    @rule(engine=registries, name=names)
    def takeover(self, engine: int, name: str) -> None:
        wid, now = self.ids[name], self.clock()
        result = self.registries[engine].takeover(wid)
        self.check_takeover(engine, wid, now, result)

    @rule(engine=registries, chosen=st.lists(names, max_size=5), chunk_size=st.integers(1, 3))
    def takeover_many(self, engine: int, chosen: list[str], chunk_size: int) -> None:
        wids = [self.ids[name] for name in chosen]
        now = self.clock()
        results = self.registries[engine].takeover_many(wids, chunk_size=chunk_size)
        assert [r.workflow_id for r in results if isinstance(r, TakeoverResult)] == wids
        first = {wid: results[wids.index(wid)] for wid in dict.fromkeys(wids)}
        assert all(result is first[wid] for wid, result in zip(wids, results, strict=True))
        for wid, result in first.items():
            assert isinstance(result, TakeoverResult)
            self.check_takeover(engine, wid, now, result)

    def check_takeover(self, engine: int, wid: str, now: int, result: TakeoverResult) -> None:
        """Assert the takeover the model predicts, and apply it to the model."""
        present = self.model.holder.get(wid)
        if now < self.model.cooldown_until[engine].get(wid, now):
            assert result.status == "backoff-skipped"
        elif present is None:
            assert result.status == "no-claim"
        elif present.expires_at + 2 * RENEW_MS >= now:
            assert (result.status, result.held_by, result.expires_at) == (
                "not-expired",
                present.engine_id,
                present.expires_at,
            )
        else:
            record = self.model.mint(wid, engine, now)
            assert (result.status, result.epoch) == ("acquired", record.epoch)

    @rule(engine=registries, name=names)
    def forget_local_claim(self, engine: int, name: str) -> None:
        wid = self.ids[name]
        self.registries[engine].forget_local_claim(wid)
        self.model.beliefs[engine].pop(wid, None)

    @rule(name=names)
    def rotate_externally(self, name: str) -> None:
        wid = self.ids[name]
        observed = self.observer.get(keys.workflow_owner_epoch(wid))
        holder = self.observer.get(keys.workflow_owner_holder(wid))
        fragment = build_external_rotation_transition(
            workflow_id=wid, observed_epoch_bytes=observed
        )
        # As the ledger's external commits do: the deleted holder's by-engine entry goes too.
        operations = [*fragment.operations, *release_entry_ops(wid, holder)]
        assert self.observer.conditional_batch(fragment.conditions, operations)
        self.model.epoch[wid] = self.model.epoch.get(wid, 0) + 1
        self.model.holder.pop(wid, None)

    # Targeted rules: act on claims that exist, so releases, renewals and takeovers meet live
    # and stale beliefs often rather than mostly "not-held" / "no-claim".

    def believed(self) -> list[tuple[int, str]]:
        return [
            (n, name)
            for n, beliefs in enumerate(self.model.beliefs)
            for name, wid in self.ids.items()
            if wid in beliefs
        ]

    def held_elsewhere(self) -> list[tuple[int, str]]:
        return [
            (n, name)
            for name, wid in self.ids.items()
            if wid in self.model.holder
            for n, engine in enumerate(ENGINES)
            if engine != self.model.holder[wid].engine_id
        ]

    @precondition(lambda self: bool(self.believed()))
    @rule(data=st.data(), by_epoch=st.booleans())
    def release_a_believed_claim(self, data: st.DataObject, by_epoch: bool) -> None:
        engine, name = data.draw(st.sampled_from(self.believed()))
        belief = self.model.beliefs[engine][self.ids[name]]
        self.release(engine, name, belief.epoch if by_epoch else None)

    @precondition(lambda self: bool(self.believed()))
    @rule(data=st.data(), then_take_over=st.booleans())
    def renew_a_believed_claim(self, data: st.DataObject, then_take_over: bool) -> None:
        engine, name = data.draw(st.sampled_from(self.believed()))
        self.renew(engine, name)
        if then_take_over:
            self.takeover(engine, name)

    @precondition(lambda self: bool(self.held_elsewhere()))
    @rule(data=st.data(), ms=clock_moves)
    def take_over_a_claim_held_elsewhere(self, data: st.DataObject, ms: int) -> None:
        engine, name = data.draw(st.sampled_from(self.held_elsewhere()))
        self.clock.advance(ms)
        self.takeover(engine, name)

    @precondition(lambda self: bool(self.believed()))
    @rule(data=st.data(), rotate=st.booleans(), then_take_over=st.booleans())
    def depose_a_believer_then_let_it_renew(
        self, data: st.DataObject, rotate: bool, then_take_over: bool
    ) -> None:
        engine, name = data.draw(st.sampled_from(self.believed()))
        if rotate:
            self.rotate_externally(name)
        else:
            other = data.draw(st.sampled_from([n for n in range(len(ENGINES)) if n != engine]))
            self.clock.advance(TTL_MS + 2 * RENEW_MS + 1)
            self.takeover(other, name)
        self.renew(engine, name)
        if then_take_over:
            self.takeover(engine, name)

    @rule(ms=clock_moves)
    def advance_clock(self, ms: int) -> None:
        self.clock.advance(ms)

    # -- invariants ------------------------------------------------------------------------

    def read_store(self) -> dict[str, tuple[bytes | None, bytes | None]]:
        """The raw ``(epoch, holder)`` bytes of every workflow of this run, read from the store."""
        return {
            wid: (
                self.observer.get(keys.workflow_owner_epoch(wid)),
                self.observer.get(keys.workflow_owner_holder(wid)),
            )
            for wid in self.ids.values()
        }

    @invariant()
    def claim_invariants(self) -> None:
        stored = self.read_store()
        self.store_matches_the_model(stored)
        self.at_most_one_live_owner(stored)
        self.epochs_only_grow_with_each_new_owner(stored)
        assert_index_exact(self.observer)

    def store_matches_the_model(self, stored: dict[str, tuple[bytes | None, bytes | None]]) -> None:
        for wid, (raw_epoch, raw_holder) in stored.items():
            epoch = decode_epoch(raw_epoch)
            holder = decode_holder(raw_holder)
            assert (raw_epoch is None) == (epoch is None), f"undecodable epoch {raw_epoch!r}"
            assert (raw_holder is None) == (holder is None), f"undecodable holder {raw_holder!r}"
            if holder is not None:
                assert epoch is not None, f"{wid}: a holder without an epoch key"
                assert holder.epoch == epoch, f"{wid}: holder epoch {holder.epoch} != key {epoch}"
            assert epoch == self.model.epoch.get(wid)
            assert holder == self.model.holder.get(wid)

    def at_most_one_live_owner(self, stored: dict[str, tuple[bytes | None, bytes | None]]) -> None:
        for wid, (raw_epoch, raw_holder) in stored.items():
            stored_epoch = decode_epoch(raw_epoch)
            believed: list[int] = []
            live: list[str] = []
            for n, registry in enumerate(self.registries):
                epoch = registry.current_epoch(wid)
                belief = self.model.beliefs[n].get(wid)
                assert epoch == (None if belief is None else belief.epoch)
                if epoch is None or belief is None:
                    assert registry.current_epoch_bytes(wid) is None
                    continue
                assert registry.current_epoch_bytes(wid) == minted(epoch)
                assert stored_epoch is not None and epoch <= stored_epoch, (
                    f"{registry.engine_id} believes {wid} is at epoch {epoch}, the store says "
                    f"{stored_epoch}"
                )
                believed.append(epoch)
                if epoch == stored_epoch and encode_holder(belief) == raw_holder:
                    live.append(registry.engine_id)
            assert len(believed) == len(set(believed)), f"{wid}: shared epochs {believed}"
            assert len(live) <= 1, f"{wid}: several live owners {live}"
            if live:
                holder = decode_holder(raw_holder)
                assert holder is not None and holder.engine_id == live[0]

    def epochs_only_grow_with_each_new_owner(
        self, stored: dict[str, tuple[bytes | None, bytes | None]]
    ) -> None:
        for name, wid in self.ids.items():
            raw_epoch, raw_holder = stored[wid]
            epoch = decode_epoch(raw_epoch) or 0
            holder = decode_holder(raw_holder)
            previous_max = self.max_epoch.get(wid, 0)
            assert epoch >= previous_max, f"{wid}: epoch went from {previous_max} to {epoch}"
            generation = None if holder is None else (holder.engine_id, holder.epoch)
            before = self.generation.get(wid)
            if generation != before:
                if before is not None:
                    self.retired[name].add(before)
                if generation is not None:
                    assert generation not in self.retired[name], f"{wid}: {generation} returned"
                    assert generation[1] > previous_max, (
                        f"{wid}: new owner {generation} did not raise the epoch past {previous_max}"
                    )
            self.generation[wid] = generation
            self.max_epoch[wid] = epoch

    @invariant()
    def each_lost_claim_warned_once(self) -> None:
        for sink, expected in zip(self.sinks, self.model.lost, strict=True):
            assert Counter(sink.lost_ids()) == expected


def machine_for(stores: tuple[Storage, ...], observer: Storage) -> type[ClaimMachine]:
    """A :class:`ClaimMachine` subclass whose registries use ``stores``."""
    return type("ClaimMachineOnStore", (ClaimMachine,), {"stores": stores, "observer": observer})


@pytest.fixture
def shared_stores(backend: str, storage_url: str) -> Iterator[Callable[[], Storage]]:
    """Open instances of one store; SQLite skips fsync on commit to keep the run short."""
    url = storage_url + "&synchronous=NORMAL" if backend == "sqlite" else storage_url
    opened: list[Storage] = []

    def open_one() -> Storage:
        store = open_storage(url)
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()


def test_three_registries_on_one_store_follow_the_claim_rules(
    backend: str, shared_stores: Callable[[], Storage]
) -> None:
    stores = tuple(shared_stores() for _ in ENGINES)
    machine = machine_for(stores, shared_stores())
    # Every step is a few network round trips on PostgreSQL: fewer examples keep it to seconds.
    run_settings = MACHINE_SETTINGS if backend == "sqlite" else POSTGRES_SETTINGS
    run_state_machine_as_test(machine, settings=run_settings)  # type: ignore[no-untyped-call]


def test_the_store_check_notices_a_write_behind_the_models_back(
    shared_stores: Callable[[], Storage],
) -> None:
    stores = tuple(shared_stores() for _ in ENGINES)
    machine = machine_for(stores, shared_stores())()
    machine.start_empty()
    machine.acquire(0, "alpha")
    machine.claim_invariants()
    wid = machine.ids["alpha"]
    observed = machine.observer.get(keys.workflow_owner_epoch(wid))
    fragment = build_external_rotation_transition(workflow_id=wid, observed_epoch_bytes=observed)
    assert machine.observer.conditional_batch(fragment.conditions, fragment.operations)
    with pytest.raises(AssertionError):
        machine.claim_invariants()
