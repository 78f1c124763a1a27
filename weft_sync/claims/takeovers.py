"""Claim takeover: one workflow per compare-and-swap, or many per read and per transaction.

A takeover replaces a holder that expired (past its grace), cannot be decoded, or names an engine
the caller knows is dead (``dead_engines``), minting epoch + 1, conditioned on the exact holder
and epoch bytes it read: a wrong verdict of death moves work needlessly, but the holder's engine
(its renewal conditions on the replaced bytes) can never write again. The same batch moves the
claim's by-engine entry (see :mod:`~weft_sync.claims.engine_index`).

A verdict of death may come with the exact bytes of the engine record it was judged on. Such a
holder is taken early only if that record, read after the holder, still has those bytes: an
engine writes its record before its first claim, so a holder written by a later engine under
the same id (a restart that reuses a pod or host name) is never one of them. The proof is the
order of two writes in the store; no clock is compared.

:meth:`Takeovers.takeover_many` gives each id the outcome :meth:`Takeovers.takeover` would give
it, but reads the holders and epochs of a chunk with one ``get_many`` (one snapshot) and commits
the chunk's takeovers with one ``conditional_batches``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from .. import keys
from ..clock import Clock
from ..codec import HolderRecord, decode_holder
from ..errors import CorruptEpochError, StorageCapabilityError
from ..storage.base import Put, Storage, storage_conditional_batch
from ..storage.isolation import Judged, storage_conditional_batches_isolated
from ..storage.reads import storage_get_many
from .engine_index import with_claim_entry
from .results import TakeoverResult, TakeoverStatus
from .tracking import ClaimTable
from .transitions import (
    Fragment,
    build_renew_transition,
    build_takeover_transition,
    extract_put_value,
    is_claim_expired,
)

# Logs under the registry's logger: one logger names every claim operation of the registry.
_log = logging.getLogger("weft_sync.claims.registry")

DEFAULT_TAKEOVER_CHUNK_SIZE: Final = 200
"""Takeovers per read and per transaction of :meth:`Takeovers.takeover_many`."""

Installer = Callable[[str, Fragment, int], int]
"""``(workflow id, committed fragment, claimed_at) -> epoch``: track a claim just written."""

GiveBack = Callable[[str, bytes, bytes], None]
"""``(workflow id, epoch bytes, holder bytes) -> None``: delete a holder just written (best
effort, conditioned on those bytes)."""

TakeoverOutcome = TakeoverResult | Exception

DeadEngines = Mapping[str, bytes | None]
"""Engine id -> the exact engine-record bytes its death was judged on (``None``: the caller's
word, taken as given)."""


class Takeovers:
    """The registry's takeover part; ids reaching it are already validated.

    :param table: the registry's tracking state (only its cooldown is read here).
    :param storage: the shared store.
    :param clock: the registry's clock.
    :param install: tracks a committed takeover and returns its epoch.
    :param give_back: deletes the holder of a committed takeover that cannot be tracked.
    :param engine_id: written into the new holder records.
    :param claim_ttl_ms: the new holder's ``expires_at`` is the takeover's clock reading plus this.
    :param renew_interval_ms: the takeover grace unit.
    :param judge_clock: the clock a holder's expiry is judged on (default: ``clock``); with the
        store's clock, its lower bound while ``clock`` is its upper bound.
    """

    def __init__(
        self,
        table: ClaimTable,
        storage: Storage,
        clock: Clock,
        install: Installer,
        give_back: GiveBack,
        *,
        engine_id: str,
        claim_ttl_ms: int,
        renew_interval_ms: int,
        judge_clock: Clock | None = None,
    ) -> None:
        self._table = table
        self._judge_clock = judge_clock
        self._storage = storage
        self._clock = clock
        self._install = install
        self._give_back = give_back
        self._engine_id = engine_id
        self._claim_ttl_ms = claim_ttl_ms
        self._renew_interval_ms = renew_interval_ms

    def takeover(self, wid: str, dead: DeadEngines | None = None) -> TakeoverResult:
        """See :meth:`ClaimRegistry.takeover <weft_sync.claims.registry.ClaimRegistry.takeover>`."""
        now = self._clock()
        if self._table.cooldown.is_active(wid, now):
            _log.debug("takeover of workflow %r skipped: cooldown active", wid)
            return TakeoverResult(TakeoverStatus.BACKOFF_SKIPPED, wid)
        observed_holder, observed_epoch = storage_get_many(
            self._storage, [keys.workflow_owner_holder(wid), keys.workflow_owner_epoch(wid)]
        )
        confirmed = self._confirmed_dead(dead, [observed_holder])
        judged = self._judge(
            wid, now, self._judge_now(now), observed_holder, observed_epoch, confirmed
        )
        if isinstance(judged, TakeoverResult):
            return judged
        fragment, previous, early = judged
        if not storage_conditional_batch(self._storage, fragment.conditions, fragment.operations):
            return self._lost(wid, self._storage.get(keys.workflow_owner_holder(wid)))
        (fresh,), stamp = self._refresh_if_stale([(wid, fragment)], now)
        if fresh is None:
            return self._lost(wid, self._storage.get(keys.workflow_owner_holder(wid)))
        return self._acquired(wid, fresh, stamp, previous, early)

    def takeover_many(
        self, ids: Sequence[str], chunk_size: int, dead: DeadEngines | None = None
    ) -> list[TakeoverOutcome]:
        """See :meth:`ClaimRegistry.takeover_many
        <weft_sync.claims.registry.ClaimRegistry.takeover_many>`.
        """
        outcomes: dict[str, TakeoverOutcome] = {}
        now = self._clock()
        pending: list[str] = []
        for wid in dict.fromkeys(ids):
            if self._table.cooldown.is_active(wid, now):
                outcomes[wid] = TakeoverResult(TakeoverStatus.BACKOFF_SKIPPED, wid)
            else:
                pending.append(wid)
        judge_now = self._judge_now(now) if pending else now
        for start in range(0, len(pending), chunk_size):
            chunk = pending[start : start + chunk_size]
            try:
                self._takeover_chunk(chunk, now, judge_now, outcomes, dead)
            except Exception as exc:
                for wid in chunk:
                    outcomes.setdefault(wid, exc)
        if pending and _log.isEnabledFor(logging.DEBUG):
            acquired = sum(
                1
                for o in outcomes.values()
                if isinstance(o, TakeoverResult) and o.status is TakeoverStatus.ACQUIRED
            )
            _log.debug("batched takeover of %d workflows: %d acquired", len(pending), acquired)
        return [outcomes[wid] for wid in ids]

    def _judge_now(self, now: int) -> int:
        # One clock reading serves both uses unless expiry is judged on a clock of its own.
        return now if self._judge_clock is None else self._judge_clock()

    def _confirmed_dead(
        self, dead: DeadEngines | None, holders: Sequence[bytes | None]
    ) -> frozenset[str]:
        """The engines of ``dead`` whose ``holders`` (just read) may be taken before expiry.

        An engine given without record bytes is taken at the caller's word. One given with
        them only while its engine record still has those bytes, read here, after the holders:
        the engine that wrote a holder read before had written its record before it, so a
        record unchanged since the verdict proves the holder older than any engine that reused
        the id. This engine's own id is never confirmed.
        """
        if not dead:
            return frozenset()
        named = {
            holder.engine_id
            for raw in holders
            if raw is not None and (holder := decode_holder(raw)) is not None
        }
        named.discard(self._engine_id)
        confirmed = {engine for engine in named if engine in dead and dead[engine] is None}
        to_check = sorted(engine for engine in named if dead.get(engine) is not None)
        if not to_check:
            return frozenset(confirmed)
        # A separate read, after the holders' (never in their statement): its order is the proof.
        records = storage_get_many(self._storage, [keys.engine_liveness(e) for e in to_check])
        for engine, record in zip(to_check, records, strict=True):
            if record is not None and bytes(record) == dead[engine]:
                confirmed.add(engine)
            else:
                _log.debug(
                    "engine %s was judged dead on a record it no longer has (restarted under "
                    "the same id?): its claims go by their expiry",
                    engine,
                )
        return frozenset(confirmed)

    # -- steps -----------------------------------------------------------------------------

    def _takeover_chunk(
        self,
        chunk: list[str],
        now: int,
        judge_now: int,
        outcomes: dict[str, TakeoverOutcome],
        dead: DeadEngines | None,
    ) -> None:
        """Read, judge and commit the takeovers of ``chunk``, storing each outcome.

        Raises only before anything was committed, while reading the holders of lost races
        (the committed takeovers are installed and stored first), or a ``BaseException`` from
        the clock once the committed takeovers were given back.
        """
        holder_keys = [keys.workflow_owner_holder(wid) for wid in chunk]
        values = storage_get_many(
            self._storage, holder_keys + [keys.workflow_owner_epoch(wid) for wid in chunk]
        )
        confirmed = self._confirmed_dead(dead, values[: len(chunk)])
        planned: list[tuple[str, Fragment, HolderRecord | None, bool]] = []
        for i, wid in enumerate(chunk):
            holder, epoch = values[i], values[len(chunk) + i]
            try:
                judged = self._judge(
                    wid, now, judge_now, holder, epoch if holder is not None else None, confirmed
                )
            except CorruptEpochError as exc:
                outcomes[wid] = exc
                continue
            if isinstance(judged, TakeoverResult):
                outcomes[wid] = judged
            else:
                planned.append((wid, *judged))
        if not planned:
            return
        committed = self._commit([fragment for _, fragment, _, _ in planned])
        won = [
            (wid, fragment)
            for (wid, fragment, _, _), ok in zip(planned, committed, strict=True)
            if ok is True
        ]
        refreshed, stamp = self._refresh_if_stale(won, now)
        fresh = dict(zip([wid for wid, _ in won], refreshed, strict=True))
        lost: list[str] = []
        for (wid, _fragment, previous, early), ok in zip(planned, committed, strict=True):
            if isinstance(ok, Exception):
                # Its row was locked by another session: not judged, so not a lost race.
                outcomes[wid] = ok
            elif ok and (written := fresh[wid]) is not None:
                try:
                    outcomes[wid] = self._acquired(wid, written, stamp, previous, early)
                except Exception as exc:
                    # Its own outcome (a close gave it back): the claims after it are still
                    # installed, or given back, each by its own install.
                    outcomes[wid] = exc
            else:
                lost.append(wid)
        if lost:
            observed = storage_get_many(
                self._storage, [keys.workflow_owner_holder(wid) for wid in lost]
            )
            for wid, holder in zip(lost, observed, strict=True):
                outcomes[wid] = self._lost(wid, holder)

    def _judge(
        self,
        wid: str,
        now: int,
        judge_now: int,
        holder_bytes: bytes | None,
        epoch_bytes: bytes | None,
        dead: frozenset[str],
    ) -> TakeoverResult | tuple[Fragment, HolderRecord | None, bool]:
        """Decide a takeover from what was read: a final result, or the fragment to commit, the
        previous holder (``None`` if it did not decode) and whether it is taken before its expiry
        (its engine is in ``dead``, confirmed by :meth:`_confirmed_dead`). Expiry is judged at
        ``judge_now``; the new holder is written at ``now``."""
        if holder_bytes is None or epoch_bytes is None:
            # A holder without an epoch breaks the invariant: there is nothing safe to fence on.
            _log.debug(
                "takeover of workflow %r: no claim (holder %s, epoch absent)",
                wid,
                "absent" if holder_bytes is None else "present",
            )
            return TakeoverResult(TakeoverStatus.NO_CLAIM, wid)
        holder = decode_holder(holder_bytes)
        live = holder is not None and not is_claim_expired(
            expires_at=holder.expires_at, now=judge_now, renew_interval_ms=self._renew_interval_ms
        )
        # This engine is alive by definition: naming itself dead never takes its own claims.
        early = (
            live
            and holder is not None
            and holder.engine_id in dead
            and holder.engine_id != self._engine_id
        )
        if holder is not None and live and not early:
            _log.debug(
                "takeover of workflow %r: held by %r until %d",
                wid,
                holder.engine_id,
                holder.expires_at,
            )
            return TakeoverResult(
                TakeoverStatus.NOT_EXPIRED,
                wid,
                held_by=holder.engine_id,
                expires_at=holder.expires_at,
            )
        try:
            fragment = build_takeover_transition(
                workflow_id=wid,
                engine_id=self._engine_id,
                now=now,
                claim_ttl_ms=self._claim_ttl_ms,
                observed_holder_bytes=holder_bytes,
                observed_epoch_bytes=epoch_bytes,
            )
        except CorruptEpochError as exc:
            _log.warning("%s", exc)
            raise
        return with_claim_entry(fragment, wid, self._engine_id, holder_bytes), holder, early

    def _refresh_if_stale(
        self, won: list[tuple[str, Fragment]], now: int
    ) -> tuple[list[Fragment | None], int]:
        """The fragments to track for takeovers just committed, renewed first when stale.

        The holders were written with expiry ``now + ttl``, ``now`` read before the commit.
        A commit that waited longer than one renew interval for the write lock (a stalled
        store) may have written holders that are about to expire, or already have: the clock
        is read again after the commit and those holders renewed at once from it, in one
        transaction. A holder replaced meanwhile (taken straight back) is ``None``: lost.
        Also returns the time the tracked claims were last written at (their local renew
        deadline counts from it): ``now``, or the fresh reading once all were renewed. A clock
        that raises an ``Exception`` keeps them as written; one that raises anything else
        (``SystemExit``, ...) has them given back, and that goes on.
        """
        if not won:
            return [], now
        try:
            after = self._clock()
        except Exception:
            # Committed already: tracked as written, so the renewal pass renews them (or fails
            # visibly) rather than leaving holders nobody renews or drives.
            _log.warning(
                "could not read the clock after a takeover commit of %d claims; kept as written",
                len(won),
                exc_info=True,
            )
            return [fragment for _, fragment in won], now
        except BaseException:
            # Host code behind the clock (SystemExit, ...): no result reaches a driver, so the
            # holders just written are given back before the exception goes on.
            self._give_back_all(won)
            raise
        if after - now <= self._renew_interval_ms:
            return [fragment for _, fragment in won], now
        renewals = [
            build_renew_transition(
                workflow_id=wid,
                now=after,
                claim_ttl_ms=self._claim_ttl_ms,
                current_holder_bytes=extract_put_value(
                    fragment.operations, keys.workflow_owner_holder(wid)
                ),
            )
            for wid, fragment in won
        ]
        _log.info(
            "a takeover commit of %d claims waited %d ms for the store; renewing them now",
            len(won),
            after - now,
        )
        try:
            renewed = self._commit(renewals)
        except Exception:
            _log.warning("could not renew stale takeovers; kept as written", exc_info=True)
            return [fragment for _, fragment in won], now
        fresh: list[Fragment | None] = []
        for (wid, fragment), renewal, ok in zip(won, renewals, renewed, strict=True):
            if ok is True:
                holder_key = keys.workflow_owner_holder(wid)
                operations = tuple(
                    renewal.operations[0] if isinstance(op, Put) and op.key == holder_key else op
                    for op in fragment.operations
                )
                fresh.append(Fragment(fragment.conditions, operations))
            elif isinstance(ok, Exception):
                fresh.append(fragment)  # not judged: the renewal pass settles it
            else:
                fresh.append(None)
        return fresh, after if all(ok is True or ok is False for ok in renewed) else now

    def _give_back_all(self, won: list[tuple[str, Fragment]]) -> None:
        for wid, fragment in won:
            self._give_back(
                wid,
                extract_put_value(fragment.operations, keys.workflow_owner_epoch(wid)),
                extract_put_value(fragment.operations, keys.workflow_owner_holder(wid)),
            )

    def _commit(self, fragments: list[Fragment]) -> list[Judged]:
        """Commit the fragments in one transaction; one on a row locked elsewhere fails alone."""
        if not self._storage.capabilities.conditional_batch:
            raise StorageCapabilityError("batched claim takeover", "conditional_batch")
        return storage_conditional_batches_isolated(
            self._storage, [(fragment.conditions, fragment.operations) for fragment in fragments]
        )

    def _acquired(
        self, wid: str, fragment: Fragment, now: int, previous: HolderRecord | None, early: bool
    ) -> TakeoverResult:
        epoch = self._install(wid, fragment, now)
        _log.info(
            "engine %s took over workflow %r at epoch %d from %r%s",
            self._engine_id,
            wid,
            epoch,
            None if previous is None else previous.engine_id,
            " (an engine known dead, before its claim expired)" if early else "",
        )
        return TakeoverResult(
            TakeoverStatus.ACQUIRED,
            wid,
            epoch=epoch,
            expires_at=None if previous is None else previous.expires_at,
            before_expiry=early,
            token=extract_put_value(fragment.operations, keys.workflow_owner_epoch(wid)),
        )

    def _lost(self, wid: str, holder_bytes: bytes | None) -> TakeoverResult:
        holder = decode_holder(holder_bytes)
        held_by = None if holder is None else holder.engine_id
        _log.debug("takeover of workflow %r lost the race (held by %r)", wid, held_by)
        return TakeoverResult(TakeoverStatus.LOST_RACE, wid, held_by=held_by)
