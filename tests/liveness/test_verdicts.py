"""Verdicts: the pure table, and surveys of real records with real session locks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.liveness.crashes import dead_lock
from tests.liveness.wrappers import WithoutSessionLocks
from weft_sync import keys
from weft_sync.reclaim.engine_records import EngineRecord, encode_engine_record
from weft_sync.reclaim.verdicts import (
    EngineVerdict,
    judge_engine,
    stale_after_ms,
    survey_engines,
    take_survey,
)
from weft_sync.storage import Storage
from weft_sync.storage.session_locks import LockState, storage_session_locks

LIVE = EngineRecord("e", "live", 10_000, 3_000, 1_000, 2, "e", 1, "h", 0, lock_id="1:2")
STALE_AT = 10_000 + stale_after_ms(LIVE) + 1
HELD, FREE, UNKNOWN = LockState.HELD, LockState.FREE, LockState.UNKNOWN


@pytest.mark.parametrize(
    ("record", "lock_state", "now", "verdict"),
    [
        (LIVE, HELD, 10_000, EngineVerdict.LIVE),
        (LIVE, None, 10_000, EngineVerdict.LIVE),  # a store without session locks
        (LIVE, FREE, 10_000, EngineVerdict.CRASHED),
        (LIVE, FREE, STALE_AT, EngineVerdict.CRASHED),
        # Not seen, not proven free (a removed lock file, a restarted server): never crashed.
        (LIVE, UNKNOWN, 10_000, EngineVerdict.UNKNOWN),
        (LIVE, UNKNOWN, STALE_AT, EngineVerdict.STALE),
        (LIVE, HELD, STALE_AT, EngineVerdict.STALE),  # frozen: holds its lock, beats no more
        (LIVE, HELD, STALE_AT - 1, EngineVerdict.LIVE),
        (LIVE, None, STALE_AT, EngineVerdict.STALE),
        (replace(LIVE, lock=None, lock_id=None), FREE, 10_000, EngineVerdict.LIVE),
        (replace(LIVE, lock=None, lock_id=None), None, STALE_AT, EngineVerdict.STALE),
        (replace(LIVE, state="closed"), FREE, 10_000, EngineVerdict.CLOSED),
        (replace(LIVE, state="closed"), HELD, STALE_AT, EngineVerdict.CLOSED),
        (None, None, 10_000, EngineVerdict.STALE),
        (None, FREE, 10_000, EngineVerdict.STALE),
        (LIVE, HELD, 0, EngineVerdict.LIVE),  # a heartbeat ahead of the judge's clock
    ],
)
def test_verdict_table(
    record: EngineRecord | None, lock_state: LockState | None, now: int, verdict: EngineVerdict
) -> None:
    assert judge_engine(record, lock_state, now) is verdict


def test_stale_after_is_ttl_plus_two_renew_intervals() -> None:
    assert stale_after_ms(LIVE) == 3_000 + 2 * 1_000
    assert EngineVerdict.CRASHED == "crashed"


def _put(storage: Storage, record: EngineRecord) -> bytes:
    raw = encode_engine_record(record)
    storage.put(keys.engine_liveness(record.engine_id), raw)
    return raw


def test_survey_judges_every_engine_with_one_probe(storage: Storage) -> None:
    locks = storage_session_locks(storage)
    assert locks is not None
    held = locks.acquire_session_lock("alive")
    dead = dead_lock(storage, "crashed")
    try:
        _put(storage, replace(LIVE, engine_id="alive", lock="alive", lock_id=held.identity))
        crashed_raw = _put(
            storage, replace(LIVE, engine_id="crashed", lock="crashed", lock_id=dead)
        )
        # A lock never taken, and a record without an identity (an older engine): no proof.
        _put(storage, replace(LIVE, engine_id="never", lock="never"))
        dead_lock(storage, "noid")
        _put(storage, replace(LIVE, engine_id="noid", lock="noid", lock_id=None))
        _put(storage, replace(LIVE, engine_id="closed", state="closed", lock="closed"))
        _put(storage, replace(LIVE, engine_id="nolock", lock=None, lock_id=None))
        _put(storage, replace(LIVE, engine_id="me", lock=None, lock_id=None))
        storage.put(keys.engine_liveness("broken"), b"junk")
        statuses = {s.engine_id: s for s in survey_engines(storage, now=10_500, exclude=["me"])}
    finally:
        held.release()
    assert {e: s.verdict for e, s in statuses.items()} == {
        "alive": EngineVerdict.LIVE,
        "crashed": EngineVerdict.CRASHED,
        "never": EngineVerdict.UNKNOWN,
        "noid": EngineVerdict.UNKNOWN,
        "closed": EngineVerdict.CLOSED,
        "nolock": EngineVerdict.LIVE,
        "broken": EngineVerdict.STALE,
    }
    assert statuses["crashed"].raw == crashed_raw
    assert statuses["alive"].lock_held is True
    assert statuses["crashed"].lock_held is False
    assert statuses["never"].lock_held is None
    assert statuses["closed"].lock_held is None  # a closed record's lock is not probed
    assert statuses["broken"].record is None


def test_a_survey_of_rows_read_elsewhere_judges_as_one_that_reads_them(
    storage: Storage,
) -> None:
    locks = storage_session_locks(storage)
    assert locks is not None
    held = locks.acquire_session_lock("alive")
    dead = dead_lock(storage, "crashed")
    alive = replace(LIVE, engine_id="alive", lock="alive", lock_id=held.identity)
    try:
        _put(storage, alive)
        _put(storage, replace(LIVE, engine_id="crashed", lock="crashed", lock_id=dead))
        _put(storage, replace(LIVE, engine_id="old", lock=None, lock_id=None, heartbeat_at=0))
        storage.put(keys.engine_liveness("broken"), b"junk")
        storage.put(keys.engine_liveness("") + "%zz", b"junk")  # names no engine: skipped
        rows = storage.scan(keys.engine_liveness(""))
        assert len(rows) == 5
        # Rows read before a record changed are what is judged: the caller's snapshot.
        _put(storage, replace(alive, state="closed"))
        given = survey_engines(storage, now=10_500, exclude=["me"], rows=rows)
        _put(storage, alive)
        read = survey_engines(storage, now=10_500, exclude=["me"])
    finally:
        held.release()
    assert given == read
    assert {s.engine_id: s.verdict for s in given} == {
        "alive": EngineVerdict.LIVE,
        "crashed": EngineVerdict.CRASHED,
        "old": EngineVerdict.STALE,
        "broken": EngineVerdict.STALE,
    }


def test_survey_on_a_store_without_locks_judges_by_heartbeat(storage: Storage) -> None:
    _put(storage, replace(LIVE, engine_id="fresh", lock="fresh"))
    _put(storage, replace(LIVE, engine_id="old", lock="old", heartbeat_at=0))
    statuses = survey_engines(WithoutSessionLocks(storage), now=10_000)  # type: ignore[arg-type]
    assert {s.engine_id: (s.verdict, s.lock_held) for s in statuses} == {
        "fresh": (EngineVerdict.LIVE, None),
        "old": (EngineVerdict.STALE, None),
    }


def test_a_judge_without_its_own_lock_believes_no_lock(storage: Storage) -> None:
    locks = storage_session_locks(storage)
    assert locks is not None
    dead = dead_lock(storage, "crashed")
    _put(storage, replace(LIVE, engine_id="crashed", lock="crashed", lock_id=dead))
    mine = locks.acquire_session_lock("judge")
    try:
        held = take_survey(storage, now=10_000, own_lock="judge")
    finally:
        mine.release()
    assert held.own_lock_held is True
    assert [s.verdict for s in held.statuses] == [EngineVerdict.CRASHED]
    lost = take_survey(storage, now=10_000, own_lock="judge")
    assert lost.own_lock_held is False
    assert [(s.verdict, s.lock_state) for s in lost.statuses] == [(EngineVerdict.LIVE, None)]
    assert take_survey(storage, now=10_000).own_lock_held is None


def test_a_failed_probe_proves_nothing(storage: Storage) -> None:
    dead = dead_lock(storage, "crashed")
    _put(storage, replace(LIVE, engine_id="crashed", lock="crashed", lock_id=dead))
    statuses = survey_engines(storage, now=10_000, probe=False)
    assert [(s.verdict, s.lock_held) for s in statuses] == [(EngineVerdict.UNKNOWN, None)]
