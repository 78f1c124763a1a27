"""forget_engine: a survivor removes a gone engine's record, only if it is exactly as surveyed."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tests.liveness.crashes import dead_lock
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.reclaim.engine_gc import forget_engine
from weft_sync.reclaim.engine_liveness import EngineLiveness
from weft_sync.reclaim.engine_records import EngineRecord, encode_engine_record
from weft_sync.reclaim.verdicts import EngineStatus, EngineVerdict, survey_engines
from weft_sync.storage import SqliteStorage, Storage
from weft_sync.storage.sqlite.locks import lock_directory


def _only(storage: Storage, now: int = 1) -> EngineStatus:
    [status] = survey_engines(storage, now=now)
    return status


def test_a_closed_engine_is_forgotten(storage: Storage) -> None:
    liveness = EngineLiveness(
        storage, engine_id="gone", clock=ManualClock(1), claim_ttl_ms=3_000, renew_interval_ms=1_000
    )
    liveness.start()
    liveness.close(remaining_claims=1)
    status = _only(storage)
    assert status.verdict is EngineVerdict.CLOSED
    assert forget_engine(storage, status) is True
    assert storage.get(keys.engine_liveness("gone")) is None


def test_a_record_written_again_since_the_survey_is_kept(storage: Storage) -> None:
    record = replace(_record("crashed"), lock_id=dead_lock(storage, "crashed"))
    storage.put(keys.engine_liveness("crashed"), encode_engine_record(record))
    status = _only(storage)
    assert status.verdict is EngineVerdict.CRASHED
    newer = encode_engine_record(replace(record, heartbeat_at=2))
    storage.put(keys.engine_liveness("crashed"), newer)
    assert forget_engine(storage, status) is False
    assert storage.get(keys.engine_liveness("crashed")) == newer


def test_a_live_engine_is_never_forgotten(storage: Storage) -> None:
    storage.put(
        keys.engine_liveness("alive"), encode_engine_record(replace(_record("alive"), lock=None))
    )
    status = _only(storage)
    with pytest.raises(ValueError, match="'alive' is live"):
        forget_engine(storage, status)
    assert storage.get(keys.engine_liveness("alive")) is not None


def test_sqlite_forgetting_a_crashed_engine_removes_its_lock_file(tmp_path: Path) -> None:
    path = str(tmp_path / "store.db")
    with SqliteStorage(path) as store:
        # A crashed holder leaves its file behind, unlocked: its descriptor closed, not unlinked.
        record = replace(_record("crashed"), lock_id=dead_lock(store, "crashed"))
        store.put(keys.engine_liveness("crashed"), encode_engine_record(record))
        assert os.listdir(lock_directory(path)) == ["crashed.lock"]
        status = _only(store)
        assert forget_engine(store, status) is True
        assert os.listdir(lock_directory(path)) == []


def _record(engine_id: str) -> EngineRecord:
    return EngineRecord(engine_id, "live", 1, 3_000, 1_000, 0, engine_id, 1, "h", 1)
