"""Edges of :class:`EngineIndexDiscovery`, read straight from its result on a real store.

A dead engine never counts as a live one in the fair share (also while the store is being
migrated and the full scan reads its holders as unexpired), and only claims that may be taken
at once (crashed or closed engines) ask for urgent rounds when more are left than one pass reads.
"""

from __future__ import annotations

import pytest

from tests.maintenance.discovery_helpers import RENEW_MS, TTL_MS, index_store
from weft_sync import keys
from weft_sync.claims.engine_index import index_marker_present
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, encode_epoch, encode_holder
from weft_sync.liveness.records import EngineRecord, EngineState, encode_engine_record
from weft_sync.maintenance import engine_discovery
from weft_sync.maintenance.discoveries import expiry_judge
from weft_sync.maintenance.engine_discovery import EngineIndexDiscovery
from weft_sync.storage import Put, Storage

START = 1_000_000


def _engine(
    storage: Storage,
    engine_id: str,
    claims: int,
    *,
    state: EngineState = "live",
    heartbeat_at: int = START,
    indexed: bool = True,
) -> list[str]:
    """An engine record (no session lock) and ``claims`` unexpired holders of it."""
    ids = [f"{engine_id}-{n}" for n in range(claims)]
    ops = [
        Put(
            keys.engine_liveness(engine_id),
            encode_engine_record(
                EngineRecord(
                    engine_id, state, heartbeat_at, TTL_MS, RENEW_MS, claims, None, 1, "h", START
                )
            ),
        )
    ]
    for wid in ids:
        ops += [
            Put(keys.workflow_owner_epoch(wid), encode_epoch(1)),
            Put(
                keys.workflow_owner_holder(wid),
                encode_holder(HolderRecord(engine_id, 1, START + TTL_MS, START)),
            ),
        ]
        if indexed:
            ops.append(Put(keys.workflow_owner_by_engine(engine_id, wid), encode_epoch(1)))
    storage.batch(ops)
    return ids


def _discovery(storage: Storage, clock: ManualClock) -> EngineIndexDiscovery:
    return EngineIndexDiscovery(
        storage, engine_id="engine-judge", clock=clock, judge=expiry_judge(clock, RENEW_MS)
    )


def test_a_closed_engine_is_not_counted_live_while_the_store_is_migrated(
    storage: Storage,
) -> None:
    clock = ManualClock(START)
    closed = _engine(storage, "engine-closed", 3, state="closed")
    _engine(storage, "engine-old", 2, indexed=False)  # an old engine: the store is unmarked
    assert not index_marker_present(storage)

    result = _discovery(storage, clock).discover(())

    assert set(result.stranded) == set(closed)
    assert result.dead_engines == frozenset({"engine-closed"})
    assert "engine-closed" not in result.live_claims
    assert result.live_claims == {"engine-old": 2}


def test_only_dead_engines_with_unread_claims_ask_for_more_rounds(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock(START + TTL_MS + 2 * RENEW_MS + 1)  # engine-stale's heartbeat is stale
    _engine(storage, "engine-stale", 4)
    index_store(storage)
    monkeypatch.setattr(engine_discovery, "DEAD_ENGINE_READ_LIMIT", 2)
    discovery = _discovery(storage, clock)

    stale = discovery.discover(())

    assert stale.dead_engines == frozenset()
    assert stale.dead_left is False  # its claims wait for expiry: no round can take them sooner

    _engine(storage, "engine-closed", 4, state="closed", heartbeat_at=clock())
    closed = discovery.discover(())

    assert closed.dead_engines == frozenset({"engine-closed"})
    assert len(closed.dead_claims) == 2
    assert closed.dead_left is True


def test_a_judge_at_once_reads_the_clock_once_and_judges_as_the_judge_does() -> None:
    clock = ManualClock(10_000)
    reads: list[int] = []

    def counted() -> int:
        reads.append(clock())
        return reads[-1]

    judge = expiry_judge(counted, RENEW_MS)
    deadline = 10_000 - 2 * RENEW_MS  # expired once its grace (two intervals) is over too
    holders = [
        encode_holder(HolderRecord("engine-a", 1, deadline, 0)),
        encode_holder(HolderRecord("engine-b", 1, deadline - 1, 0)),
        b"not a holder",
    ]
    assert [judge(h) for h in holders] == ["engine-a", None, None]
    assert len(reads) == 3
    reads.clear()
    at_once = judge.at_once()
    clock.advance(10 * RENEW_MS)  # later readings do not move a snapshot's judge
    assert [at_once(h) for h in holders] == ["engine-a", None, None]
    assert reads == [10_000]
