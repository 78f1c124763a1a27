"""ClaimRegistry under real threads: shared renewals, release vs renew, identity guards, stress."""

from __future__ import annotations

import functools
import random
import threading
from collections import Counter
from collections.abc import Callable

import pytest

from tests.claims.gated import (
    JOINS_RENEWAL,
    PAST_GRACE_MS,
    RENEW_MS,
    START_MS,
    TTL_MS,
    WAITS_FOR_RENEWAL,
    GatedStorage,
    WarningSink,
    Worker,
    new_registry,
    pause_in_cas,
    start_until_logged,
    touches,
)
from tests.token_match import minted
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, decode_epoch, decode_holder, encode_epoch, encode_holder
from weft_sync.errors import StorageError
from weft_sync.storage import Storage

WF = "wf-1"
HOLDER = keys.workflow_owner_holder(WF)
EPOCH = keys.workflow_owner_epoch(WF)
Factory = Callable[..., ClaimRegistry]


@pytest.fixture
def reg(make: Factory) -> ClaimRegistry:
    """Engine A's registry, holding WF."""
    registry = make()
    assert registry.acquire(WF).status == "acquired"
    return registry


def _install_newer_expired_generation(storage: Storage, clock: ManualClock) -> None:
    """Simulate another engine that took the claim (epoch 2) and then died long ago."""
    storage.put(EPOCH, encode_epoch(2))
    storage.put(HOLDER, encode_holder(HolderRecord("engine-x", 2, START_MS, START_MS)))
    clock.advance(PAST_GRACE_MS)


def test_two_concurrent_renews_return_the_identical_result_object(
    reg: ClaimRegistry, gated: GatedStorage
) -> None:
    gate, first = pause_in_cas(gated, WF, lambda: reg.renew(WF), "renew-first")
    second = start_until_logged(lambda: reg.renew(WF), "renew-second", JOINS_RENEWAL)
    gate.open()
    one, two = first.result(), second.result()
    assert one is two
    assert one.status == "renewed"
    assert gated.transactions == 2  # the acquire and one shared renewal


def test_concurrent_renews_share_the_identical_exception(
    reg: ClaimRegistry, gated: GatedStorage, sink: WarningSink
) -> None:
    gate, first = pause_in_cas(
        gated, WF, lambda: reg.renew(WF), "renew-first", error=StorageError("flaky disk")
    )
    second = start_until_logged(lambda: reg.renew(WF), "renew-second", JOINS_RENEWAL)
    gate.open()
    one, two = first.error(), second.error()
    assert isinstance(one, StorageError)
    assert one is two
    assert sink.received == []
    assert reg.current_epoch(WF) == 1
    assert reg.renew(WF).status == "renewed"


def test_release_waits_for_a_raising_renewal_and_still_releases(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    gate, renewal = pause_in_cas(
        gated, WF, lambda: reg.renew(WF), "renew", error=StorageError("renewal failed")
    )
    release = start_until_logged(lambda: reg.release(WF), "release", WAITS_FOR_RENEWAL)
    gate.open()
    assert isinstance(renewal.error(), StorageError)
    assert release.result().status == "released"
    assert storage.get(HOLDER) is None
    assert reg.current_epoch(WF) is None


def test_release_issued_during_a_paused_renewal_waits_and_both_succeed(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    gate, renewal = pause_in_cas(gated, WF, lambda: reg.renew(WF), "renew")
    release = start_until_logged(lambda: reg.release(WF), "release", WAITS_FOR_RENEWAL)
    assert gated.transactions == 2  # the release has not committed yet
    gate.open()
    assert renewal.result().status == "renewed"
    assert release.result().status == "released"
    assert storage.get(HOLDER) is None
    assert storage.get(EPOCH) == minted(1)


def test_renew_issued_after_a_release_started_is_not_held(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    gate, release = pause_in_cas(gated, WF, lambda: reg.release(WF), "release")
    assert reg.renew(WF).status == "not-held"
    assert reg.renew_many([WF])[0].status == "not-held"
    gate.open()
    assert release.result().status == "released"
    assert storage.get(HOLDER) is None


def test_lost_renewal_leaves_alone_a_takeover_installed_while_it_was_in_flight(
    reg: ClaimRegistry,
    gated: GatedStorage,
    storage: Storage,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    gate, renewal = pause_in_cas(gated, WF, lambda: reg.renew(WF), "renew")
    _install_newer_expired_generation(storage, clock)
    takeover = reg.takeover(WF)
    assert (takeover.status, takeover.epoch) == ("acquired", 3)
    gate.open()
    assert renewal.result().status == "lost"
    assert reg.current_epoch(WF) == 3
    assert sink.lost_ids() == [WF]
    # No cooldown started: the lost renewal's entry was no longer the tracked one.
    assert reg.takeover(WF).status == "not-expired"
    assert reg.renew(WF).status == "renewed"
    assert decode_holder(storage.get(HOLDER)) == HolderRecord(
        "engine-a", 3, clock() + TTL_MS, clock()
    )


def test_raising_release_leaves_alone_a_takeover_installed_while_it_was_in_flight(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, clock: ManualClock
) -> None:
    gate, release = pause_in_cas(
        gated, WF, lambda: reg.release(WF), "release", error=StorageError("network")
    )
    _install_newer_expired_generation(storage, clock)
    assert reg.takeover(WF).epoch == 3
    gate.open()
    assert isinstance(release.error(), StorageError)
    assert reg.current_epoch(WF) == 3
    assert decode_holder(storage.get(HOLDER)) is not None


def test_lost_release_leaves_alone_a_takeover_installed_while_it_was_in_flight(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, clock: ManualClock
) -> None:
    gate, release = pause_in_cas(gated, WF, lambda: reg.release(WF), "release")
    _install_newer_expired_generation(storage, clock)
    assert reg.takeover(WF).epoch == 3
    gate.open()
    assert release.result().status == "lost-race"
    assert reg.current_epoch(WF) == 3


def test_release_all_during_a_paused_renewal_releases_after_it(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    reg.acquire("wf-2")
    gate, renewal = pause_in_cas(gated, WF, lambda: reg.renew(WF), "renew")
    release_all = start_until_logged(reg.release_all, "release-all", WAITS_FOR_RENEWAL)
    gate.open()
    assert renewal.result().status == "renewed"
    release_all.result()
    assert reg.list_held_workflow_ids() == []
    assert storage.get(HOLDER) is None
    assert storage.get(keys.workflow_owner_holder("wf-2")) is None


def test_release_all_releases_claims_concurrently(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    reg.acquire("wf-2")
    gates = [gated.pause_next_cas(match=touches(w)) for w in (WF, "wf-2")]
    release_all = Worker(reg.release_all, "release-all")
    # Both releases are inside their commits at once, which a serial loop could not do.
    for gate in gates:
        gate.wait_reached()
    for gate in gates:
        gate.open()
    release_all.result()
    assert reg.list_held_workflow_ids() == []
    assert storage.get(HOLDER) is None
    assert storage.get(keys.workflow_owner_holder("wf-2")) is None


# -- stress -------------------------------------------------------------------------------

STRESS_OPERATIONS = 250
"""Operations per thread: a fixed amount of work, whatever the machine's speed."""
STRESS_IDS = [f"wf-{n}" for n in range(12)]


def _random_operation(
    rng: random.Random, registries: list[ClaimRegistry], clock: ManualClock
) -> Callable[[], object]:
    reg = rng.choice(registries)
    wid = rng.choice(STRESS_IDS)
    choice = rng.random()
    if choice < 0.2:
        return lambda: reg.acquire(wid)
    if choice < 0.4:
        return lambda: reg.renew(wid)
    if choice < 0.5:
        ids = rng.sample(STRESS_IDS, rng.randint(1, 6))
        chunk_size = rng.randint(1, 4)
        return lambda: reg.renew_many(ids, chunk_size=chunk_size)
    if choice < 0.65:
        return lambda: reg.release(wid)
    if choice < 0.85:
        return lambda: reg.takeover(wid)
    if choice < 0.88:
        return lambda: reg.forget_local_claim(wid)
    step = rng.randint(0, 4 * RENEW_MS)
    return lambda: clock.advance(step)


def test_random_concurrent_operations_never_leave_two_believers(
    open_store: Callable[[], Storage],
) -> None:
    clock = ManualClock(START_MS)
    sinks = [WarningSink() for _ in range(3)]
    registries = [new_registry(open_store(), clock, f"engine-{n}", sinks[n]) for n in range(3)]
    start = threading.Barrier(8)

    def run(index: int) -> Counter[str]:
        rng = random.Random(index)
        seen: Counter[str] = Counter()
        start.wait()
        for _ in range(STRESS_OPERATIONS):
            try:
                result = _random_operation(rng, registries, clock)()
            except StorageError as exc:
                # A row lock waited for past the store's lock_timeout (at most 1 s) on a loaded
                # machine fails that one call, as documented; no other error may.
                if "lock timeout" not in str(exc):
                    raise
                seen["lock-timeout"] += 1
                continue
            for item in result if isinstance(result, list) else [result]:
                seen[str(getattr(item, "status", "other"))] += 1
        return seen

    workers = [Worker(functools.partial(run, n), f"stress-{n}") for n in range(8)]
    seen = sum((worker.result(timeout=60) for worker in workers), Counter[str]())
    # The mix really exercised contention, not just uncontested calls.
    assert seen["acquired"] > 0
    assert seen["lost-race"] > 0
    assert seen["renewed"] > 0
    assert seen["lost"] > 0

    store = open_store()
    for wid in STRESS_IDS:
        stored_epoch = decode_epoch(store.get(keys.workflow_owner_epoch(wid)))
        holder = decode_holder(store.get(keys.workflow_owner_holder(wid)))
        believers = [
            r
            for r in registries
            if stored_epoch is not None and r.current_epoch(wid) == stored_epoch
        ]
        assert len(believers) <= 1, wid
        for believer in believers:
            assert holder is not None
            assert (holder.engine_id, holder.epoch) == (believer.engine_id, stored_epoch)
        for r in registries:
            tracked = r.current_epoch(wid) is not None
            expected = "renewed" if r in believers else "lost" if tracked else "not-held"
            assert r.renew(wid).status == expected, (wid, r.engine_id)
