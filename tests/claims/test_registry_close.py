"""``ClaimRegistry.close()``: claim operations in flight are waited for, late ones give back.

Both backends; operations are paused inside their compare-and-swap with a gated store, so the
order of ``close()`` and the commit is fixed by the test, not by timing.
"""

from __future__ import annotations

import pytest

from tests.claims.gated import PAST_GRACE_MS, GatedStorage, Worker, new_registry, pause_in_cas
from tests.support.waiting import wait_until
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.errors import ClosedError
from weft_sync.storage import Storage


def test_close_waits_for_an_acquire_in_flight_and_releases_what_it_claimed(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    gate, acquiring = pause_in_cas(gated, "wf-1", lambda: reg.acquire("wf-1"), "acquirer")
    closing = Worker(lambda: reg.close(timeout=30), "closer")
    wait_until(lambda: reg.closing, "close() to begin")
    # close() is now waiting for the acquire: new operations are refused already.
    with pytest.raises(ClosedError):
        reg.acquire("wf-2")
    gate.open()
    assert acquiring.result().status == "acquired"
    closing.result()
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert storage.get(keys.workflow_owner_holder("wf-2")) is None
    assert reg.list_held_workflow_ids() == []


def test_an_acquire_that_outlives_the_close_timeout_gives_its_claim_back(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage
) -> None:
    gate, acquiring = pause_in_cas(gated, "wf-1", lambda: reg.acquire("wf-1"), "acquirer")
    reg.close(timeout=0)
    gate.open()
    with pytest.raises(ClosedError, match="released again"):
        acquiring.result()
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    # The epoch it minted stays: the next owner gets a larger one.
    assert storage.get(keys.workflow_owner_epoch("wf-1")) is not None
    assert reg.list_held_workflow_ids() == []


def test_close_releases_every_claim_and_is_idempotent(reg: ClaimRegistry, storage: Storage) -> None:
    for wid in ("wf-1", "wf-2"):
        reg.acquire(wid)
    reg.close()
    reg.close()
    assert storage.scan(keys.workflow_owner_holder("")) == []
    with pytest.raises(ClosedError):
        reg.takeover_many(["wf-1"])


def test_a_batched_takeover_that_outlives_the_close_timeout_gives_every_claim_back(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, clock: ManualClock
) -> None:
    ids = ["wf-1", "wf-2", "wf-3"]
    other = new_registry(storage, clock, "engine-b")
    for wid in ids:
        assert other.acquire(wid).status == "acquired"
    clock.advance(PAST_GRACE_MS)
    gate, taking = pause_in_cas(gated, "wf-1", lambda: reg.takeover_many(ids), "taker")
    reg.close(timeout=0)
    gate.open()
    outcomes = taking.result()
    assert [type(o) for o in outcomes] == [ClosedError] * 3
    for wid in ids:
        assert storage.get(keys.workflow_owner_holder(wid)) is None, wid
    assert reg.list_held_workflow_ids() == []
