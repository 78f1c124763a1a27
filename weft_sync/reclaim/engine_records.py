"""Engine liveness records: one MessagePack record per engine at ``wf-owner-engine:<id>``.

An engine writes its record when it opens, from its maintenance passes (its heartbeat: see
:func:`~weft_sync.reclaim.engine_liveness.heartbeat_due` for which passes write) and when it closes.
Other engines read the few records to judge which engines are alive (see
:mod:`~weft_sync.reclaim.verdicts`). The decoder fails closed exactly as the holder codec does:
anything but a record of the exact shape decodes to ``None``, never raises.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import msgpack

from ..codec import SAFE_INT_MAX
from ..keys import engine_liveness, try_decode_key_component
from ..storage import Storage

EngineState = Literal["live", "closed"]
ENGINE_STATES: Final = get_args(EngineState)
ENGINE_RECORD_PREFIX: Final = engine_liveness("")
_MAX_TEXT: Final = 1024
MAX_ENGINE_ID_LENGTH: Final = _MAX_TEXT
_FIELDS: Final = (
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
)
# Written only with a lock identity, so a record without one has the bytes it always had.
_LOCK_ID: Final = "lock_id"


@dataclass(frozen=True, slots=True)
class EngineRecord:
    """What one engine says about itself.

    :param engine_id: the engine's id (also encoded in the record's key).
    :param state: ``"live"`` while open, ``"closed"`` after a close that left claims behind.
    :param heartbeat_at: when it last wrote the record, in ms on its own clock.
    :param claim_ttl_ms: its claim TTL; with ``renew_interval_ms`` it bounds how stale a
        heartbeat may be before the engine counts as stopped.
    :param renew_interval_ms: its renew interval (one heartbeat per pass).
    :param held: how many claims it held at the last heartbeat.
    :param lock: the name of the session lock it holds while alive, or ``None`` (TTL only).
    :param pid: its process id (for people; never used to judge liveness).
    :param host: its host name (for people).
    :param started_at: when it opened, in ms.
    :param watching: whether it probes the other engines' locks (a running engine with crash
        probing on): it takes its share of a crashed engine's claims within milliseconds.
    :param lock_id: the identity of the lock object it holds (``SessionLock.identity``: a lock
        file's device and inode, a PostgreSQL session), or ``None``. Only a probe of this
        identity can prove the engine crashed; a record naming a lock without one (an older
        engine) is never judged crashed.
    """

    engine_id: str
    state: EngineState
    heartbeat_at: int
    claim_ttl_ms: int
    renew_interval_ms: int
    held: int
    lock: str | None
    pid: int
    host: str
    started_at: int
    watching: bool = False
    lock_id: str | None = None


def _text(value: object, *, empty: bool) -> bool:
    return isinstance(value, str) and (empty or bool(value)) and len(value) <= _MAX_TEXT


def _count(value: object, *, positive: bool = False) -> bool:
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return (1 if positive else 0) <= value <= SAFE_INT_MAX


def _valid(r: EngineRecord) -> str | None:
    """The name of the first field out of range, or ``None`` for a valid record."""
    checks: tuple[tuple[str, bool], ...] = (
        ("engine_id", _text(r.engine_id, empty=False)),
        ("state", isinstance(r.state, str) and r.state in ENGINE_STATES),
        ("heartbeat_at", _count(r.heartbeat_at)),
        ("claim_ttl_ms", _count(r.claim_ttl_ms, positive=True)),
        ("renew_interval_ms", _count(r.renew_interval_ms, positive=True)),
        ("held", _count(r.held)),
        ("lock", r.lock is None or _text(r.lock, empty=False)),
        ("pid", _count(r.pid)),
        ("host", _text(r.host, empty=True)),
        ("started_at", _count(r.started_at)),
        ("watching", isinstance(r.watching, bool)),
        ("lock_id", r.lock_id is None or (r.lock is not None and _text(r.lock_id, empty=False))),
    )
    for name, ok in checks:
        if not ok:
            return name
    return None


def encode_engine_record(record: EngineRecord) -> bytes:
    """Encode ``record`` as a MessagePack map with its keys in a fixed order (same bytes always).

    :raises ValueError: a field is out of range, named in the message (it could never decode).
    """
    bad = _valid(record)
    if bad is not None:
        raise ValueError(
            f"engine record field {bad} is out of range: {getattr(record, bad)!r:.80} (ids and "
            f"host up to {_MAX_TEXT} characters, state one of {ENGINE_STATES}, times and counts "
            f"0 .. {SAFE_INT_MAX}, TTL and interval at least 1)"
        )
    data = {name: getattr(record, name) for name in _FIELDS}
    if record.lock_id is not None:
        data[_LOCK_ID] = record.lock_id
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


def decode_engine_record(raw: bytes | None) -> EngineRecord | None:
    """Decode record bytes; ``None`` for anything but a valid record. Never raises.

    The map must have exactly the record's keys (``lock_id`` only when there is one): a missing
    or unknown key fails, as does a
    value of the wrong type (a ``bool`` is not an integer) or out of range.
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        return None
    try:
        data: Any = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on malformed input
        return None
    if not isinstance(data, dict) or set(data) - {_LOCK_ID} != set(_FIELDS):
        return None
    if _LOCK_ID in data and data[_LOCK_ID] is None:
        return None  # never written so: one record, one encoding
    try:
        record = EngineRecord(**{name: data[name] for name in _FIELDS}, lock_id=data.get(_LOCK_ID))
    except TypeError:  # pragma: no cover - the key set was checked
        return None
    return record if _valid(record) is None else None


def read_engine_records(storage: Storage) -> list[tuple[str, bytes, EngineRecord | None]]:
    """Read every engine record: ``(engine id from the key, raw bytes, record or None)``.

    A key whose id does not decode is skipped (it names no engine). A record that does not
    decode, or names another engine than its key, is returned with ``None``.

    :raises StorageError: the scan failed.
    """
    return decode_engine_rows(storage.scan(ENGINE_RECORD_PREFIX))


def decode_engine_rows(
    rows: Iterable[tuple[str, bytes]],
) -> list[tuple[str, bytes, EngineRecord | None]]:
    """What :func:`read_engine_records` returns, from the rows of a scan of its prefix."""
    found: list[tuple[str, bytes, EngineRecord | None]] = []
    for key, raw in rows:
        engine_id = try_decode_key_component(key[len(ENGINE_RECORD_PREFIX) :])
        if not engine_id:
            continue
        record = decode_engine_record(raw)
        if record is not None and record.engine_id != engine_id:
            record = None
        found.append((engine_id, raw, record))
    return found
