"""Fair takeover: survivors share a dead engine's workflows, and ``max_claims`` bounds each one.

The share logic is checked twice: as pure functions, and end to end with real engines on one
real store (SQLite and PostgreSQL) taking turns on a shared ``ManualClock``, which makes every
split exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.engines import MakeOwnership, adopt_claims, opened_engines
from tests.maintenance.discovery_helpers import Driven
from tests.workflows.helpers import holder_engine
from weft_sync.clock import ManualClock
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.reclaim.fair_share import (
    select_takeovers,
    takeover_budget,
    takeover_order,
    validate_max_claims,
)
from weft_sync.storage import Storage

TTL_MS = 3_000
RENEW_MS = 1_000
PAST_GRACE_MS = TTL_MS + 2 * RENEW_MS + 1
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
JOB = "job"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000)


@pytest.fixture
def make_ownership(storage: Storage, clock: ManualClock) -> Iterator[MakeOwnership]:
    """Open manual-maintenance engines on the test's store; all closed afterwards."""
    with opened_engines(storage, clock, OPTIONS) as make:
        yield make


def _dead_engine_with(make_ownership: MakeOwnership, count: int) -> list[str]:
    dead = make_ownership("engine-dead")
    ids = [f"job-{n:03d}" for n in range(count)]
    for workflow_id in ids:
        dead.workflows.start(workflow_id, JOB)
    return ids


def _own_work(ownership: Ownership, count: int) -> None:
    """Start ``count`` workflows that the test's thread drives for the rest of the test."""
    for n in range(count):
        wid = f"{ownership.engine_id}-own-{n}"
        record = ownership.workflows.start(wid, "own")
        ownership.drivers.enter(record.workflow_id, 1, "test thread")


def _renew_own(ownership: Ownership) -> None:
    """Renew what ``ownership`` holds, without a reclaim pass, so that others see it live."""
    held = ownership.registry.list_held_workflow_ids()
    assert [r.status for r in ownership.registry.renew_many(held)] == ["renewed"] * len(held)


# -- the share, end to end -------------------------------------------------------------------


def test_three_survivors_taking_turns_each_drive_a_third_of_a_dead_engines_work(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    stranded = _dead_engine_with(make_ownership, 30)
    driven = Driven()
    survivors = [make_ownership(f"engine-{n}", handlers={JOB: driven}) for n in "bcd"]
    for survivor in survivors:
        _own_work(survivor, 2)
    clock.advance(PAST_GRACE_MS)
    for survivor in survivors:
        _renew_own(survivor)
    clock.advance(1)

    for survivor in survivors:
        survivor.run_maintenance()

    assert driven.counts() == {"engine-b": 10, "engine-c": 10, "engine-d": 10}
    assert driven.all_ids() == stranded  # each exactly once
    for survivor in survivors:
        assert len(survivor.registry.list_held_workflow_ids()) == 12


def test_workflows_nobody_here_can_drive_do_not_use_up_the_share(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    old = make_ownership("engine-old")
    for n in range(100):
        old.workflows.start(f"other-{n:03d}", "other")  # a type no survivor has a handler for
    driven = Driven()
    survivors = [make_ownership(f"engine-{n}", handlers={JOB: driven}) for n in "bcd"]
    for survivor in survivors:
        _own_work(survivor, 2)
    clock.advance(PAST_GRACE_MS)
    for survivor in survivors:
        _renew_own(survivor)
    for _ in range(3):  # long enough for every survivor to have checked every one of them
        for survivor in survivors:
            survivor.run_maintenance()
        clock.advance(RENEW_MS)
    assert driven.counts() == {}
    stranded = _dead_engine_with(make_ownership, 30)
    clock.advance(PAST_GRACE_MS)
    for survivor in survivors:
        _renew_own(survivor)
    clock.advance(1)

    for survivor in survivors:
        survivor.run_maintenance()

    assert driven.counts() == {"engine-b": 10, "engine-c": 10, "engine-d": 10}
    assert driven.all_ids() == stranded
    assert holder_engine(storage, "other-000") == "engine-old"


def test_a_lone_survivor_takes_everything_in_one_pass(
    make_ownership: MakeOwnership, clock: ManualClock
) -> None:
    stranded = _dead_engine_with(make_ownership, 25)
    driven = Driven()
    survivor = make_ownership("engine-b", handlers={JOB: driven})
    clock.advance(PAST_GRACE_MS)

    result = survivor.run_maintenance()

    assert result.reclaim is not None and result.reclaim.reclaimed_count == 25
    assert driven.all_ids() == stranded


def test_what_busy_engines_leave_is_taken_once_the_fair_share_window_passed(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    stranded = _dead_engine_with(make_ownership, 40)
    # A web worker that holds claims but reclaims nothing still counts as a live engine.
    bystander = make_ownership("engine-web")
    _own_work(bystander, 20)
    driven = Driven()
    survivor = make_ownership("engine-b", handlers={JOB: driven})
    clock.advance(PAST_GRACE_MS)
    taken: list[int] = []
    for _ in range(3):
        bystander.run_maintenance()
        clock.advance(1)
        survivor.run_maintenance()
        adopt_claims(survivor)
        taken.append(driven.counts().get("engine-b", 0))
        clock.advance(RENEW_MS - 1)

    # Pass 1: 60 claims over 2 engines, a target of 30. Pass 2: at the target, so only
    # ceil(10 / 2). Pass 3: the rest has waited two renew intervals and is taken whatever the share.
    assert taken == [30, 35, 40]
    assert driven.all_ids() == stranded
    assert holder_engine(storage, "engine-web-own-0") == "engine-web"


# -- max_claims ------------------------------------------------------------------------------


def test_max_claims_bounds_what_one_engine_takes_over(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    stranded = _dead_engine_with(make_ownership, 12)
    driven = Driven()
    capped = make_ownership("engine-b", handlers={JOB: driven}, max_claims=5)
    _own_work(capped, 1)
    clock.advance(PAST_GRACE_MS)
    _renew_own(capped)
    clock.advance(1)

    for _ in range(3):
        capped.run_maintenance()
        adopt_claims(capped)
        clock.advance(RENEW_MS)

    assert driven.counts() == {"engine-b": 4}
    assert len(capped.registry.list_held_workflow_ids()) == 5
    left = [wid for wid in stranded if holder_engine(storage, wid) == "engine-dead"]
    assert len(left) == 8
    # An engine without a limit takes the rest: its fair share at once (13 claims over two
    # engines), what is left once the fair-share window passed.
    rest = Driven()
    unlimited = make_ownership("engine-c", handlers={JOB: rest})
    unlimited.run_maintenance()
    adopt_claims(unlimited)
    assert rest.counts() == {"engine-c": 7}
    clock.advance(2 * RENEW_MS)
    _renew_own(capped)
    unlimited.run_maintenance()
    assert rest.all_ids() == sorted(left)
    assert driven.counts() == {"engine-b": 4}


def test_max_claims_is_checked_at_the_attempt_as_well(
    make_ownership: MakeOwnership, clock: ManualClock
) -> None:
    _dead_engine_with(make_ownership, 3)
    capped = make_ownership("engine-b", handlers={JOB: Driven()}, max_claims=1)
    clock.advance(PAST_GRACE_MS)
    capped.workflows.start("mine", "own")  # the host's own claim fills the limit

    result = capped.run_maintenance()

    assert result.reclaim is not None and result.reclaim.reclaimed_count == 0
    assert capped.registry.list_held_workflow_ids() == ["mine"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_open_rejects_a_bad_max_claims_naming_it(storage: Storage, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"max_claims must be a whole number >= 1 or None"):
        Ownership.open(storage, max_claims=bad, background="manual")


# -- the share, as functions -----------------------------------------------------------------


def test_takeover_order_is_a_fixed_permutation_that_differs_per_engine() -> None:
    ids = [f"wf-{n}" for n in range(50)]
    order_b = takeover_order("engine-b", ids)
    assert sorted(order_b) == sorted(ids)
    assert takeover_order("engine-b", list(reversed(ids))) == order_b
    assert takeover_order("engine-c", ids) != order_b
    # Two engines taking their first ten mostly pick different workflows.
    assert len(set(order_b[:10]) & set(takeover_order("engine-c", ids)[:10])) <= 5


@pytest.mark.parametrize(
    ("stranded", "held", "others", "max_claims", "expected"),
    [
        (300, 0, {}, None, 300),  # alone: everything
        (300, 5, {"c": 5, "d": 5}, None, 100),  # equal loads: a third
        (200, 5, {"b": 105, "d": 5}, None, 100),  # the second taker: up to the target
        (100, 5, {"b": 105, "c": 105}, None, 100),  # the last taker: the rest
        (20, 0, {"web": 200}, None, 20),  # a loaded bystander: up to the target
        (20, 110, {"web": 100}, None, 10),  # over the target: still stranded / engines
        (300, 0, {}, 40, 40),  # max_claims caps it
        (300, 40, {}, 40, 0),  # full
        (0, 0, {"c": 3}, None, 0),
    ],
)
def test_takeover_budget(
    stranded: int, held: int, others: dict[str, int], max_claims: int | None, expected: int
) -> None:
    budget = takeover_budget(
        stranded=stranded,
        held=held,
        live_claims=others,
        engine_id="b",
        max_claims=max_claims,
    )
    assert budget == expected


def test_overdue_candidates_are_taken_first_and_beyond_the_share() -> None:
    stranded = [f"wf-{n}" for n in range(10)]
    overdue = set(stranded[:6])

    chosen = select_takeovers(
        engine_id="b",
        stranded=stranded,
        overdue=overdue,
        held=100,
        live_claims={"web": 100},
        max_claims=None,
    )

    assert set(chosen[:6]) == overdue and len(chosen) == 6  # share 5, but 6 are overdue
    capped = select_takeovers(
        engine_id="b",
        stranded=stranded,
        overdue=overdue,
        held=0,
        live_claims={},
        max_claims=2,
    )
    assert len(capped) == 2 and set(capped) <= overdue


def test_validate_max_claims_accepts_none_and_positive_ints() -> None:
    assert validate_max_claims(None) is None
    assert validate_max_claims(1) == 1
    with pytest.raises(ValueError, match="got int 0"):
        validate_max_claims(0)
