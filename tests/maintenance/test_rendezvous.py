"""Rendezvous split of a crashed engine's claims, and the dead share of the reclaim target.

``assigned_to`` as a pure function (disjoint, covering, stable), then end to end: a survivor
whose fellow survivor probes crashes too takes only its assigned claims of a crashed engine,
until they have waited :data:`DEAD_SHARE_WINDOW_MS` for their taker; then it takes the rest.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engines import MakeOwnership, opened_engines
from tests.liveness.crashes import dead_lock
from tests.maintenance.discovery_helpers import (
    JOB,
    RENEW_MS,
    TTL_MS,
    Driven,
    holders,
    index_store,
    rewrite_record,
)
from weft_sync.clock import ManualClock
from weft_sync.options import OwnershipOptions
from weft_sync.reclaim.engine_discovery import DEAD_SHARE_WINDOW_MS
from weft_sync.reclaim.fair_share import assigned_to
from weft_sync.storage import Storage

IDS = [f"wf-{n:04d}" for n in range(600)]
ENGINES = ["engine-a", "engine-b", "engine-c", "engine-d"]


def test_shares_are_disjoint_and_cover_every_id() -> None:
    shares = {e: assigned_to(e, ENGINES, IDS) for e in ENGINES}

    taken = [wid for share in shares.values() for wid in share]
    assert sorted(taken) == IDS  # each id exactly once
    # Hashing spreads 600 ids over 4 engines: no engine gets none or nearly all.
    assert all(60 <= len(share) <= 240 for share in shares.values()), {
        e: len(s) for e, s in shares.items()
    }


def test_shares_keep_the_input_order_and_ignore_the_participants_order() -> None:
    share = assigned_to("engine-b", ENGINES, IDS)
    assert share == [wid for wid in IDS if wid in set(share)]
    assert assigned_to("engine-b", [*reversed(ENGINES), "engine-b"], IDS) == share
    # The engine itself takes part whether or not it is listed.
    others = [e for e in ENGINES if e != "engine-b"]
    assert assigned_to("engine-b", others, IDS) == share


def test_an_id_stays_with_its_engine_when_another_engine_leaves() -> None:
    before = {e: set(assigned_to(e, ENGINES, IDS)) for e in ENGINES}
    remaining = [e for e in ENGINES if e != "engine-d"]
    after = {e: set(assigned_to(e, remaining, IDS)) for e in remaining}

    for engine in remaining:
        assert before[engine] <= after[engine]  # only engine-d's ids move
    assert set().union(*after.values()) == set(IDS)


def test_a_single_participant_takes_everything() -> None:
    assert assigned_to("engine-a", [], IDS) == IDS
    assert assigned_to("engine-a", ["engine-a"], IDS) == IDS
    assert assigned_to("engine-a", ENGINES, []) == []


# -- the dead share, end to end ---------------------------------------------------------------


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000)


@pytest.fixture(params=["auto", "scan"])
def make(
    storage: Storage, clock: ManualClock, request: pytest.FixtureRequest
) -> Iterator[MakeOwnership]:
    options = OwnershipOptions(
        claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS, reclaim_discovery=request.param
    )
    with opened_engines(storage, clock, options) as factory:
        yield factory


def test_a_survivor_takes_its_assigned_dead_claims_first_and_the_rest_after_the_window(
    make: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    dead = make("engine-dead")
    ids = [f"job-{n:02d}" for n in range(20)]
    for wid in ids:
        dead.workflows.start(wid, JOB)
    driven = Driven()
    survivor = make("engine-b", handlers={JOB: driven})
    make("engine-c")  # never runs a pass here
    index_store(storage)
    # engine-c as a running engine would be: it probes crashes, so it takes its own share.
    rewrite_record(storage, "engine-c", watching=True)
    gone = dead_lock(storage, "engine-dead-gone")
    rewrite_record(storage, "engine-dead", lock="engine-dead-gone", lock_id=gone)  # crashed
    clock.advance(RENEW_MS)
    mine = assigned_to("engine-b", ["engine-c"], ids)
    assert 0 < len(mine) < len(ids)

    survivor.run_maintenance()

    taken = {wid for wid, h in holders(storage, ids).items() if h == ("engine-b", 2)}
    assert taken == set(mine)
    assert driven.all_ids() == sorted(mine)
    clock.advance(DEAD_SHARE_WINDOW_MS - 1)
    survivor.run_maintenance()
    assert driven.all_ids() == sorted(mine)  # engine-c's share still waits for it

    clock.advance(1)  # the rest has waited the whole window: taken whatever the share
    survivor.run_maintenance()

    assert holders(storage, ids) == dict.fromkeys(ids, ("engine-b", 2))
    assert driven.all_ids() == ids
