"""Reclaim discovery that reads what can be stranded, not the whole store.

One discovery (one reclaim pass) reads:

1. **The engine records** (one short prefix scan, in the same statement as the windows of 3
   where the store can) and probes their session locks once
   (:func:`weft_sync.reclaim.verdicts.survey_engines`). Live engines are not read further: the
   claim count each one publishes feeds the fair share, so an idle survivor counts as much as a
   busy one.
2. **The by-engine entries of dead engines** — crashed (record live, its lock object proven
   free), closed, stale (no heartbeat for a TTL plus the grace) or unknown (a lock not seen but
   not proven free) — at most :data:`DEAD_ENGINE_READ_LIMIT` per
   engine per pass. A crashed or closed engine's holders may be taken over before they expire
   (:attr:`EngineDiscovery.dead_records`: only while the engine's record still has the bytes
   judged, so never the claim of an engine restarted under the same id since; every takeover
   is still an epoch CAS on the exact bytes read, so a wrong verdict moves work and never lets
   two owners write). A stale engine's
   holders are judged by the expiry rule like any other: a frozen engine keeps its claims until
   they expire.
3. **Three rotating windows** (:class:`~.scan_windows.RotatingWindow`, each at most
   :data:`DISCOVERY_WINDOW` rows per pass) as backstops for what the index cannot show: holders
   that expired while their engine looks alive, or that an engine without the index wrote
   (holder window); running workflows nobody holds, after a graceful release or in a store whose
   claims were never indexed (running-index window); running records of stores whose status
   index was never backfilled (workflow-record window). A window covers ``N`` keys in
   ``ceil(N / DISCOVERY_WINDOW) + 1`` passes.

Until the store carries the index marker (a store created before the index existed), discovery
runs the full scans of :mod:`.reclaim_scan` instead, so no stranded claim is ever invisible
during the migration, and each pass runs one whole backfill sweep in steps of
:data:`BACKFILL_BUDGET` keys: the migration ends within two passes (one that fixes the entries,
one whose clean sweep writes the marker) while no engine of an older version keeps writing
holders without entries.

A discovery object belongs to one engine; its lock guards what it remembers between passes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from typing import Final

from .. import keys
from ..claims.engine_index import backfill_step, index_marker_present, read_engine_entries
from ..codec import try_decode_workflow_record
from ..storage.base import Storage
from ..storage.reads import ScanRange, storage_get_many
from .discoveries import (
    EngineDiscovery,
    ExpiryJudge,
    crash_participants,
    survey_for_discovery,
)
from .engine_gc import forget_engine
from .engine_records import ENGINE_RECORD_PREFIX
from .scan import HolderJudge, discover_reclaim_candidates
from .scan_windows import RotatingWindow, read_windows
from .verdicts import EngineStatus, EngineVerdict

_log = logging.getLogger(__name__)

DISCOVERY_WINDOW: Final = 256
"""Rows each backstop window reads per pass."""

DEAD_ENGINE_READ_LIMIT: Final = 10_000
"""By-engine entries read per dead engine per pass."""

DEAD_SHARE_WINDOW_MS: Final = 250
"""How long a dead engine's claim waits for its fair-share taker before anyone takes it."""

BACKFILL_BUDGET: Final = 2_000
"""Keys one backfill step reads (and fixes in one ``conditional_batches`` call) while a store
is being migrated; a pass runs steps until its sweep ends."""

_RUNNING: Final = "running"
_HOLDER_PREFIX: Final = keys.workflow_owner_holder("")
_RUNNING_PREFIX: Final = keys.workflow_status_index(_RUNNING, "")
_WORKFLOW_PREFIX: Final = keys.workflow("")
_TAKE_AT_ONCE: Final = frozenset({EngineVerdict.CRASHED, EngineVerdict.CLOSED})


class EngineIndexDiscovery:
    """Discovery from the engine records, the by-engine index and bounded windows.

    :param storage: the store.
    :param engine_id: this engine (never judged, never read).
    :param clock: the registry's clock (ms): heartbeats and holders are judged on it.
    :param judge: tells a live holder (its engine id) from a takeover-ready one (``None``).
    :param skip_live: passed to the full scans while the store is being migrated.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        engine_id: str,
        clock: Callable[[], int],
        judge: HolderJudge,
        skip_live: bool = True,
        window: int = DISCOVERY_WINDOW,
    ) -> None:
        self._storage = storage
        self._engine_id = engine_id
        self._clock = clock
        self._judge = judge
        self._skip_live = skip_live
        self._holders = RotatingWindow(_HOLDER_PREFIX, window)
        self._running = RotatingWindow(_RUNNING_PREFIX, window)
        self._records = RotatingWindow(_WORKFLOW_PREFIX, window)
        # _lock guards _indexed, _backfill_cursor and _dead_first_seen (dead engines' claims ->
        # when this engine first listed them, its clock).
        self._lock = threading.Lock()
        self._indexed = False
        self._backfill_cursor: str | None = None
        self._dead_first_seen: dict[str, int] = {}

    # -- the pass -------------------------------------------------------------------------------

    def discover(self, exclude: Collection[str]) -> EngineDiscovery:
        """Run one discovery.

        :raises StorageError: a read failed; nothing remembered moves but the windows read.
        """
        excluded = set(exclude)
        indexed = self._store_indexed()
        engine_rows: list[tuple[str, bytes]] | None = None
        holder_rows = running_rows = record_rows = []
        if indexed:
            # The engine records come in the windows' statement: one round trip less.
            holder_rows, running_rows, record_rows, engine_rows = read_windows(
                self._storage,
                (self._holders, self._running, self._records),
                also=[ScanRange(ENGINE_RECORD_PREFIX)],
            )
        statuses = survey_for_discovery(
            self._storage, now=self._clock(), engine_id=self._engine_id, rows=engine_rows
        )
        result = EngineDiscovery() if indexed else self._migrating(excluded)
        found: dict[str, None] = dict.fromkeys(result.candidates)
        stranded: dict[str, None] = dict.fromkeys(result.stranded)
        dead: dict[str, bytes] = {}
        dead_ids: list[str] = []
        for status in statuses:
            verdict = status.verdict
            if verdict is EngineVerdict.LIVE:
                if status.record is not None:
                    result.live_claims.setdefault(status.engine_id, status.record.held)
                continue
            if verdict not in _TAKE_AT_ONCE and not indexed:
                continue  # the full scan read and judged its holders already
            ids, more = self._engine_claims(status)
            if not ids and not more:
                self._forget(status)
                continue
            ids = [wid for wid in ids if wid not in excluded]
            if verdict in _TAKE_AT_ONCE:
                # Only claims that may be taken at once are worth another urgent round.
                result.dead_left = result.dead_left or more
                dead[status.engine_id] = status.raw
                dead_ids.extend(ids)
                for wid in ids:
                    found.setdefault(wid)
                    stranded.setdefault(wid)
            else:
                self._judged(ids, found, stranded, result.live_claims)
        if indexed:
            held = self._holder_window(holder_rows, excluded, found, stranded)
            self._ownerless_windows(running_rows, record_rows, excluded, found, stranded, held)
        for engine in dead:
            # The full scan of a store being migrated reads a dead engine's holders as live.
            result.live_claims.pop(engine, None)
        now = self._clock()
        with self._lock:
            first_seen = {wid: self._dead_first_seen.get(wid, now) for wid in dead_ids}
            self._dead_first_seen = first_seen
        urgent = {wid for wid, first in first_seen.items() if now - first >= DEAD_SHARE_WINDOW_MS}
        result.candidates = list(found)
        result.stranded = list(stranded)
        result.dead_engines = frozenset(dead)
        result.dead_records = dead
        result.urgent = urgent
        result.dead_claims = dead_ids
        result.participants = crash_participants(statuses)
        if dead_ids:
            _log.info(
                "weft_sync: %d claims of %d dead engines found (%s)",
                len(dead_ids),
                len(dead),
                ", ".join(sorted(dead)),
            )
        return result

    # -- steps ----------------------------------------------------------------------------------

    def _store_indexed(self) -> bool:
        with self._lock:
            if self._indexed:
                return True
        indexed = index_marker_present(self._storage)
        if indexed:
            with self._lock:
                self._indexed = True
        return indexed

    def _migrating(self, excluded: set[str]) -> EngineDiscovery:
        """The full scans, plus one backfill step, for a store not indexed yet."""
        found = discover_reclaim_candidates(
            self._storage, excluded, judge=self._judge, skip_live=self._skip_live
        )
        with self._lock:
            cursor = self._backfill_cursor
        # One whole sweep a pass, in steps of BACKFILL_BUDGET keys (each step its own reads and
        # conditional writes): the pass reads every holder anyway, and the migration ends in
        # two passes, a sweep that fixes entries and a clean one that writes the marker.
        step = None
        try:
            while step is None or not (step.done or step.sweep_ended):
                step = backfill_step(self._storage, cursor=cursor, budget=BACKFILL_BUDGET)
                cursor = step.cursor
                with self._lock:
                    self._backfill_cursor = cursor
                    self._indexed = self._indexed or step.done
        except Exception as exc:
            _log.warning("weft_sync: indexing the store's claims failed this pass: %s", exc)
        if step is not None and step.done:
            _log.info("weft_sync: every claim of the store is indexed by engine")
        return EngineDiscovery(found.candidates, found.stranded, found.live_claims)

    def _engine_claims(self, status: EngineStatus) -> tuple[list[str], bool]:
        """The workflow ids a non-live engine's entries name, and whether more are left."""
        rows = read_engine_entries(
            self._storage, status.engine_id, limit=DEAD_ENGINE_READ_LIMIT + 1
        )
        more = len(rows) > DEAD_ENGINE_READ_LIMIT
        return [wid for wid, _ in rows[:DEAD_ENGINE_READ_LIMIT]], more

    def _forget(self, status: EngineStatus) -> None:
        """Remove the record of a dead engine that has no claim left (any engine may)."""
        if status.verdict is EngineVerdict.UNKNOWN or (
            status.verdict is EngineVerdict.STALE and status.record is not None
        ):
            # A frozen engine may wake up, an unknown one is probably alive; its record costs
            # one row. Only a crash or a close is final.
            return
        try:
            if forget_engine(self._storage, status):
                _log.info(
                    "weft_sync: forgot engine %s (%s, no claims left)",
                    status.engine_id,
                    status.verdict.value,
                )
        except Exception as exc:
            _log.debug("forgetting engine %s failed: %r", status.engine_id, exc)

    def _judged(
        self,
        ids: list[str],
        found: dict[str, None],
        stranded: dict[str, None],
        live_claims: dict[str, int],
    ) -> None:
        """Add the ids whose holder the expiry rule lets a takeover take; count the live ones.

        A stale engine's live holders count in the fair share as the full scan counted them:
        an engine that renews without running passes still holds its share.
        """
        if not ids:
            return
        holders = storage_get_many(self._storage, [keys.workflow_owner_holder(w) for w in ids])
        for wid, raw in zip(ids, holders, strict=True):
            if raw is None:
                continue  # released meanwhile; a running one is found by the ownerless window
            engine = self._judge(raw)
            if engine is None:
                found.setdefault(wid)
                stranded.setdefault(wid)
            else:
                live_claims[engine] = live_claims.get(engine, 0) + 1

    def _holder_window(
        self,
        rows: list[tuple[str, bytes]],
        excluded: set[str],
        found: dict[str, None],
        stranded: dict[str, None],
    ) -> set[str]:
        """Judge the holder window's ``rows``; return the workflows whose holder it read."""
        seen: set[str] = set()
        # The window is one snapshot: its holders are judged at one time, read after it.
        judge = self._judge.at_once() if isinstance(self._judge, ExpiryJudge) else self._judge
        for key, raw in rows:
            wid = keys.decode_canonical_component(key[len(_HOLDER_PREFIX) :])
            if not wid:
                continue
            seen.add(wid)
            if wid in excluded or wid in found:
                continue
            if judge(raw) is None:
                found[wid] = None
                stranded[wid] = None
        return seen

    def _ownerless_windows(
        self,
        running_rows: list[tuple[str, bytes]],
        record_rows: list[tuple[str, bytes]],
        excluded: set[str],
        found: dict[str, None],
        stranded: dict[str, None],
        held: set[str],
    ) -> None:
        """Running workflows without a holder, from the running index and the records.

        ``held`` are the workflows whose holder this pass read already: they are not asked
        about again. A workflow left without a holder for a whole window cycle cannot be among
        them, so the windows' bound is the same as if every holder were read afresh.
        """
        known = excluded | found.keys() | held
        # workflow id -> its canonical key component, which the holder key shares.
        asked: dict[str, str] = {}
        for key, _ in running_rows:
            component = key[len(_RUNNING_PREFIX) :]
            wid = keys.decode_canonical_component(component)
            if wid and wid not in known:
                asked.setdefault(wid, component)
        for key, value in record_rows:
            component = key[len(_WORKFLOW_PREFIX) :]
            wid = keys.decode_canonical_component(component)
            if not wid or wid in known or wid in asked:
                continue  # an id the running index listed is asked about once, record or not
            record = try_decode_workflow_record(value)
            if record is not None and record.status == _RUNNING:
                asked[wid] = component
        if not asked:
            return
        holders = storage_get_many(
            self._storage, [_HOLDER_PREFIX + component for component in asked.values()]
        )
        for wid, raw in zip(asked, holders, strict=True):
            if raw is None:
                found[wid] = None
                stranded[wid] = None
