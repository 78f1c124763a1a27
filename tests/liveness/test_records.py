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
    MAX_UNDRIVEN_IDS,
    EngineRecord,
    UndrivenClaims,
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


# RECORD as engines that publish no driver state encode it, without and with a lock identity.
OLD_BYTES = bytes.fromhex(
    "8ba9656e67696e655f6964a8656e67696e652d61a57374617465a46c697665ac6865617274626561745f6174"
    "cd03e8ac636c61696d5f74746c5f6d73cd7530b172656e65775f696e74657276616c5f6d73cd1388a468656c"
    "6403a46c6f636ba8656e67696e652d61a3706964cd1092a4686f7374a3626f78aa737461727465645f6174cd"
    "0384a87761746368696e67c2"
)
OLD_BYTES_WITH_LOCK_ID = bytes.fromhex(
    "8ca9656e67696e655f6964a8656e67696e652d61a57374617465a46c697665ac6865617274626561745f6174"
    "cd03e8ac636c61696d5f74746c5f6d73cd7530b172656e65775f696e74657276616c5f6d73cd1388a468656c"
    "6403a46c6f636ba8656e67696e652d61a3706964cd1092a4686f7374a3626f78aa737461727465645f6174cd"
    "0384a87761746368696e67c2a76c6f636b5f6964a5313a323a6e"
)
UNDRIVEN = UndrivenClaims(awaiting=("job-2", "job-3"), no_driver=("job-1",), count=3)


def _fields(record: EngineRecord) -> dict[str, Any]:
    """The map ``record`` encodes to (its optional keys only when they have a value)."""
    data: dict[str, Any] = msgpack.unpackb(encode_engine_record(record))
    return data


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


_KEYS = [*sorted(EngineRecord.__slots__), "x"]  # every field, the optional ones too


@given(st.dictionaries(st.sampled_from(_KEYS), st.from_type(object)))
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


# -- driver state: the optional ``undriven`` key -----------------------------------------------


def test_a_record_without_undriven_claims_keeps_the_bytes_it_always_had() -> None:
    assert encode_engine_record(RECORD) == OLD_BYTES
    assert encode_engine_record(replace(RECORD, lock_id="1:2:n")) == OLD_BYTES_WITH_LOCK_ID
    assert decode_engine_record(OLD_BYTES) == RECORD
    assert decode_engine_record(OLD_BYTES_WITH_LOCK_ID) == replace(RECORD, lock_id="1:2:n")


def test_undriven_claims_round_trip_as_a_map_after_the_other_keys() -> None:
    record = replace(RECORD, lock_id="1:2:n", undriven=UNDRIVEN)
    raw = encode_engine_record(record)
    assert decode_engine_record(raw) == record
    data = msgpack.unpackb(raw)
    assert list(data)[-2:] == ["lock_id", "undriven"]
    assert data["undriven"] == {"awaiting": ["job-2", "job-3"], "no_driver": ["job-1"], "count": 3}
    assert encode_engine_record(replace(record)) == raw
    # Without the key the rest is byte for byte what an engine without driver state writes.
    del data["undriven"]
    assert msgpack.packb(data, use_bin_type=True) == OLD_BYTES_WITH_LOCK_ID


def test_the_report_is_sorted_and_cut_to_its_bound_without_driver_first() -> None:
    assert UndrivenClaims.of([], []) is None
    assert UndrivenClaims.of(["b", "a", "c"], ["c"]) == UndrivenClaims(("a", "b"), ("c",), 3)
    waiting = [f"wait-{i:02}" for i in range(40)]
    without = [f"none-{i:02}" for i in range(5)]
    cut = UndrivenClaims.of(waiting, without)
    assert cut is not None
    assert cut.no_driver == tuple(without)
    assert cut.awaiting == tuple(waiting[: MAX_UNDRIVEN_IDS - 5])
    assert (cut.count, cut.complete) == (45, False)
    record = replace(RECORD, undriven=cut)
    assert decode_engine_record(encode_engine_record(record)) == record


_IDS = tuple(f"w{i:02}" for i in range(MAX_UNDRIVEN_IDS + 1))


@pytest.mark.parametrize(
    "undriven",
    [
        UndrivenClaims((), (), 0),  # an empty report is never written: None is
        UndrivenClaims(("b", "a"), (), 2),
        UndrivenClaims(("a", "a"), (), 2),
        UndrivenClaims(("a",), ("a",), 2),
        UndrivenClaims(("a",), (), 2),  # a larger count with lists that are not full
        UndrivenClaims(("a", "b"), (), 1),
        UndrivenClaims(_IDS, (), len(_IDS)),  # one id too many
        UndrivenClaims(("x" * 1025,), (), 1),
        UndrivenClaims(("",), (), 1),
        UndrivenClaims(("a",), (), True),
        UndrivenClaims(["a"], (), 1),  # type: ignore[arg-type]
        UndrivenClaims((7,), (), 1),  # type: ignore[arg-type]
        "job-1",
    ],
)
def test_encode_refuses_undriven_claims_out_of_range(undriven: Any) -> None:
    with pytest.raises(ValueError, match="undriven"):
        encode_engine_record(replace(RECORD, undriven=undriven))


def _undriven_map(**changes: Any) -> dict[str, Any]:
    data = {"awaiting": ["job-2"], "no_driver": ["job-1"], "count": 2}
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "undriven",
    [
        None,  # never written so: a record without undriven claims has no key
        [],
        "job-1",
        {},
        {"awaiting": ["job-2"], "no_driver": ["job-1"]},
        {**_undriven_map(), "extra": 1},
        _undriven_map(count=True),
        _undriven_map(count=-1),
        _undriven_map(count=1),
        _undriven_map(count=3),  # more than the lists name, but they are not full
        _undriven_map(awaiting="job-2"),
        _undriven_map(awaiting=[2]),
        _undriven_map(awaiting=["job-3", "job-2"]),
        _undriven_map(awaiting=["job-1"]),  # in both lists
        _undriven_map(awaiting=[b"job-2"]),
        _undriven_map(awaiting=["x" * 1025]),
        _undriven_map(awaiting=list(_IDS), count=len(_IDS) + 1),  # oversized
    ],
)
def test_decode_fails_closed_on_a_wrong_undriven_map(undriven: Any) -> None:
    data = _fields(RECORD)
    data["undriven"] = undriven
    assert decode_engine_record(msgpack.packb(data, use_bin_type=True)) is None
    data["undriven"] = _undriven_map()
    assert decode_engine_record(msgpack.packb(data, use_bin_type=True)) is not None


_WORKFLOW_IDS = st.lists(
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20), max_size=40
)


@given(awaiting=_WORKFLOW_IDS, without=_WORKFLOW_IDS)
def test_any_report_of_undriven_claims_round_trips(awaiting: list[str], without: list[str]) -> None:
    record = replace(RECORD, undriven=UndrivenClaims.of(awaiting, without))
    assert decode_engine_record(encode_engine_record(record)) == record
