"""Judging engines from their liveness records and session locks.

The verdicts, in the order :func:`judge_engine` decides them:

1. ``STALE`` when the record does not decode: nothing in it can be trusted, not even a lock name,
   so the engine's claims are left to the normal expiry rule on a fresh read.
2. ``CLOSED``: the engine closed and left claims behind (its record says ``"closed"``).
3. ``CRASHED``: the record says ``"live"`` and the probe *proves* the lock object it names (its
   published identity) free: the same lock file, unlocked; a PostgreSQL session ended on a server
   that has not restarted since, with none of its store's sessions left. Only proof counts.
4. ``STALE`` when the heartbeat is older than ``claim_ttl + 2 * renew interval`` on the judge's
   clock: a frozen (``SIGSTOP``) or partitioned engine, or one without a lock that stopped. A
   frozen engine keeps its session lock, so a stale heartbeat wins over a held lock.
5. ``UNKNOWN`` when the record names a lock and the probe could neither see it held nor prove it
   free: the lock file or its directory is missing or was replaced, the server restarted since
   the lock was taken, a session of the engine's store is still connected, or the probe failed.
   Like ``STALE``, its claims go by their expiry, never early; a live engine that lost its lock
   takes it again and republishes its record, and is ``LIVE`` again from the next probe. (A
   judge whose own lock is gone believes no lock at all: it judges by heartbeats.)
6. ``LIVE`` otherwise: a fresh heartbeat, and the lock held or nothing to ask (the engine runs
   without a lock, or the store has no session locks).

A verdict is evidence for discovery, never a licence to write: every takeover stays a compare
and swap on the exact holder and epoch observed, so a wrong ``CRASHED`` moves work needlessly but
never lets two owners write.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..storage import Storage
from ..storage.session_locks import LockState as LockState
from ..storage.session_locks import storage_session_locks
from .engine_records import EngineRecord, decode_engine_rows, read_engine_records


class EngineVerdict(str, enum.Enum):
    """What another engine concludes about an engine (see the module docstring)."""

    LIVE = "live"
    CRASHED = "crashed"
    CLOSED = "closed"
    STALE = "stale"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """One engine as a survey saw it.

    :param engine_id: the id from the record's key.
    :param verdict: the judgement.
    :param record: the decoded record, ``None`` when it does not decode.
    :param raw: the record's exact bytes (for a conditional delete).
    :param lock_state: what the probe proved about its lock; ``None`` when not probed (no lock
        named, the record not live, or the store has no session locks).
    """

    engine_id: str
    verdict: EngineVerdict
    record: EngineRecord | None
    raw: bytes
    lock_state: LockState | None = None

    @property
    def lock_held(self) -> bool | None:
        """Whether its lock was held at the probe: ``False`` only for a lock proven free."""
        state = self.lock_state
        if state is None or state is LockState.UNKNOWN:
            return None
        return state is LockState.HELD


def stale_after_ms(record: EngineRecord) -> int:
    """How old a heartbeat may be before the engine counts as stopped: TTL + 2 renew intervals."""
    return record.claim_ttl_ms + 2 * record.renew_interval_ms


def judge_engine(
    record: EngineRecord | None, lock_state: LockState | None, now: int
) -> EngineVerdict:
    """Judge one engine (pure).

    :param record: its decoded record, or ``None`` when it does not decode.
    :param lock_state: what the probe proved about its lock, or ``None`` when it was not
        probed because the store has no session locks (the heartbeat alone decides).
    :param now: the judge's clock, in ms.
    """
    if record is None:
        return EngineVerdict.STALE
    if record.state == "closed":
        return EngineVerdict.CLOSED
    if record.lock is not None and lock_state is LockState.FREE:
        return EngineVerdict.CRASHED
    if now - record.heartbeat_at > stale_after_ms(record):
        return EngineVerdict.STALE
    if record.lock is not None and lock_state is LockState.UNKNOWN:
        return EngineVerdict.UNKNOWN
    return EngineVerdict.LIVE


@dataclass(frozen=True, slots=True)
class Survey:
    """What :func:`take_survey` saw.

    :param statuses: every engine, judged.
    :param own_lock_held: whether the judge's own lock was held at the probe; ``None`` when it
        was not probed (no ``own_lock`` given, or no lock to probe at all).
    """

    statuses: list[EngineStatus]
    own_lock_held: bool | None


def take_survey(
    storage: Storage,
    *,
    now: int,
    exclude: Collection[str] = (),
    own_lock: str | None = None,
    probe: bool = True,
    rows: Sequence[tuple[str, bytes]] | None = None,
) -> Survey:
    """Read every engine record (one prefix scan) and probe their locks (one probe), then judge.

    Only the locks of records in state ``"live"`` are probed, each by the identity its record
    publishes; on a store without session locks nothing is probed and the heartbeat alone
    decides.

    :param now: the judge's clock, in ms.
    :param exclude: engine ids to leave out (the judge itself).
    :param own_lock: the name of the judge's own session lock, probed along. When it is not held,
        the store lost sessions rather than engines (a PostgreSQL restart, or this host cut off),
        so no lock is believed: every verdict falls back to the heartbeat (no ``CRASHED``).
    :param probe: ``False`` probes no lock (after a failed probe): every engine with a lock is
        ``UNKNOWN`` (or ``STALE``), none ``CRASHED``.
    :param rows: the engine records' rows, when the caller scanned their prefix already (in
        the same statement as other reads); ``None`` scans it here.
    :raises StorageError: the scan or the probe failed.
    """
    skip = set(exclude)
    found = read_engine_records(storage) if rows is None else decode_engine_rows(rows)
    entries = [entry for entry in found if entry[0] not in skip]
    locks = storage_session_locks(storage)
    asked = {
        record.lock: record.lock_id
        for _, _, record in entries
        if record is not None and record.state == "live" and record.lock is not None
    }
    states: dict[str, LockState] = {}
    own_held: bool | None = None
    if locks is not None and probe and asked:
        if own_lock is not None:
            # Only whether it is held matters for the judge's own lock: no identity asked.
            asked = {**asked, own_lock: None} if own_lock not in asked else asked
        states = locks.probe_session_locks(asked)
        own_held = None if own_lock is None else states.get(own_lock) is LockState.HELD
    trusted = own_held is not False
    statuses: list[EngineStatus] = []
    for engine_id, raw, record in entries:
        state: LockState | None = None
        if locks is not None and trusted and record is not None and record.lock in asked:
            state = states.get(record.lock, LockState.UNKNOWN)
        verdict = judge_engine(record, state, now)
        statuses.append(EngineStatus(engine_id, verdict, record, raw, state))
    return Survey(statuses, own_held)


def survey_engines(
    storage: Storage,
    *,
    now: int,
    exclude: Collection[str] = (),
    own_lock: str | None = None,
    probe: bool = True,
    rows: Sequence[tuple[str, bytes]] | None = None,
) -> list[EngineStatus]:
    """The statuses of :func:`take_survey` (same arguments)."""
    survey = take_survey(
        storage, now=now, exclude=exclude, own_lock=own_lock, probe=probe, rows=rows
    )
    return survey.statuses
