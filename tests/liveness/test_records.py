"""Engine record codec: deterministic bytes, strict fail-closed decoding, and the record scan."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weft_sync import keys
from weft_sync.codec import SAFE_INT_MAX
from weft_sync.reclaim.engine_records import (
    EngineRecord,
    decode_engine_record,
    encode_engine_record,
    read_engine_records,
)
from weft_sync.storage import Storage

RECORD = EngineRecord(
    engine_id="engine-a",
    state="live",
    heartbeat_at=1_000,
    claim_ttl_ms=30_000,
    renew_interval_ms=5_000,
    held=3,
    lock="engine-a",
    pid=4242,
    host="box",
    started_at=900,
)


def _fields(record: EngineRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in EngineRecord.__slots__}


def test_round_trip_and_fixed_key_order() -> None:
    raw = encode_engine_record(RECORD)
    assert decode_engine_record(raw) == RECORD
    assert list(msgpack.unpackb(raw)) == [
        "engine_id",
        "state",
        "heartbeat_at",
        "claim_ttl_ms",
        "renew_interval_ms",
        "held",
        "lock",
        "pid",
        "host",
        "started_at",
        "watching",
    ]
    assert encode_engine_record(replace(RECORD)) == raw


def test_a_record_without_a_lock_and_closed_round_trips() -> None:
    record = replace(RECORD, lock=None, state="closed", host="")
    assert decode_engine_record(encode_engine_record(record)) == record


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("engine_id", ""),
        ("state", "dead"),
        ("heartbeat_at", -1),
        ("heartbeat_at", SAFE_INT_MAX + 1),
        ("claim_ttl_ms", 0),
        ("renew_interval_ms", 0),
        ("held", True),
        ("lock", ""),
        ("pid", 1.5),
        ("host", "h" * 1025),
        ("started_at", None),
        ("watching", 1),
    ],
)
def test_encode_refuses_a_field_out_of_range_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        encode_engine_record(replace(RECORD, **{field: value}))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("held"),
        lambda d: d.update(extra=1),
        lambda d: d.update(held=True),
        lambda d: d.update(watching=0),
        lambda d: d.update(heartbeat_at=-5),
        lambda d: d.update(heartbeat_at=1.0),
        lambda d: d.update(state="live "),
        lambda d: d.update(engine_id=b"engine-a"),
        lambda d: d.update(lock=7),
        lambda d: d.update(claim_ttl_ms=0),
        lambda d: d.update(host=None),
    ],
)
def test_decode_fails_closed_on_a_wrong_map(mutate: Any) -> None:
    data = _fields(RECORD)
    mutate(data)
    assert decode_engine_record(msgpack.packb(data, use_bin_type=True)) is None


@pytest.mark.parametrize(
    "raw", [None, b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb("x"), "not bytes"]
)
def test_decode_fails_closed_on_garbage(raw: Any) -> None:
    assert decode_engine_record(raw) is None


@given(st.binary(max_size=200))
def test_decode_never_raises_on_any_bytes(raw: bytes) -> None:
    record = decode_engine_record(raw)
    assert record is None or encode_engine_record(record) is not None


@given(st.dictionaries(st.sampled_from([*sorted(_fields(RECORD)), "x"]), st.from_type(object)))
def test_decode_never_raises_on_any_map(data: dict[str, Any]) -> None:
    try:
        raw = msgpack.packb(data, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return
    record = decode_engine_record(raw)
    assert record is None or decode_engine_record(encode_engine_record(record)) == record


@given(
    held=st.integers(min_value=0, max_value=SAFE_INT_MAX),
    heartbeat=st.integers(min_value=0, max_value=SAFE_INT_MAX),
    engine=st.text(min_size=1, max_size=50),
)
def test_any_valid_record_round_trips(held: int, heartbeat: int, engine: str) -> None:
    record = replace(RECORD, engine_id=engine, held=held, heartbeat_at=heartbeat)
    assert decode_engine_record(encode_engine_record(record)) == record


def test_read_engine_records_takes_the_id_from_the_key(storage: Storage) -> None:
    other = replace(RECORD, engine_id="engine/b")
    storage.put(keys.engine_liveness("engine-a"), encode_engine_record(RECORD))
    storage.put(keys.engine_liveness("engine/b"), encode_engine_record(other))
    storage.put(keys.engine_liveness("garbage"), b"\x00junk")
    # A record filed under another engine's key is not believed.
    storage.put(keys.engine_liveness("impostor"), encode_engine_record(RECORD))
    # A key whose id does not decode names no engine.
    storage.put(keys.engine_liveness("") + "%zz", encode_engine_record(RECORD))
    storage.put(keys.workflow_owner_holder("engine-a"), b"unrelated")
    found = {engine: (raw, record) for engine, raw, record in read_engine_records(storage)}
    assert sorted(found) == ["engine-a", "engine/b", "garbage", "impostor"]
    assert found["engine-a"] == (encode_engine_record(RECORD), RECORD)
    assert found["engine/b"][1] == other
    assert found["garbage"] == (b"\x00junk", None)
    assert found["impostor"][1] is None
