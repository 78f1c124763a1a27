"""``dead_work_left``: whether the reclaim slot runs another urgent round for a dead engine.

Urgent rounds exist so that a crashed engine's claims move within milliseconds; they must end
once this engine can take nothing more of them (no handler for their type, or ``max_claims``
reached), or every reclaim slot would repeat its discovery for as long as such claims stay.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.claims.gated import WarningSink
from tests.liveness.crashes import dead_lock
from tests.maintenance.discovery_helpers import JOB, RENEW_MS, TTL_MS, holders, index_store
from tests.maintenance.helpers import write_workflow
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.maintenance.subpasses import run_reclaim_pass
from weft_sync.metrics import ClaimMetrics
from weft_sync.reclaim.discoveries import Discovery, ScanDiscovery, expiry_judge
from weft_sync.reclaim.engine_discovery import EngineIndexDiscovery
from weft_sync.reclaim.engine_records import EngineRecord, encode_engine_record
from weft_sync.reclaim.target import ReclaimTargetHandle, create_reclaim_target
from weft_sync.storage import Storage
from weft_sync.storage.session_locks import storage_session_locks

START = 1_000_000


@pytest.fixture(autouse=True)
def _own_lock(storage: Storage) -> Iterator[None]:
    """engine-b holds its session lock, as an open engine does (else no lock is believed)."""
    locks = storage_session_locks(storage)
    assert locks is not None
    lock = locks.acquire_session_lock("engine-b")
    yield
    lock.release()


def _registry(storage: Storage, clock: ManualClock, engine_id: str) -> ClaimRegistry:
    return ClaimRegistry(
        storage,
        engine_id=engine_id,
        clock=clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        warn=WarningSink(),
    )


def _crashed_engine_with(storage: Storage, clock: ManualClock, types: dict[str, str]) -> None:
    """Workflows of ``types`` held by engine-dead, whose record names a lock its holder left."""
    dead = _registry(storage, clock, "engine-dead")
    for wid, wf_type in types.items():
        write_workflow(storage, wid, wf_type=wf_type)
        assert dead.acquire(wid).status == "acquired"
    record = EngineRecord(
        "engine-dead",
        "live",
        clock(),
        TTL_MS,
        RENEW_MS,
        len(types),
        "gone-lock",
        1,
        "h",
        START,
        lock_id=dead_lock(storage, "gone-lock"),
    )
    storage.put(keys.engine_liveness("engine-dead"), encode_engine_record(record))
    index_store(storage)


@pytest.fixture(params=["auto", "scan"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _target(storage: Storage, clock: ManualClock, kind: str, **kwargs: Any) -> ReclaimTargetHandle:
    registry = _registry(storage, clock, "engine-b")
    judge = expiry_judge(clock, RENEW_MS)
    discovery: Discovery
    if kind == "auto":
        discovery = EngineIndexDiscovery(storage, engine_id="engine-b", clock=clock, judge=judge)
    else:
        discovery = ScanDiscovery(storage, judge, skip_live=True, engine_id="engine-b", clock=clock)
    return create_reclaim_target(
        registry,
        storage,
        ClaimMetrics(),
        on_reclaimed=lambda wid: None,
        is_eligible=lambda wf_type, revision: wf_type == JOB,
        fair_share=True,
        discovery=discovery,
        **kwargs,
    )


def test_dead_claims_this_engine_cannot_drive_end_the_urgent_rounds(
    storage: Storage, kind: str
) -> None:
    clock = ManualClock(START)
    ids = {f"other-{n}": "other" for n in range(4)}
    _crashed_engine_with(storage, clock, ids)
    target = _target(storage, clock, kind)

    first = run_reclaim_pass(target)

    assert [o.status.value for o in first.outcomes] == ["not-eligible"] * 4
    run_reclaim_pass(target)  # now they are known to be ineligible here
    assert target.dead_work_left() is False
    assert holders(storage, list(ids)) == dict.fromkeys(ids, ("engine-dead", 1))


def test_dead_claims_beyond_max_claims_end_the_urgent_rounds(storage: Storage, kind: str) -> None:
    clock = ManualClock(START)
    ids = {f"job-{n}": JOB for n in range(4)}
    _crashed_engine_with(storage, clock, ids)
    target = _target(storage, clock, kind, max_claims=2)

    run_reclaim_pass(target)

    taken = [w for w, h in holders(storage, list(ids)).items() if h == ("engine-b", 2)]
    assert len(taken) == 2
    run_reclaim_pass(target)
    assert target.dead_work_left() is False


def test_dead_claims_left_for_later_keep_the_urgent_rounds_going(
    storage: Storage, kind: str
) -> None:
    clock = ManualClock(START)
    ids = {f"job-{n}": JOB for n in range(4)}
    _crashed_engine_with(storage, clock, ids)
    target = _target(storage, clock, kind)
    assert target.dead_work_left() is False  # nothing discovered yet

    run_reclaim_pass(target)

    assert holders(storage, list(ids)) == dict.fromkeys(ids, ("engine-b", 2))
    # The discovery of that pass still saw the dead engine's claims: one more round looks.
    assert target.dead_work_left() is True
    run_reclaim_pass(target)
    assert target.dead_work_left() is False
