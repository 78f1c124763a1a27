"""Byte formats: epoch tokens and MessagePack holder, mode-marker and workflow records.

An epoch key holds a *token*: the 8-byte big-endian epoch number followed by an 8-byte mint id
drawn at random when the number is minted (:func:`mint_token`). The number orders owners; the mint
id makes the token unique to one minting, so a store that lost writes and hands a number out a
second time never hands out the same token (``/work/notes/tokens-format.md``). An 8-byte value (the
format before tokens) still decodes, as a token without a mint id, and is replaced by a full
token at the next mint.

Decoders of data read from the store fail closed: a value that does not match the format exactly
decodes to ``None`` rather than raising, so a corrupt record can never look live.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import msgpack

__all__ = [
    "EPOCH_MAX",
    "EPOCH_TOKEN_SIZE",
    "MINT_ID_SIZE",
    "EpochToken",
    "HolderRecord",
    "ModeMarker",
    "OwnershipMode",
    "SAFE_INT_MAX",
    "WORKFLOW_STATUSES",
    "WorkflowRecord",
    "decode_epoch",
    "decode_holder",
    "decode_mode_marker",
    "decode_token",
    "decode_workflow_record",
    "encode_epoch",
    "encode_holder",
    "encode_mode_marker",
    "encode_token",
    "encode_workflow_record",
    "mint_token",
    "try_decode_workflow_record",
]

SAFE_INT_MAX: Final = 2**53 - 1
# 2**53 - 1 itself is excluded so that minting ``epoch + 1`` stays a safe integer.
EPOCH_MAX: Final = 2**53 - 2

OwnershipMode = Literal["lease", "workflow-lease"]
_MODES: Final = get_args(OwnershipMode)

WORKFLOW_STATUSES: Final = (
    "pending",
    "running",
    "suspended",
    "completed",
    "failed",
    "cancelled",
    "timed-out",
)

_EPOCH = struct.Struct(">Q")

MINT_ID_SIZE: Final = 8
"""Bytes of randomness in a token: two mintings of one number collide with probability 2**-64."""
EPOCH_TOKEN_SIZE: Final = _EPOCH.size + MINT_ID_SIZE


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_safe_non_negative(value: object) -> bool:
    return _is_int(value) and 0 <= value <= SAFE_INT_MAX  # type: ignore[operator]


def _is_epoch(value: object) -> bool:
    return _is_int(value) and 1 <= value <= EPOCH_MAX  # type: ignore[operator]


def _pack(data: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


def _unpack_map(data: object) -> dict[Any, Any] | None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return None
    try:
        value = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on malformed input
        return None
    return value if isinstance(value, dict) else None


def encode_epoch(n: int) -> bytes:
    """Encode an epoch as 8 unsigned big-endian bytes.

    :raises ValueError: ``n`` is not an integer in ``1 .. 2**53 - 2``.
    """
    if not _is_epoch(n):
        raise ValueError(f"epoch must be an integer from 1 to {EPOCH_MAX}, got {n!r}")
    return _EPOCH.pack(n)


def decode_epoch(b: bytes | None) -> int | None:
    """Decode the epoch number of an epoch value: a token or an old-format 8-byte epoch.

    Anything but 8 or :data:`EPOCH_TOKEN_SIZE` bytes whose first 8 hold ``1 .. 2**53 - 2``
    gives ``None``.
    """
    if not isinstance(b, (bytes, bytearray, memoryview)):
        return None
    size = len(b)
    if size != EPOCH_TOKEN_SIZE and size != 8:
        return None
    (value,) = _EPOCH.unpack_from(b)
    return int(value) if 1 <= value <= EPOCH_MAX else None


@dataclass(frozen=True, slots=True)
class EpochToken:
    """A decoded epoch value.

    :param epoch: the epoch number (what orders owners, shown by the CLI and ``ClaimHandle.epoch``).
    :param mint_id: the random bytes of this minting; empty for an old-format 8-byte epoch.
    """

    epoch: int
    mint_id: bytes


def encode_token(n: int, mint_id: bytes) -> bytes:
    """Encode a token: the 8-byte epoch ``n`` followed by ``mint_id``.

    :raises ValueError: ``n`` is out of range or ``mint_id`` is not :data:`MINT_ID_SIZE` bytes.
    """
    if not isinstance(mint_id, bytes) or len(mint_id) != MINT_ID_SIZE:
        raise ValueError(f"a mint id must be {MINT_ID_SIZE} bytes, got {mint_id!r}")
    return encode_epoch(n) + mint_id


def mint_token(n: int) -> bytes:
    """A new token for epoch ``n`` with a fresh random mint id (never equal to another minting).

    :raises ValueError: ``n`` is not an integer in ``1 .. 2**53 - 2``.
    """
    return encode_epoch(n) + os.urandom(MINT_ID_SIZE)


def decode_token(b: bytes | None) -> EpochToken | None:
    """Decode an epoch value into its number and mint id; ``None`` where :func:`decode_epoch`
    gives ``None``. An old-format 8-byte epoch has an empty mint id."""
    epoch = decode_epoch(b)
    if epoch is None:
        return None
    assert b is not None
    return EpochToken(epoch, bytes(b[8:]))


@dataclass(frozen=True, slots=True)
class HolderRecord:
    """Who holds a workflow's claim and until when.

    ``expires_at`` moves on every renewal; ``claimed_at`` stays at the acquire/takeover time.
    """

    engine_id: str
    epoch: int
    expires_at: int
    claimed_at: int


def encode_holder(record: HolderRecord) -> bytes:
    """Encode a holder record as a MessagePack map with keys in a fixed order.

    :raises ValueError: a field is out of range (the record could never decode).
    """
    if not isinstance(record.engine_id, str) or not record.engine_id:
        raise ValueError(f"holder engine_id must be a non-empty str, got {record.engine_id!r}")
    if not _is_epoch(record.epoch):
        raise ValueError(f"holder epoch must be 1 .. {EPOCH_MAX}, got {record.epoch!r}")
    for name in ("expires_at", "claimed_at"):
        value = getattr(record, name)
        if not _is_safe_non_negative(value):
            raise ValueError(f"holder {name} must be 0 .. {SAFE_INT_MAX} ms, got {value!r}")
    return _pack(
        {
            "engine_id": record.engine_id,
            "epoch": record.epoch,
            "expires_at": record.expires_at,
            "claimed_at": record.claimed_at,
        }
    )


def decode_holder(b: bytes | None) -> HolderRecord | None:
    """Decode holder bytes; return ``None`` for anything but a valid record. Never raises."""
    data = _unpack_map(b)
    if data is None:
        return None
    engine_id = data.get("engine_id")
    epoch = data.get("epoch")
    expires_at = data.get("expires_at")
    claimed_at = data.get("claimed_at")
    if not isinstance(engine_id, str) or not engine_id:
        return None
    if not _is_epoch(epoch):
        return None
    if not (_is_safe_non_negative(expires_at) and _is_safe_non_negative(claimed_at)):
        return None
    return HolderRecord(engine_id, epoch, expires_at, claimed_at)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ModeMarker:
    """The store-wide record of which ownership mode its engines run."""

    mode: OwnershipMode
    established_at: int


def encode_mode_marker(marker: ModeMarker) -> bytes:
    """Encode the mode marker as a MessagePack map ``{mode, established_at}``.

    :raises ValueError: unknown mode or an out-of-range timestamp.
    """
    if marker.mode not in _MODES:
        raise ValueError(f"marker mode must be one of {_MODES}, got {marker.mode!r}")
    if not _is_safe_non_negative(marker.established_at):
        raise ValueError(
            f"marker established_at must be 0 .. {SAFE_INT_MAX} ms, got {marker.established_at!r}"
        )
    return _pack({"mode": marker.mode, "established_at": marker.established_at})


def decode_mode_marker(b: bytes | None) -> ModeMarker | None:
    """Decode marker bytes; return ``None`` for anything but a valid marker. Never raises."""
    data = _unpack_map(b)
    if data is None:
        return None
    mode = data.get("mode")
    established_at = data.get("established_at")
    if not isinstance(mode, str) or mode not in _MODES:
        return None
    if not _is_safe_non_negative(established_at):
        return None
    return ModeMarker(mode, established_at)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class WorkflowRecord:
    """The durable state of one workflow (``wf:<id>``)."""

    workflow_id: str
    type: str
    status: str
    input: Any = None
    created_at: int = 0
    updated_at: int = 0
    revision: str | None = None


def encode_workflow_record(record: WorkflowRecord) -> bytes:
    """Encode a workflow record as a MessagePack map.

    :raises ValueError: unknown status, empty id/type, bad timestamps, or an ``input`` that
        MessagePack cannot encode.
    """
    if not isinstance(record.workflow_id, str) or not record.workflow_id:
        raise ValueError(f"workflow_id must be a non-empty str, got {record.workflow_id!r}")
    if not isinstance(record.type, str) or not record.type:
        raise ValueError(f"workflow type must be a non-empty str, got {record.type!r}")
    if record.status not in WORKFLOW_STATUSES:
        raise ValueError(
            f"workflow status must be one of {', '.join(WORKFLOW_STATUSES)}, got {record.status!r}"
        )
    for name in ("created_at", "updated_at"):
        value = getattr(record, name)
        if not _is_safe_non_negative(value):
            raise ValueError(f"workflow {name} must be 0 .. {SAFE_INT_MAX} ms, got {value!r}")
    if record.revision is not None and not isinstance(record.revision, str):
        raise ValueError(f"workflow revision must be a str or None, got {record.revision!r}")
    data: dict[str, Any] = {
        "workflow_id": record.workflow_id,
        "type": record.type,
        "status": record.status,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
    }
    if record.input is not None:
        data["input"] = record.input
    if record.revision is not None:
        data["revision"] = record.revision
    try:
        return _pack(data)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(
            f"the input of workflow {record.workflow_id!r} cannot be stored as MessagePack: {exc}"
        ) from None


def decode_workflow_record(b: bytes) -> WorkflowRecord:
    """Decode a workflow record.

    :raises ValueError: the bytes are not a valid workflow record.
    """
    record = try_decode_workflow_record(b)
    if record is None:
        shown = bytes(b[:60]) if isinstance(b, (bytes, bytearray, memoryview)) else b
        raise ValueError(f"not a valid workflow record: {shown!r:.120}")
    return record


def try_decode_workflow_record(b: bytes | None) -> WorkflowRecord | None:
    """Like :func:`decode_workflow_record` but return ``None`` instead of raising."""
    data = _unpack_map(b)
    if data is None:
        return None
    workflow_id = data.get("workflow_id")
    wf_type = data.get("type")
    status = data.get("status")
    created_at = data.get("created_at", 0)
    updated_at = data.get("updated_at", 0)
    revision = data.get("revision")
    if not isinstance(workflow_id, str) or not workflow_id:
        return None
    if not isinstance(wf_type, str) or not isinstance(status, str) or not status:
        return None
    if not (_is_safe_non_negative(created_at) and _is_safe_non_negative(updated_at)):
        return None
    if revision is not None and not isinstance(revision, str):
        return None
    return WorkflowRecord(
        workflow_id, wf_type, status, data.get("input"), created_at, updated_at, revision
    )
