"""A takeover whose clock raises right after its commit leaves no claim that nobody renews.

The takeover reads the clock again after its commit (to renew holders a stalled commit wrote
too late). A host clock that raises there must not leave a committed holder untracked: an
``Exception`` keeps the claims as written and tracked, anything else gives them back before it
goes on. The clock is switched to raising just before the commit (``before_next_cas``), on both
real backends.
"""

from __future__ import annotations

import pytest

from tests.claims.conftest import Factory
from tests.claims.gated import PAST_GRACE_MS, GatedStorage, WarningSink, new_registry, watch_log
from tests.support.clocks import SwitchedClock
from tests.workflows.helpers import holder_engine
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock


class HostClockExit(SystemExit):
    """What a host clock raises (a subclass, so that pytest sees it as the test's own)."""


@pytest.fixture
def switched(clock: ManualClock) -> SwitchedClock:
    return SwitchedClock(clock)


@pytest.fixture
def taker(gated: GatedStorage, switched: SwitchedClock, sink: WarningSink) -> ClaimRegistry:
    return new_registry(gated, switched, "engine-b", sink)


IDS = ["wf-1", "wf-2", "wf-3"]


def _expire_held_by_a(make: Factory, clock: ManualClock, ids: list[str]) -> None:
    old = make("engine-a")
    for wid in ids:
        assert old.acquire(wid).status == "acquired"
    clock.advance(PAST_GRACE_MS)


def test_a_clock_error_after_the_commit_keeps_the_takeover_tracked(
    make: Factory,
    gated: GatedStorage,
    clock: ManualClock,
    switched: SwitchedClock,
    taker: ClaimRegistry,
) -> None:
    _expire_held_by_a(make, clock, ["wf-1"])
    gated.before_next_cas(lambda: switched.fail_with(RuntimeError("the host clock failed")))

    with watch_log("weft_sync.claims.registry") as log:
        result = taker.takeover("wf-1")

    assert result.status == "acquired" and result.epoch == 2
    assert any("could not read the clock after a takeover" in m for m in log.messages())
    assert holder_engine(gated, "wf-1") == "engine-b"
    assert taker.current_epoch("wf-1") == 2
    switched.fail_with(None)
    assert taker.renew("wf-1").status == "renewed"


def test_a_clock_error_after_a_batched_commit_keeps_every_takeover_tracked(
    make: Factory,
    gated: GatedStorage,
    clock: ManualClock,
    switched: SwitchedClock,
    taker: ClaimRegistry,
) -> None:
    _expire_held_by_a(make, clock, IDS)
    gated.before_next_cas(lambda: switched.fail_with(RuntimeError("the host clock failed")))

    results = taker.takeover_many(IDS)

    assert [getattr(r, "status", r) for r in results] == ["acquired"] * 3
    assert [taker.current_epoch(wid) for wid in IDS] == [2, 2, 2]
    switched.fail_with(None)
    assert [r.status for r in taker.renew_many(IDS)] == ["renewed"] * 3


def test_a_clock_exit_after_the_commit_gives_the_takeover_back(
    make: Factory,
    gated: GatedStorage,
    clock: ManualClock,
    switched: SwitchedClock,
    taker: ClaimRegistry,
) -> None:
    _expire_held_by_a(make, clock, ["wf-1"])
    gated.before_next_cas(lambda: switched.fail_with(HostClockExit(3)))

    with pytest.raises(HostClockExit):
        taker.takeover("wf-1")

    assert taker.current_epoch("wf-1") is None
    assert holder_engine(gated, "wf-1") is None  # ownerless: any engine acquires it now
    switched.fail_with(None)
    other = make("engine-c")
    assert other.acquire("wf-1").status == "acquired"


def test_a_clock_exit_after_a_batched_commit_gives_every_takeover_back(
    make: Factory,
    gated: GatedStorage,
    clock: ManualClock,
    switched: SwitchedClock,
    taker: ClaimRegistry,
) -> None:
    _expire_held_by_a(make, clock, IDS)
    gated.before_next_cas(lambda: switched.fail_with(HostClockExit(3)))

    with pytest.raises(HostClockExit):
        taker.takeover_many(IDS)

    assert [taker.current_epoch(wid) for wid in IDS] == [None] * 3
    assert [holder_engine(gated, wid) for wid in IDS] == [None] * 3
