"""A takeover whose commit waited long for the store does not leave an already-expired holder.

The takeover reads its clock, then commits; a commit stalled behind another writer's lock for
longer than one renew interval wrote ``now + ttl`` from a clock reading that is old by then.
The clock is read again after the commit and such holders renewed at once. The stall is the
test clock moving while the commit waits (``before_next_cas``), on both real backends.
"""

from __future__ import annotations

from tests.claims.conftest import Factory
from tests.claims.gated import PAST_GRACE_MS, RENEW_MS, TTL_MS, GatedStorage
from tests.workflows.helpers import expires_at, holder_engine
from weft_sync.clock import ManualClock
from weft_sync.storage import Storage

# Longer than the TTL and its grace: the holder as first written could be taken over at once.
STALL_MS = TTL_MS + 3 * RENEW_MS


def test_a_takeover_that_stalled_past_the_ttl_is_renewed_from_a_fresh_clock(
    make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    old, new = make("engine-a"), make("engine-b")
    assert old.acquire("wf-1").status == "acquired"
    clock.advance(PAST_GRACE_MS)
    gated.before_next_cas(lambda: clock.advance(STALL_MS))

    result = new.takeover("wf-1")

    assert result.status == "acquired" and result.epoch == 2
    stored = expires_at(gated, "wf-1")
    assert stored is not None and stored > clock() + TTL_MS - RENEW_MS
    assert holder_engine(gated, "wf-1") == "engine-b"
    # The registry tracks the renewed bytes: its next renewal succeeds.
    assert new.renew("wf-1").status == "renewed"


def test_a_batched_takeover_that_stalled_is_renewed_too(
    make: Factory, gated: GatedStorage, clock: ManualClock
) -> None:
    old, new = make("engine-a"), make("engine-b")
    ids = ["wf-1", "wf-2", "wf-3"]
    for wid in ids:
        assert old.acquire(wid).status == "acquired"
    clock.advance(PAST_GRACE_MS)
    gated.before_next_cas(lambda: clock.advance(STALL_MS))

    results = new.takeover_many(ids)

    assert [getattr(r, "status", r) for r in results] == ["acquired"] * 3
    for wid in ids:
        stored = expires_at(gated, wid)
        assert stored is not None and stored > clock()
    assert [r.status for r in new.renew_many(ids)] == ["renewed"] * 3


def test_a_stalled_takeover_taken_straight_back_is_reported_lost(
    make: Factory, gated: GatedStorage, clock: ManualClock, storage: Storage
) -> None:
    old, new = make("engine-a"), make("engine-b")
    third = make("engine-c", store=storage)  # not through the gate
    assert old.acquire("wf-1").status == "acquired"
    clock.advance(PAST_GRACE_MS)

    def stall_then_lose() -> None:
        clock.advance(STALL_MS)
        # Right after B's commit (the next CAS is B's renewal), C takes the expired holder.
        gated.before_next_cas(lambda: third.takeover("wf-1"))

    gated.before_next_cas(stall_then_lose)
    result = new.takeover("wf-1")

    assert result.status == "lost-race"
    assert new.current_epoch("wf-1") is None
    assert holder_engine(gated, "wf-1") == "engine-c"
