"""What a reclaim discovery returns, and the full-scan discovery every store supports."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from msgpack import unpackb as _unpackb

from ..claims.engine_index import read_engine_entries
from ..claims.transitions import is_claim_expired
from ..codec import EPOCH_MAX, SAFE_INT_MAX, decode_holder
from ..errors import StorageError
from ..storage.base import Storage
from .engine_records import ENGINE_RECORD_PREFIX
from .scan import HolderJudge, ReclaimDiscovery, discover_reclaim_candidates
from .verdicts import EngineStatus, EngineVerdict, survey_engines

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineDiscovery(ReclaimDiscovery):
    """A :class:`~.reclaim_scan.ReclaimDiscovery` plus what the engine records told.

    :param dead_engines: engines seen crashed or closed: their holders may be taken over before
        they expire.
    :param dead_records: the same engines, each with the exact bytes of the record it was judged
        on: what a takeover passes, so that it takes a holder early only while that record is
        unchanged (never the claim of an engine restarted under the same id since).
    :param urgent: candidates of dead engines listed for a while already: taken now, whatever
        the fair share (the others had their turn).
    :param dead_left: some dead engine still has claims this pass did not list.
    :param dead_claims: the candidates of dead engines, in scan order (also in ``stranded``).
    :param participants: the live engines that see crashes too (they hold a session lock):
        a dead engine's claims are split among them and this engine by rendezvous hashing.
    """

    dead_engines: frozenset[str] = frozenset()
    dead_records: dict[str, bytes] = field(default_factory=dict)
    urgent: set[str] = field(default_factory=set)
    dead_left: bool = False
    dead_claims: list[str] = field(default_factory=list)
    participants: frozenset[str] = frozenset()


class Discovery(Protocol):
    """How a reclaim target finds its candidates."""

    def discover(self, exclude: Collection[str]) -> EngineDiscovery:
        """Find the candidates, leaving out ``exclude`` (this engine's own claims)."""
        ...


class ScanDiscovery:
    """The full scans of :mod:`.reclaim_scan`: cost proportional to the whole store.

    Kept as the fallback discovery (``OwnershipOptions(reclaim_discovery="scan")``). Given
    ``engine_id`` and ``clock`` it also surveys the engine records, so that a crashed or closed
    engine's holders count as stranded (and may be taken over before they expire).
    """

    def __init__(
        self,
        storage: Storage,
        judge: HolderJudge,
        *,
        skip_live: bool,
        engine_id: str | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self._storage = storage
        self._judge = judge
        self._skip_live = skip_live
        self._engine_id = engine_id
        self._clock = clock

    def discover(self, exclude: Collection[str]) -> EngineDiscovery:
        statuses = self._survey()
        records = {
            s.engine_id: s.raw
            for s in statuses
            if s.verdict in (EngineVerdict.CRASHED, EngineVerdict.CLOSED)
        }
        dead = frozenset(records)
        judge = self._judge
        if dead:
            base = judge

            def judge(holder_bytes: bytes) -> str | None:
                holder = decode_holder(holder_bytes)
                if holder is not None and holder.engine_id in dead:
                    return None
                return base(holder_bytes)

        found = discover_reclaim_candidates(
            self._storage, exclude, judge=judge, skip_live=self._skip_live
        )
        result = EngineDiscovery(found.candidates, found.stranded, found.live_claims)
        if not statuses:
            return result
        stranded = set(found.stranded)
        for engine in sorted(dead):
            rows = read_engine_entries(self._storage, engine, limit=len(stranded) + 1)
            result.dead_claims.extend(wid for wid, _ in rows if wid in stranded)
        result.dead_engines = dead  # the full scan lists every dead claim: none is left unlisted
        result.dead_records = records
        result.participants = crash_participants(statuses)
        for status in statuses:
            # Idle engines count in the fair share too: the holder scan cannot see them.
            if status.verdict is EngineVerdict.LIVE and status.record is not None:
                result.live_claims.setdefault(status.engine_id, status.record.held)
        return result

    def _survey(self) -> list[EngineStatus]:
        if self._engine_id is None or self._clock is None:
            return []
        return survey_for_discovery(self._storage, now=self._clock(), engine_id=self._engine_id)


def survey_for_discovery(
    storage: Storage,
    *,
    now: int,
    engine_id: str,
    rows: Sequence[tuple[str, bytes]] | None = None,
) -> list[EngineStatus]:
    """Survey the other engines; judge by heartbeats alone when the lock probe fails.

    Session locks only speed up what the claims' expiry rule decides anyway: a probe that
    fails costs this pass its ``CRASHED`` verdicts, never its takeovers of expired claims.

    :param rows: the engine records' rows if the caller read them already (see
        :func:`~weft_sync.reclaim.verdicts.take_survey`).
    :raises StorageError: the engine records could not be read.
    """
    if rows is None:
        # Read once: a failed probe then judges the same records by their heartbeats.
        rows = storage.scan(ENGINE_RECORD_PREFIX)
    try:
        # A survey that finds this engine's own lock gone (a database restart ends every lock
        # session at once) trusts no lock and judges by heartbeats.
        return survey_engines(storage, now=now, exclude=(engine_id,), own_lock=engine_id, rows=rows)
    except StorageError as exc:
        _log.warning("weft_sync: probing the engines' session locks failed this pass: %s", exc)
    return survey_engines(storage, now=now, exclude=(engine_id,), probe=False, rows=rows)


def crash_participants(statuses: list[EngineStatus]) -> frozenset[str]:
    """The live engines that see crashes too: they hold a session lock and probe the others'."""
    return frozenset(
        status.engine_id
        for status in statuses
        if status.verdict is EngineVerdict.LIVE
        and status.record is not None
        and status.record.lock is not None
        and status.record.watching
    )


class ExpiryJudge:
    """A judge naming a holder's engine while it is unexpired on ``clock``, else ``None``.

    An undecodable holder is never live: a takeover may replace it at once. Called as a
    :data:`~.reclaim_scan.HolderJudge` it reads the clock per holder; :meth:`at_once` gives a
    judge that reads it once, for the holders of one snapshot read.
    """

    __slots__ = ("_clock", "_renew_interval_ms")

    def __init__(self, clock: Callable[[], int], renew_interval_ms: int) -> None:
        self._clock = clock
        self._renew_interval_ms = renew_interval_ms

    def __call__(self, holder_bytes: bytes) -> str | None:
        return self._judge(holder_bytes, self._clock())

    def at_once(self) -> HolderJudge:
        """A judge of holders at the time now (one clock reading for all of them)."""
        now = self._clock()
        return lambda holder_bytes: self._judge(holder_bytes, now)

    def _judge(self, holder_bytes: bytes, now: int) -> str | None:
        fields = holder_engine_and_expiry(holder_bytes)
        if fields is None:
            return None
        engine_id, expires_at = fields
        expired = is_claim_expired(
            expires_at=expires_at, now=now, renew_interval_ms=self._renew_interval_ms
        )
        return None if expired else engine_id


def holder_engine_and_expiry(holder_bytes: object) -> tuple[str, int] | None:
    """A holder's engine id and expiry, or ``None`` where the codec's holder decoder gives none.

    Accepts exactly what :func:`~weft_sync.codec.decode_holder` accepts, and never raises; the
    same checks without building the record: a window judges 256 holders a pass. MessagePack
    decodes to plain ``str`` and ``int`` (``True`` is a ``bool``), so exact type checks are
    the codec's ``isinstance`` checks here.
    """
    if type(holder_bytes) is not bytes:
        fields = decode_holder(holder_bytes)  # type: ignore[arg-type]
        return None if fields is None else (fields.engine_id, fields.expires_at)
    try:
        data = _unpackb(holder_bytes, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on malformed input
        return None
    if type(data) is not dict:
        return None
    engine_id = data.get("engine_id")
    epoch = data.get("epoch")
    expires_at = data.get("expires_at")
    claimed_at = data.get("claimed_at")
    if type(engine_id) is not str or not engine_id:
        return None
    if type(epoch) is not int or not 1 <= epoch <= EPOCH_MAX:
        return None
    if type(expires_at) is not int or not 0 <= expires_at <= SAFE_INT_MAX:
        return None
    if type(claimed_at) is not int or not 0 <= claimed_at <= SAFE_INT_MAX:
        return None
    return engine_id, expires_at


def expiry_judge(clock: Callable[[], int], renew_interval_ms: int) -> ExpiryJudge:
    """An :class:`ExpiryJudge` on ``clock``."""
    return ExpiryJudge(clock, renew_interval_ms)
