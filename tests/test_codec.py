"""Byte formats: epochs, holder records, mode markers and workflow records (spec §3, §7.1)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weft_sync.codec import (
    EPOCH_MAX,
    SAFE_INT_MAX,
    HolderRecord,
    ModeMarker,
    WorkflowRecord,
    decode_epoch,
    decode_holder,
    decode_mode_marker,
    decode_workflow_record,
    encode_epoch,
    encode_holder,
    encode_mode_marker,
    encode_workflow_record,
    try_decode_workflow_record,
)


def pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def holder_map(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "engine_id": "engine-a",
        "epoch": 3,
        "expires_at": 5000,
        "claimed_at": 1000,
    }
    base.update(overrides)
    return base


def test_epoch_one_is_eight_big_endian_bytes() -> None:
    assert encode_epoch(1) == bytes([0, 0, 0, 0, 0, 0, 0, 1])
    assert decode_epoch(encode_epoch(42)) == 42


@pytest.mark.parametrize("data", [b"", b"\x01", b"\x00" * 7 + b"\x01\x00", b"\x00" * 9])
def test_epoch_of_wrong_length_decodes_to_none(data: bytes) -> None:
    assert decode_epoch(data) is None


def test_epoch_zero_and_unsafe_values_are_rejected() -> None:
    assert decode_epoch(b"\x00" * 8) is None
    assert decode_epoch((2**53 - 1).to_bytes(8, "big")) is None
    assert decode_epoch((2**53 - 2).to_bytes(8, "big")) == 2**53 - 2
    assert decode_epoch(None) is None
    for bad in (0, -1, 2**53 - 1, True):
        with pytest.raises(ValueError, match="epoch must be an integer"):
            encode_epoch(bad)


def test_holder_round_trips_and_encoding_is_deterministic() -> None:
    record = HolderRecord("engine-a", 7, 31_000, 1_000)
    assert decode_holder(encode_holder(record)) == record
    assert encode_holder(record) == encode_holder(HolderRecord("engine-a", 7, 31_000, 1_000))
    assert list(msgpack.unpackb(encode_holder(record))) == [
        "engine_id",
        "epoch",
        "expires_at",
        "claimed_at",
    ]


@pytest.mark.parametrize(
    "data",
    [
        bytes([0xFF, 0xFE, 0x00]),
        pack(holder_map())[:-2],
        pack(holder_map()) + b"\x00",
        pack("a string"),
        pack(None),
        pack(12),
        pack([1, 2]),
    ],
)
def test_holder_that_is_not_one_map_decodes_to_none(data: bytes) -> None:
    assert decode_holder(data) is None


@pytest.mark.parametrize(
    "overrides",
    [
        {"engine_id": None},
        {"engine_id": 5},
        {"engine_id": ""},
        {"epoch": 0},
        {"epoch": -1},
        {"epoch": 1.5},
        {"epoch": "seven"},
        {"epoch": 2**53 - 1},
        {"epoch": True},
        {"expires_at": 1e20},
        {"expires_at": -1},
        {"expires_at": 1.5},
        {"expires_at": "1000"},
        {"claimed_at": -1},
        {"claimed_at": 1.5},
        {"claimed_at": None},
        {"claimed_at": 2**53},
    ],
)
def test_holder_with_invalid_field_decodes_to_none(overrides: dict[str, object]) -> None:
    assert decode_holder(pack(holder_map(**overrides))) is None


def test_holder_missing_engine_id_decodes_to_none() -> None:
    data = holder_map()
    del data["engine_id"]
    assert decode_holder(pack(data)) is None


def test_holder_boundaries_accepted() -> None:
    assert decode_holder(pack(holder_map(epoch=2**53 - 2))) is not None
    zero = decode_holder(pack(holder_map(expires_at=0, claimed_at=0)))
    assert zero == HolderRecord("engine-a", 3, 0, 0)


def test_holder_extra_field_is_dropped() -> None:
    decoded = decode_holder(pack(holder_map(extra="x")))
    assert decoded == HolderRecord("engine-a", 3, 5000, 1000)


def test_encode_holder_refuses_a_record_that_could_not_decode() -> None:
    with pytest.raises(ValueError, match="engine_id"):
        encode_holder(HolderRecord("", 1, 0, 0))
    with pytest.raises(ValueError, match="expires_at"):
        encode_holder(HolderRecord("e", 1, -5, 0))


@pytest.mark.parametrize("mode", ["lease", "workflow-lease"])
def test_marker_round_trips(mode: str) -> None:
    marker = ModeMarker(mode, 1000)  # type: ignore[arg-type]
    assert decode_mode_marker(encode_mode_marker(marker)) == marker


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",
        pack("lease"),
        pack(None),
        pack({"mode": "none", "established_at": 1}),
        pack({"mode": "future-mode", "established_at": 1}),
        pack({"mode": 7, "established_at": 1}),
        pack({"established_at": 1}),
        pack({"mode": "lease", "established_at": -1}),
        pack({"mode": "lease", "established_at": 1.5}),
        pack({"mode": "lease"}),
    ],
)
def test_invalid_marker_decodes_to_none(data: bytes) -> None:
    assert decode_mode_marker(data) is None


def test_marker_extra_field_dropped() -> None:
    data = pack({"mode": "lease", "established_at": 5, "by": "ops"})
    assert decode_mode_marker(data) == ModeMarker("lease", 5)


def test_workflow_record_round_trips() -> None:
    record = WorkflowRecord("wf-1", "import", "running", {"rows": [1, 2]}, 10, 20, "r1")
    assert decode_workflow_record(encode_workflow_record(record)) == record


def test_workflow_record_rejects_garbage_and_bad_fields() -> None:
    with pytest.raises(ValueError, match="not a valid workflow record"):
        decode_workflow_record(b"\xff\x00")
    assert try_decode_workflow_record(pack({"type": "t", "status": "running"})) is None
    with pytest.raises(ValueError, match="status must be one of"):
        encode_workflow_record(WorkflowRecord("wf", "t", "exploded"))
    with pytest.raises(ValueError, match="cannot be stored as MessagePack"):
        encode_workflow_record(WorkflowRecord("wf", "t", "running", input=object()))


decoders = [decode_epoch, decode_holder, decode_mode_marker, try_decode_workflow_record]


@given(st.binary(max_size=64))
def test_decoders_never_raise_on_arbitrary_bytes(data: bytes) -> None:
    for decode in decoders:
        decode(data)  # a return value or None, never an exception
    if try_decode_workflow_record(data) is None:
        with pytest.raises(ValueError):
            decode_workflow_record(data)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(msgpack_values)
def test_decoders_never_raise_on_arbitrary_msgpack(value: object) -> None:
    data = pack(value)
    for decode in decoders:
        decode(data)


@given(
    st.text(min_size=1),
    st.integers(1, EPOCH_MAX),
    st.integers(0, SAFE_INT_MAX),
    st.integers(0, SAFE_INT_MAX),
)
def test_valid_holders_round_trip(engine: str, epoch: int, expires: int, claimed: int) -> None:
    record = HolderRecord(engine, epoch, expires, claimed)
    assert decode_holder(encode_holder(record)) == record
    assert decode_epoch(encode_epoch(epoch)) == epoch
