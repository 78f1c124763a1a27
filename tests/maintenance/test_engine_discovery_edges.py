"""Edges of :class:`EngineIndexDiscovery`, read straight from its result on a real store.

A dead engine never counts as a live one in the fair share (also while the store is being
migrated and the full scan reads its holders as unexpired), and only claims that may be taken
at once (crashed or closed engines) ask for urgent rounds when more are left than one pass reads.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.maintenance.discovery_helpers import RENEW_MS, TTL_MS, index_store
from weft_sync import keys
from weft_sync.claims.engine_index import index_marker_present
from weft_sync.clock import ManualClock
from weft_sync.codec import HolderRecord, decode_holder, encode_epoch, encode_holder
from weft_sync.reclaim import engine_discovery
from weft_sync.reclaim.discoveries import expiry_judge, holder_engine_and_expiry
from weft_sync.reclaim.engine_discovery import EngineIndexDiscovery
from weft_sync.reclaim.engine_records import EngineRecord, EngineState, encode_engine_record
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


_BOUNDS = [-1, 0, 1, 2**53 - 2, 2**53 - 1, 2**53, 2**64 - 1, True, False, 1.0, "", "e", b"e", None]
_VALUES = st.one_of(
    st.sampled_from(_BOUNDS),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.text(max_size=5),
    st.lists(st.integers(-1_000, 1_000), max_size=2),
)
_FIELDS = ("engine_id", "epoch", "expires_at", "claimed_at")
_VALID = {"engine_id": "engine-a", "epoch": 3, "expires_at": 5_000, "claimed_at": 4_000}


def _one_field_changed(change: tuple[str, object, bool]) -> bytes:
    name, value, drop = change
    fields: dict[str, object] = dict(_VALID)
    if drop:
        fields.pop(name, None)
    else:
        fields[name] = value
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


@given(
    st.one_of(
        st.binary(max_size=40),
        st.tuples(st.sampled_from([*_FIELDS, "other"]), _VALUES, st.booleans()).map(
            _one_field_changed
        ),
        st.dictionaries(st.sampled_from([*_FIELDS, "other"]), _VALUES, max_size=5).map(
            lambda d: msgpack.packb(d, use_bin_type=True)
        ),
        st.builds(
            HolderRecord,
            st.text(min_size=1, max_size=8),
            st.integers(1, 2**53 - 2),
            st.integers(0, 2**53 - 1),
            st.integers(0, 2**53 - 1),
        ).map(encode_holder),
    )
)
def test_the_judge_reads_holders_exactly_as_the_codec_decodes_them(raw: bytes) -> None:
    holder = decode_holder(raw)
    expected = None if holder is None else (holder.engine_id, holder.expires_at)
    assert holder_engine_and_expiry(raw) == expected
    assert holder_engine_and_expiry(bytearray(raw)) == expected


@pytest.mark.parametrize("name", _FIELDS)
@pytest.mark.parametrize("value", _BOUNDS)
def test_the_judge_agrees_with_the_codec_at_every_bound(name: str, value: object) -> None:
    raw = _one_field_changed((name, value, False))
    holder = decode_holder(raw)
    assert holder_engine_and_expiry(raw) == (
        None if holder is None else (holder.engine_id, holder.expires_at)
    )


def test_the_judge_reads_no_holder_from_what_is_not_bytes() -> None:
    assert holder_engine_and_expiry(None) is None
    assert holder_engine_and_expiry("text") is None
    assert holder_engine_and_expiry(b"") is None
