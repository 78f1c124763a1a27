"""Engine discovery end to end: real engines on one real store, taking turns on a ManualClock.

What each verdict lets a survivor take (closed and crashed engines at once, stale ones by
expiry), what the rotating windows find (expired claims of live engines, running workflows
nobody holds), the migration of a store without the index marker, a store without session
locks, what one pass reads (counted, independent of the store's size) and the fair share that
counts idle survivors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.claims.gated import WarningSink
from tests.engines import MakeOwnership, adopt_claims, opened_engines
from tests.integration.fleet_worker import LocklessStore
from tests.liveness.crashes import dead_lock
from tests.liveness.procs import POLL_S, WAIT_S, holding
from tests.maintenance.discovery_helpers import (
    JOB,
    OPTIONS,
    PAST_EXPIRY_MS,
    RENEW_MS,
    TTL_MS,
    Driven,
    ReadCounting,
    engine_record,
    holder,
    holders,
    index_store,
    rewrite_record,
)
from tests.support.waiting import wait_until
from weft_sync import keys
from weft_sync.claims.engine_index import index_marker_present, read_engine_entries
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, encode_epoch, encode_holder
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.reclaim import engine_discovery
from weft_sync.reclaim.discoveries import ScanDiscovery, expiry_judge
from weft_sync.reclaim.engine_discovery import DISCOVERY_WINDOW, EngineIndexDiscovery
from weft_sync.reclaim.engine_records import EngineRecord, encode_engine_record
from weft_sync.reclaim.scan_windows import RotatingWindow
from weft_sync.reclaim.verdicts import EngineVerdict, survey_engines
from weft_sync.storage import Put, Storage
from weft_sync.storage.session_locks import LockState, storage_session_locks

START = 1_000_000


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
def make(storage: Storage, clock: ManualClock) -> Iterator[MakeOwnership]:
    with opened_engines(storage, clock, OPTIONS) as factory:
        yield factory


def _discovery(
    store: Storage, clock: ManualClock, *, engine_id: str = "engine-judge", **kwargs: Any
) -> EngineIndexDiscovery:
    """The discovery of a judging engine that takes claims past expiry for dead."""
    return EngineIndexDiscovery(
        store, engine_id=engine_id, clock=clock, judge=expiry_judge(clock, RENEW_MS), **kwargs
    )


def _start(ownership: Ownership, count: int, prefix: str = "job") -> list[str]:
    ids = [f"{prefix}-{n:03d}" for n in range(count)]
    for wid in ids:
        ownership.workflows.start(wid, JOB)
    return ids


def _lock_proven_free(storage: Storage, published: dict[str, str | None]) -> bool:
    """Whether the probe a crash verdict rests on proves each published lock's holder dead."""
    locks = storage_session_locks(storage)
    assert locks is not None
    return set(locks.probe_session_locks(published).values()) == {LockState.FREE}


def _survivor(make: MakeOwnership, driven: Driven, engine_id: str = "engine-b") -> Ownership:
    survivor = make(engine_id, handlers={JOB: driven})
    survivor.run_maintenance()  # nothing to take yet; indexes the (young) store
    assert index_marker_present(survivor.storage)
    return survivor


# -- verdicts -------------------------------------------------------------------------------


def test_a_closed_engines_claims_are_taken_before_expiry_and_its_record_forgotten(
    make: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    dead = make("engine-dead")
    ids = _start(dead, 6)
    driven = Driven()
    survivor = _survivor(make, driven)
    # What a close that could not release its claims leaves behind.
    rewrite_record(storage, "engine-dead", state="closed", held=6)
    clock.advance(RENEW_MS)  # the holders are far from expiry

    survivor.run_maintenance()

    assert holders(storage, ids) == dict.fromkeys(ids, ("engine-b", 2))
    assert driven.all_ids() == ids
    assert read_engine_entries(storage, "engine-dead", limit=10) == []
    assert engine_record(storage, "engine-dead") is not None
    survivor.run_maintenance()  # nothing left: the closed engine is forgotten
    assert engine_record(storage, "engine-dead") is None
    assert driven.all_ids() == ids  # driven once each


def test_a_crashed_engines_claims_are_taken_before_expiry(
    make: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    dead = make("engine-dead")
    ids = _start(dead, 5)
    driven = Driven()
    survivor = _survivor(make, driven)
    # A live record naming a lock nobody holds: what a killed process leaves.
    rewrite_record(
        storage,
        "engine-dead",
        lock="engine-dead-gone",
        lock_id=dead_lock(storage, "engine-dead-gone"),
    )
    clock.advance(RENEW_MS)

    survivor.run_maintenance()

    assert holders(storage, ids) == dict.fromkeys(ids, ("engine-b", 2))
    assert driven.all_ids() == ids
    survivor.run_maintenance()
    assert engine_record(storage, "engine-dead") is None


def test_a_sigkilled_engines_claims_are_taken_before_expiry(
    make: MakeOwnership, storage: Storage, storage_url: str, clock: ManualClock
) -> None:
    driven = Driven()
    survivor = _survivor(make, driven)
    ids = [f"killed-{n}" for n in range(4)]
    with holding(storage_url, "engine-k", "engine") as child:
        # The child holds engine-k's session lock and record; its claims are written here
        # under its engine id, as its registry would.
        registry = ClaimRegistry(
            storage,
            engine_id="engine-k",
            clock=clock,
            claim_ttl_ms=TTL_MS,
            claim_renew_interval_ms=RENEW_MS,
            warn=WarningSink(),
        )
        writer = make("engine-writer")
        for wid in ids:
            writer.workflows.start(wid, JOB)
            writer.registry.release(wid)
            assert registry.acquire(wid).status == "acquired"
        epochs = {wid: registry.current_epoch(wid) for wid in ids}
        clock.advance(RENEW_MS)
        survivor.run_maintenance()
        alive = {wid: ("engine-k", epochs[wid]) for wid in ids}
        assert holders(storage, ids) == alive  # its lock is held: untouched

        record = engine_record(storage, "engine-k")
        assert record is not None and record.lock is not None
        published = {record.lock: record.lock_id}
        child.proc.kill()
        child.proc.wait()
        # PostgreSQL ends the dead client's sessions moments later. Its lock is free at once,
        # but a crash verdict needs proof, and the client's backends can stay listed in
        # pg_stat_activity a moment after their locks are gone (longer on a loaded machine).
        wait_until(
            lambda: _lock_proven_free(storage, published),
            "engine-k's lock and sessions are gone",
            timeout_s=WAIT_S,
            poll_s=POLL_S,
        )
        survivor.run_maintenance()

    assert holders(storage, ids) == {wid: ("engine-b", epochs[wid] + 1) for wid in ids}
    assert sorted(driven.all_ids()) == sorted(ids)
    registry.close()


def test_a_stale_engine_keeps_its_unexpired_claims_and_loses_its_expired_ones(
    make: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    frozen = make("engine-frozen")  # its session lock stays held: a SIGSTOPped process
    ids = _start(frozen, 4)
    driven = Driven()
    survivor = _survivor(make, driven)
    clock.advance(2 * RENEW_MS)
    renewed = ids[:2]
    assert [r.status for r in frozen.registry.renew_many(renewed)] == ["renewed"] * 2
    clock.advance(PAST_EXPIRY_MS - 2 * RENEW_MS)  # the heartbeat is stale now, and ids[2:] expired
    statuses = survey_engines(storage, now=clock(), exclude=("engine-b",), own_lock="engine-b")
    assert {s.engine_id: s.verdict for s in statuses}["engine-frozen"] is EngineVerdict.STALE

    survivor.run_maintenance()

    assert holders(storage, ids) == {
        **dict.fromkeys(renewed, ("engine-frozen", 1)),
        **dict.fromkeys(ids[2:], ("engine-b", 2)),
    }
    adopt_claims(survivor)  # its host drives what it took over
    clock.advance(2 * RENEW_MS)  # the renewed ones expire too
    survivor.run_maintenance()
    assert holders(storage, ids) == dict.fromkeys(ids, ("engine-b", 2))
    survivor.run_maintenance()
    # A frozen engine may wake up: its record is kept, even with no claim left.
    assert engine_record(storage, "engine-frozen") is not None
    assert sorted(driven.all_ids()) == ids


# -- the backstop windows --------------------------------------------------------------------


def test_a_live_engines_expired_claim_is_found_by_the_holder_window_within_its_bound(
    make: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    live = make("engine-live")
    ids = _start(live, 13)
    index_store(storage)
    discovery = _discovery(storage, clock, window=4)  # 13 holders: more than three windows
    for _ in range(2):  # move the window's cursor past the start
        assert discovery.discover(()).candidates == []
    lapsed = ids[1]  # read by the first window: found only after a wrap
    others = [w for w in ids if w != lapsed]
    for _ in range(2):  # the engine renews every claim but one
        clock.advance(2 * RENEW_MS)
        assert [r.status for r in live.registry.renew_many(others)] == ["renewed"] * len(others)
    clock.advance(PAST_EXPIRY_MS - 4 * RENEW_MS)
    rewrite_record(storage, "engine-live", heartbeat_at=clock())  # its heartbeat is fresh

    bound = RotatingWindow(keys.workflow_owner_holder(""), 4).passes_to_cover(len(ids))
    found_after = None
    for n in range(1, bound + 1):
        result = discovery.discover(())
        assert set(result.candidates) <= {lapsed}
        assert result.dead_engines == frozenset()
        if lapsed in result.candidates:
            assert lapsed in result.stranded
            found_after = n
            break
    assert found_after is not None, f"not found within {bound} passes"
    assert found_after > 1  # the window really rotated to reach it


def test_a_running_workflow_nobody_holds_is_acquired_from_the_running_index(
    make: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    old = make("engine-a")
    (released,) = _start(old, 1, "released")
    driven = Driven()
    survivor = _survivor(make, driven)
    assert old.registry.release(released).status == "released"
    assert storage.get(keys.workflow_status_index("running", released)) is not None

    survivor.run_maintenance()

    assert holder(storage, released) is not None
    assert holders(storage, [released]) == {released: ("engine-b", 2)}
    assert driven.all_ids() == [released]


def test_a_running_record_without_an_index_entry_is_found_by_the_record_window(
    make: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    old = make("engine-a")
    (unindexed,) = _start(old, 1, "unindexed")
    driven = Driven()
    survivor = _survivor(make, driven)
    assert old.registry.release(unindexed).status == "released"
    # A store whose status index was never backfilled has no entry for it.
    storage.delete(keys.workflow_status_index("running", unindexed))

    survivor.run_maintenance()

    assert holders(storage, [unindexed]) == {unindexed: ("engine-b", 2)}
    assert driven.all_ids() == [unindexed]


def test_a_holder_read_by_the_holder_window_is_not_read_again_in_the_same_pass(
    make: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    live = make("engine-live")
    ids = _start(live, 5)
    index_store(storage)
    counting = ReadCounting(storage)
    discovery = _discovery(counting, clock)  # type: ignore[arg-type]

    assert discovery.discover(()).candidates == []

    # The running index and the records list all five, and the holder window read all five
    # holders: no holder is asked for by key (only the index marker is).
    assert counting.scanned[keys.workflow_status_index("running", "")] == len(ids)
    assert counting.scanned[keys.workflow_owner_holder("")] == len(ids)
    assert counting.got == [keys.OWNER_INDEX_MARKER]


def test_a_workflow_released_after_its_holder_was_read_is_found_within_the_window_bound(
    make: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    live = make("engine-live")
    ids = _start(live, 10)
    index_store(storage)
    discovery = _discovery(storage, clock, window=4)
    assert discovery.discover(()).candidates == []  # the windows read ids[0:4], holders too
    released = ids[1]
    assert live.registry.release(released).status == "released"  # still running, now ownerless

    bound = RotatingWindow(keys.workflow_status_index("running", ""), 4).passes_to_cover(len(ids))
    found_after = None
    for n in range(1, bound + 1):
        result = discovery.discover(())
        assert set(result.candidates) <= {released}
        if released in result.candidates:
            assert released in result.stranded
            found_after = n
            break
    assert found_after is not None, f"not found within {bound} passes"
    assert found_after > 1  # found once the running window came round to it again


# -- migration and stores without locks -----------------------------------------------------


def _old_holders(storage: Storage, engine_id: str, count: int, expires_at: int) -> list[str]:
    """Holders (with workflow records) written as a version without the index wrote them."""
    ids = [f"old-{n:03d}" for n in range(count)]
    ops: list[Put] = []
    for wid in ids:
        holder_bytes = encode_holder(HolderRecord(engine_id, 1, expires_at, START))
        ops += [
            Put(keys.workflow_owner_epoch(wid), encode_epoch(1)),
            Put(keys.workflow_owner_holder(wid), holder_bytes),
        ]
    storage.batch(ops)
    return ids


def test_a_store_without_the_marker_is_scanned_in_full_and_marked_within_two_passes(
    make: MakeOwnership, storage: Storage, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgraded store's migration is bounded by passes, not by its size over the step: each
    pass sweeps the whole store in steps (2 keys here, of 12 holders and entries), one fixing
    the entries and the next writing the marker."""
    monkeypatch.setattr(engine_discovery, "BACKFILL_BUDGET", 2)  # many steps a sweep
    writer = make("engine-writer")
    ids = _start(writer, 3, "old")
    for wid in ids:  # hand the records' claims to an old engine, without index entries
        writer.registry.release(wid)
    _old_holders(storage, "engine-old", 3, expires_at=START + TTL_MS)
    # A store from before the index never had the marker (this one was born with it).
    storage.delete(keys.OWNER_INDEX_MARKER)
    assert not index_marker_present(storage)
    counting = ReadCounting(storage)
    discovery = _discovery(counting, clock, engine_id="engine-b", window=1)  # type: ignore[arg-type]

    first = discovery.discover(())  # the full scan reads every holder, however many

    assert first.candidates == []  # nothing expired yet
    holder_prefix = keys.workflow_owner_holder("")
    assert counting.scanned[holder_prefix] >= 3
    # The first pass's sweep indexed every old holder, chunk by chunk; its end was dirty.
    assert {wid for wid, _ in read_engine_entries(storage, "engine-old", limit=10)} == set(ids)
    assert not index_marker_present(storage)
    clock.advance(PAST_EXPIRY_MS)
    # The migration's pass, the second, still misses no stranded claim; its clean sweep ends it.
    assert set(discovery.discover(()).candidates) == set(ids)
    assert index_marker_present(storage)

    counting.reset()
    found = set()
    for _ in range(4):  # now the windows: one holder a pass
        found |= set(discovery.discover(()).candidates)
        assert counting.scanned.get(holder_prefix, 0) <= 1
        counting.reset()
    assert found == set(ids)


def test_without_session_locks_no_engine_is_crashed_and_claims_go_by_expiry(
    storage: Storage, clock: ManualClock
) -> None:
    lockless = LocklessStore(storage)
    with opened_engines(lockless, clock, OPTIONS) as make:  # type: ignore[arg-type]
        dead = make("engine-dead")
        ids = _start(dead, 3)
        assert engine_record(storage, "engine-dead").lock is None  # type: ignore[union-attr]
        driven = Driven()
        survivor = _survivor(make, driven)
        # Even a record naming a lock nobody holds is not judged crashed: nothing can probe it.
        rewrite_record(
            storage,
            "engine-dead",
            lock="engine-dead-gone",
            lock_id=dead_lock(storage, "engine-dead-gone"),
        )
        statuses = survey_engines(lockless, now=clock(), exclude=("engine-b",))  # type: ignore[arg-type]
        assert {s.engine_id: s.verdict for s in statuses} == {"engine-dead": EngineVerdict.LIVE}
        clock.advance(RENEW_MS)
        survivor.run_maintenance()
        assert holders(storage, ids) == dict.fromkeys(ids, ("engine-dead", 1))

        clock.advance(PAST_EXPIRY_MS - RENEW_MS)  # stale heartbeat, expired holders
        survivor.run_maintenance()

        assert holders(storage, ids) == dict.fromkeys(ids, ("engine-b", 2))
        assert driven.all_ids() == ids


# -- cost --------------------------------------------------------------------------------------


def _seed_live_engines(storage: Storage, claims: int, engines: int, now: int) -> None:
    """``claims`` live holders (with their index entries) spread over ``engines`` live records."""
    ops: list[Put] = []
    for n in range(claims):
        engine = f"live-{n % engines:02d}"
        wid = f"wf-{claims}-{n:05d}"
        holder_bytes = encode_holder(HolderRecord(engine, 1, now + TTL_MS, now))
        ops += [
            Put(keys.workflow_owner_epoch(wid), encode_epoch(1)),
            Put(keys.workflow_owner_holder(wid), holder_bytes),
            Put(keys.workflow_owner_by_engine(engine, wid), encode_epoch(1)),
        ]
    for e in range(engines):
        record = EngineRecord(
            f"live-{e:02d}", "live", now, TTL_MS, RENEW_MS, claims // engines, None, 1, "h", now
        )
        ops.append(Put(keys.engine_liveness(record.engine_id), encode_engine_record(record)))
    for start in range(0, len(ops), 3_000):
        storage.batch(ops[start : start + 3_000])


@pytest.mark.parametrize("claims", [300, 3_000])
def test_a_pass_reads_a_bound_set_of_rows_whatever_the_live_claims(
    storage: Storage, clock: ManualClock, claims: int
) -> None:
    _seed_live_engines(storage, claims, engines=10, now=clock())
    index_store(storage)
    counting = ReadCounting(storage)
    discovery = _discovery(counting, clock)  # type: ignore[arg-type]

    result = discovery.discover(())

    assert result.candidates == []
    assert result.live_claims == {f"live-{e:02d}": claims // 10 for e in range(10)}
    # No holder is read by key, no engine's entries are scanned: only the engine records and
    # the three windows (the holder window full, the others empty here).
    assert [k for k in counting.got if k.startswith(keys.workflow_owner_holder(""))] == []
    entry_prefix = "wf-owner-by-engine:"
    assert not any(prefix.startswith(entry_prefix) for prefix in counting.scanned)
    assert counting.scanned[keys.engine_liveness("")] == 10
    assert counting.scanned[keys.workflow_owner_holder("")] == DISCOVERY_WINDOW
    assert counting.rows_read() <= 10 + 3 * DISCOVERY_WINDOW + 1  # + the marker

    counting.reset()
    ScanDiscovery(counting, expiry_judge(clock, RENEW_MS), skip_live=True).discover(())  # type: ignore[arg-type]
    assert counting.rows_read() >= claims  # the full scan reads them all: the counter counts


# -- fair share ------------------------------------------------------------------------------


@pytest.mark.parametrize("discovery", ["auto", "scan"])
def test_an_idle_survivor_counts_in_the_fair_share(
    storage: Storage, clock: ManualClock, discovery: str
) -> None:
    options = OwnershipOptions(
        claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS, reclaim_discovery=discovery
    )
    with opened_engines(storage, clock, options) as make:
        dead = make("engine-dead")
        stranded = _start(dead, 30)
        clock.advance(PAST_EXPIRY_MS)  # the dead engine: stale heartbeat, expired claims
        driven = Driven()
        idle, busy_c, busy_d = (make(f"engine-{n}", handlers={JOB: driven}) for n in "bcd")
        for busy in (busy_c, busy_d):
            busy.workflows.start(f"{busy.engine_id}-own-0", "own")
            busy.workflows.start(f"{busy.engine_id}-own-1", "own")
        if discovery == "auto":
            index_store(storage)
        # The busy survivors go first: each must count the idle one (a record, no holder),
        # or it would take 14 or 15 of the 30.
        for survivor in (busy_c, busy_d, idle):
            survivor.run_maintenance()

    assert driven.counts() == {"engine-b": 10, "engine-c": 10, "engine-d": 10}
    assert driven.all_ids() == stranded
