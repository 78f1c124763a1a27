"""Engine liveness records: one MessagePack record per engine at ``wf-owner-engine:<id>``.

An engine writes its record when it opens, from its maintenance passes (its heartbeat: see
:func:`~weft_sync.reclaim.engine_liveness.heartbeat_due` for which passes write) and when it closes.
Other engines read the few records to judge which engines are alive (see
:mod:`~weft_sync.reclaim.verdicts`); the command line reads them to show each claim's driver
state. The decoder fails closed exactly as the holder codec does: anything but a record of the
exact shape decodes to ``None``, never raises.

Two keys are written only when they have a value, so a record without them keeps the exact bytes
(and the exact key set) that engines without them write and decode:

- ``lock_id``: the identity of the session lock the record names (a text).
- ``undriven``: the workflow claims this engine holds without a live driver, written only while
  there is at least one. A map with exactly the keys ``awaiting`` (claims within their grace of
  one renew interval, waiting for a ``drive()`` block or a handler), ``no_driver`` (claims past
  the grace or whose driver thread ended, released by the pass that found them, and claims whose
  release failed, left to expire) and ``count`` (how many there are in all). Each list holds
  workflow ids in ascending order, none in both; together they name every such claim, or the
  first :data:`MAX_UNDRIVEN_IDS` (``no_driver`` first) when ``count`` is larger. An older
  engine's decoder reads a record carrying the key as undecodable: it judges that engine
  ``STALE`` (its claims go by their expiry, never early) until the key is gone again, within one
  renew interval unless a release failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
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
# Written only while a claim has no live driver, for the same reason.
_UNDRIVEN: Final = "undriven"
_OPTIONAL: Final = frozenset({_LOCK_ID, _UNDRIVEN})
_UNDRIVEN_FIELDS: Final = ("awaiting", "no_driver", "count")
MAX_UNDRIVEN_IDS: Final = 32
"""The most workflow ids one record names as undriven; ``count`` says how many there are."""


@dataclass(frozen=True, slots=True)
class UndrivenClaims:
    """The workflow claims an engine holds without a live driver, as its record publishes them.

    :param awaiting: claims waiting for a driver within their grace (one renew interval).
    :param no_driver: claims past the grace or whose driver thread ended (the pass that found
        them releases them), and claims whose release failed (left to expire).
    :param count: how many undriven claims there are; more than the two lists name only when
        they hold :data:`MAX_UNDRIVEN_IDS` ids between them.
    """

    awaiting: tuple[str, ...]
    no_driver: tuple[str, ...]
    count: int

    @classmethod
    def of(cls, awaiting: Sequence[str], no_driver: Sequence[str]) -> UndrivenClaims | None:
        """The report naming these claims (``no_driver`` first when cut), ``None`` for none.

        An id in both lists counts as ``no_driver``.
        """
        without = sorted(set(no_driver))
        waiting = sorted(set(awaiting).difference(without))
        count = len(waiting) + len(without)
        if count == 0:
            return None
        shown = tuple(without[:MAX_UNDRIVEN_IDS])
        return cls(tuple(waiting[: MAX_UNDRIVEN_IDS - len(shown)]), shown, count)

    def names(self, workflow_id: str) -> bool:
        """Whether either list names ``workflow_id``."""
        return workflow_id in self.awaiting or workflow_id in self.no_driver

    @property
    def complete(self) -> bool:
        """Whether the lists name every undriven claim (``count`` is not larger)."""
        return self.count == len(self.awaiting) + len(self.no_driver)


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
    :param undriven: the workflow claims it held without a live driver at the last heartbeat,
        or ``None`` when there were none (or the engine publishes no driver state).
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
    undriven: UndrivenClaims | None = None


def _text(value: object, *, empty: bool) -> bool:
    return isinstance(value, str) and (empty or bool(value)) and len(value) <= _MAX_TEXT


def _count(value: object, *, positive: bool = False) -> bool:
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return (1 if positive else 0) <= value <= SAFE_INT_MAX


def _ids(value: object) -> bool:
    """Whether ``value`` is a tuple of workflow ids in strictly ascending order."""
    if not isinstance(value, tuple) or not all(_text(v, empty=False) for v in value):
        return False
    return all(a < b for a, b in pairwise(value))


def _undriven(u: object) -> bool:
    if not isinstance(u, UndrivenClaims) or not (_ids(u.awaiting) and _ids(u.no_driver)):
        return False
    listed = len(u.awaiting) + len(u.no_driver)
    if not 0 < listed <= MAX_UNDRIVEN_IDS or set(u.awaiting) & set(u.no_driver):
        return False
    # The lists are cut only when full, so one set of claims has one encoding.
    return _count(u.count) and (u.count == listed or (listed == MAX_UNDRIVEN_IDS < u.count))


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
        ("undriven", r.undriven is None or _undriven(r.undriven)),
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
            f"0 .. {SAFE_INT_MAX}, TTL and interval at least 1, undriven ids sorted, unique and "
            f"at most {MAX_UNDRIVEN_IDS})"
        )
    data: dict[str, object] = {name: getattr(record, name) for name in _FIELDS}
    if record.lock_id is not None:
        data[_LOCK_ID] = record.lock_id
    if (undriven := record.undriven) is not None:
        data[_UNDRIVEN] = {
            "awaiting": list(undriven.awaiting),
            "no_driver": list(undriven.no_driver),
            "count": undriven.count,
        }
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


def decode_engine_record(raw: bytes | None) -> EngineRecord | None:
    """Decode record bytes; ``None`` for anything but a valid record. Never raises.

    The map must have exactly the record's keys (``lock_id`` and ``undriven`` only when they
    have a value): a missing or unknown key fails, as does a value of the wrong type (a ``bool``
    is not an integer) or out of range.
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        return None
    try:
        data: Any = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on malformed input
        return None
    if not isinstance(data, dict) or set(data) - _OPTIONAL != set(_FIELDS):
        return None
    if any(name in data and data[name] is None for name in _OPTIONAL):
        return None  # never written so: one record, one encoding
    undriven = None
    if _UNDRIVEN in data:
        undriven = _decode_undriven(data[_UNDRIVEN])
        if undriven is None:
            return None
    try:
        record = EngineRecord(
            **{name: data[name] for name in _FIELDS},
            lock_id=data.get(_LOCK_ID),
            undriven=undriven,
        )
    except TypeError:  # pragma: no cover - the key set was checked
        return None
    return record if _valid(record) is None else None


def _decode_undriven(value: Any) -> UndrivenClaims | None:
    """The ``undriven`` map's value, shape checked (its ranges are checked with the record)."""
    if not isinstance(value, dict) or set(value) != set(_UNDRIVEN_FIELDS):
        return None
    awaiting, no_driver = value["awaiting"], value["no_driver"]
    if not isinstance(awaiting, list) or not isinstance(no_driver, list):
        return None
    return UndrivenClaims(tuple(awaiting), tuple(no_driver), value["count"])


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
