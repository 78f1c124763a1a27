"""Claim renewal: one claim per compare-and-swap, or many claims per transaction.

A renewal rewrites the holder record with a fresh ``expires_at``, conditioned on the exact holder
bytes this engine last wrote. Concurrent renewals of one workflow share one
:class:`~weft_sync.claims.tracking.RenewalGroup`; callers that join it get the identical result
object (or exception).

A renewal whose commit raised may have committed all the same. Its value is remembered on the
entry (``TrackedClaim.pending``); when a later renewal then finds the holder changed, the holder
is read again, and if it is one of those values it is adopted and the renewal retried once from
it. Only a holder this engine never wrote is a lost claim.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Final, cast

import msgpack

from ..clock import Clock
from ..codec import SAFE_INT_MAX
from ..errors import StoreIdentityError, WorkflowClaimLostWarning
from ..keys import workflow_owner_epoch as epoch_key
from ..storage.base import Condition, Put, Storage, storage_conditional_batch
from ..storage.cas import CasRow
from ..storage.isolation import Judged, storage_compare_and_set_many_isolated
from ..storage.reads import storage_get_many
from .losses import DEADLINE, DEPOSED, STORE_ROLLBACK, LocalLosses
from .results import RenewResult, RenewStatus
from .rollback import describe_store, rollback_evidence
from .tracking import ClaimTable, RenewalGroup, TrackedClaim
from .transitions import build_renew_transition, extract_put_value

# Logs under the registry's logger: one logger names every claim operation of the registry.
_log = logging.getLogger("weft_sync.claims.registry")

WarnSink = Callable[[Warning], None]
_RENEWED: Final = RenewStatus.RENEWED
_LOST: Final = RenewStatus.LOST
DEFAULT_RENEW_CHUNK_SIZE: Final = 2000

# A renewal in flight: the workflow id, the entry it started from and the holder bytes it expects.
Member = tuple[str, TrackedClaim, bytes]
# Commits independent compare-and-set rows; returns whether each committed, or that its row was
# locked by another session (not judged: a failed renewal, retried on the next pass).
Committer = Callable[[Sequence[CasRow]], Sequence[Judged]]
Outcomes = dict[str, "RenewResult | Exception"]
# A lost renewal: the workflow id and the entry it renewed (dropped from the table), and the
# holder bytes that entry had last written.
Lost = tuple[str, TrackedClaim]
# Called with the error once a renewal finds the store replaced; loses every claim locally.
StoreLostHandler = Callable[[StoreIdentityError], None]


class Chunk:
    """Renewals committed in one transaction, held column by column.

    ``wids[i]`` is renewed from the entry ``entries[i]``, expecting the holder bytes
    ``expected[i]`` (read under the table lock when the renewal started). Columns rather than a
    tuple per renewal: such a tuple holds the entry, so the garbage collector keeps tracking it,
    and with 100k claims the full collections a pass of them triggers cost a tenth of the pass.
    """

    __slots__ = ("entries", "expected", "wids")

    def __init__(self, wids: list[str], entries: list[TrackedClaim], expected: list[bytes]) -> None:
        self.wids = wids
        self.entries = entries
        self.expected = expected

    @classmethod
    def of(cls, members: Sequence[Member]) -> Chunk:
        return cls([m[0] for m in members], [m[1] for m in members], [m[2] for m in members])

    def members(self) -> list[Member]:
        """One ``(wid, entry, expected)`` tuple per renewal (for the uncommon paths)."""
        return list(zip(self.wids, self.entries, self.expected, strict=True))


def default_warn(warning: Warning) -> None:
    """Emit ``warning`` with :func:`warnings.warn`, pointing at the caller of ``renew()``."""
    # Frames: this sink, _report_lost, Renewals.renew, ClaimRegistry.renew, the caller.
    warnings.warn(warning, stacklevel=5)


class Renewals:
    """The registry's renewal part; ids reaching it are already validated.

    :param table: the registry's tracking state (its lock guards what renewals touch).
    :param storage: the shared store.
    :param clock: the registry's clock.
    :param claim_ttl_ms: the new ``expires_at`` is the renewal's clock reading plus this.
    :param warn: receives one :class:`~weft_sync.errors.WorkflowClaimLostWarning` per lost claim.
    :param engine_id: this engine's id, for log messages.
    :param losses: drops claims past the local renew deadline after a failed renewal.
    :param on_store_lost: called when a renewal raised
        :class:`~weft_sync.errors.StoreIdentityError`.
    """

    def __init__(
        self,
        table: ClaimTable,
        storage: Storage,
        clock: Clock,
        claim_ttl_ms: int,
        warn: WarnSink,
        engine_id: str,
        losses: LocalLosses,
        on_store_lost: StoreLostHandler,
    ) -> None:
        self._table = table
        self._losses = losses
        self._on_store_lost = on_store_lost
        self._storage = storage
        self._clock = clock
        self._claim_ttl_ms = claim_ttl_ms
        self._warn = warn
        self._engine_id = engine_id

    # -- entry points ----------------------------------------------------------------------

    def renew(self, wid: str) -> RenewResult:
        """See :meth:`ClaimRegistry.renew <weft_sync.claims.registry.ClaimRegistry.renew>`."""
        group = RenewalGroup()
        member: Member | None = None
        table = self._table
        with table.lock:
            joined = table.in_flight.get(wid)
            if joined is None:
                member = self._start(wid, group)
        if joined is not None:
            _log.debug("renewal of workflow %r joins the renewal already in flight", wid)
            return joined.result(wid)
        if member is None:
            _log.debug("renewal of workflow %r: not held", wid)
            return RenewResult(RenewStatus.NOT_HELD, wid)
        outcomes: Outcomes = {}
        lost: list[Lost] = []
        self._run_group(group, Chunk.of([member]), self._commit_one, outcomes, lost)
        outcome = outcomes[wid]
        if isinstance(outcome, Exception):
            _log.debug("renewal of workflow %r failed: %r", wid, outcome)
            self._after_failures([member], outcomes)
            outcome = outcomes[wid]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        if lost:
            outcome = self._report_all_lost(lost).get(wid, outcome)
            if isinstance(outcome, Exception):
                raise outcome
        else:
            _log.debug("renewed the claim on workflow %r", wid)
        return outcome

    def renew_many_outcomes(
        self, ids: Sequence[str], chunk_size: int
    ) -> list[RenewResult | Exception]:
        """See :meth:`ClaimRegistry.renew_many_outcomes
        <weft_sync.claims.registry.ClaimRegistry.renew_many_outcomes>`.
        """
        outcomes: Outcomes = {}
        joined: dict[str, RenewalGroup] = {}
        groups: list[tuple[RenewalGroup, Chunk]] = []
        table = self._table
        unique = list(dict.fromkeys(ids))
        with table.lock:
            # _start(), inlined: this runs once per held claim on every renewal pass.
            claims, in_flight = table.claims, table.in_flight
            if in_flight or table.releasing:
                wids, entries = self._start_each(unique, joined, outcomes)
            else:
                # Nothing in flight or releasing: each id is either started or not held.
                found = [*map(claims.get, unique)]
                if None in found:
                    wids, entries = self._held_only(unique, found, outcomes)
                else:
                    wids, entries = unique, cast("list[TrackedClaim]", found)
            expected = [entry.holder_bytes for entry in entries]
            for start in range(0, len(wids), chunk_size):
                end = start + chunk_size
                chunk = Chunk(wids[start:end], entries[start:end], expected[start:end])
                group = RenewalGroup()
                in_flight.update(dict.fromkeys(chunk.wids, group))
                groups.append((group, chunk))
        lost: list[Lost] = []
        failed = 0
        try:
            for group, chunk in groups:
                failed += self._renew_chunk(group, chunk, outcomes, lost)
        except BaseException as exc:
            for group, chunk in groups:
                if not group.done.is_set():
                    self._fail_group(group, chunk.members(), [], exc)
            raise
        if failed:
            self._after_failures([m for _, chunk in groups for m in chunk.members()], outcomes)
        for wid, running in joined.items():
            outcomes[wid] = running.outcome(wid)
        # A warn sink that raises fails only the id it was reporting, as renew() would.
        outcomes.update(self._report_all_lost(lost))
        return list(map(outcomes.__getitem__, ids))

    def _start_each(
        self, ids: Sequence[str], joined: dict[str, RenewalGroup], outcomes: Outcomes
    ) -> tuple[list[str], list[TrackedClaim]]:
        """Sort ``ids`` into joined, started and not-held renewals. Called with the lock held.

        :returns: the ids to start and their entries.
        """
        table = self._table
        claims, in_flight, releasing = table.claims, table.in_flight, table.releasing
        wids: list[str] = []
        entries: list[TrackedClaim] = []
        for wid in ids:
            running = in_flight.get(wid)
            if running is not None:
                joined[wid] = running
                continue
            entry = claims.get(wid)
            if entry is None or wid in releasing:
                outcomes[wid] = RenewResult(RenewStatus.NOT_HELD, wid)
                continue
            wids.append(wid)
            entries.append(entry)
        return wids, entries

    @staticmethod
    def _held_only(
        ids: Sequence[str], found: Sequence[TrackedClaim | None], outcomes: Outcomes
    ) -> tuple[list[str], list[TrackedClaim]]:
        """Keep the ids that have an entry; give the others a ``not-held`` result."""
        wids: list[str] = []
        entries: list[TrackedClaim] = []
        for wid, entry in zip(ids, found, strict=True):
            if entry is None:
                outcomes[wid] = RenewResult(RenewStatus.NOT_HELD, wid)
            else:
                wids.append(wid)
                entries.append(entry)
        return wids, entries

    # -- failed renewals: the local renew deadline and a replaced store --------------------

    def _after_failures(self, members: Sequence[Member], outcomes: Outcomes) -> None:
        """Give up the failed renewals' claims that are past the deadline (or whose store went).

        A claim past its deadline gets a ``lost`` result with cause ``deadline`` in
        ``outcomes`` (or what the warn sink raised reporting it); one that is not keeps its
        error, and is renewed again by the next pass.
        """
        failed = [(wid, entry) for wid, entry, _ in members if isinstance(outcomes[wid], Exception)]
        if not failed:
            return
        for wid, _ in failed:
            error = outcomes[wid]
            if isinstance(error, StoreIdentityError):
                self._on_store_lost(error)
                return
        dropped = self._losses.drop_overdue(failed, self._clock())
        for wid in dropped:
            outcomes[wid] = RenewResult(_LOST, wid, DEADLINE)
        outcomes.update(self._losses.report(dropped, DEADLINE))

    # -- one group: commit, resolve ambiguous renewals, settle -----------------------------

    def _start(self, wid: str, group: RenewalGroup) -> Member | None:
        """Register a renewal of ``wid`` in ``group``; ``None`` if it is not renewable. Locked."""
        table = self._table
        if wid in table.releasing:
            return None
        entry = table.claims.get(wid)
        if entry is None:
            return None
        table.in_flight[wid] = group
        return (wid, entry, entry.holder_bytes)

    def _renew_chunk(
        self, group: RenewalGroup, chunk: Chunk, outcomes: Outcomes, lost: list[Lost]
    ) -> int:
        """Renew one chunk in one transaction; return how many of its renewals failed."""
        lost_before = len(lost)
        failed = self._run_group(group, chunk, self._commit_many, outcomes, lost)
        lost_here = len(lost) - lost_before
        _log.debug(
            "batched renewal of %d claims: %d renewed, %d lost, %d failed",
            len(chunk.wids),
            len(chunk.wids) - lost_here - failed,
            lost_here,
            failed,
        )
        return failed

    def _run_group(
        self,
        group: RenewalGroup,
        chunk: Chunk,
        commit: Committer,
        outcomes: Outcomes,
        lost: list[Lost],
    ) -> int:
        """Renew ``chunk`` in one commit, settle it and wake the group's waiters.

        Stores each id's result, or the ``Exception`` that failed it, in ``outcomes``; appends
        the ids of lost claims to ``lost``.

        :returns: how many of the renewals failed with an exception.
        :raises BaseException: anything that is not an ``Exception`` (the group fails with it).
        """
        writes: list[CasRow] = []
        members: list[Member] = []
        committed: list[bool] = []
        errors: dict[str, Exception] = {}
        try:
            now = self._clock()
            writes = self._writes(chunk, now)
            judged = commit(writes)
            # Usually every renewal committed: nothing to re-examine, nothing failed.
            renewed_all = judged.count(True) == len(judged)
            if not renewed_all:
                members = chunk.members()
                committed = [ok is True for ok in judged]
                errors = {
                    members[i][0]: ok for i, ok in enumerate(judged) if isinstance(ok, Exception)
                }
                self._retry_ambiguous(members, writes, committed, now, commit, errors)
            if errors:
                # A failed row may still have committed: its value stays adoptable.
                self._remember_pending(
                    [m for m in members if m[0] in errors],
                    [w for m, w in zip(members, writes, strict=True) if m[0] in errors],
                )
        except BaseException as exc:
            self._fail_group(group, chunk.members(), writes, exc)
            if not isinstance(exc, Exception):
                raise
            for wid in chunk.wids:
                outcomes[wid] = exc
            return len(chunk.wids)
        if renewed_all:
            self._settle_renewed(group, chunk, writes, now, outcomes)
            return 0
        self._settle(group, members, writes, committed, errors, now, outcomes, lost)
        return len(errors)

    def _writes(self, chunk: Chunk, now: int) -> list[CasRow]:
        """Build each renewal of ``chunk``: ``(holder key, expected bytes, new bytes)``.

        Holders with a known split get the packed ``expires_at`` spliced in, which is byte for
        byte what :func:`build_renew_transition` would write; the others go through it.
        """
        expires_at = now + self._claim_ttl_ms
        columns = zip(chunk.wids, chunk.entries, chunk.expected, strict=True)
        if not 0 <= expires_at <= SAFE_INT_MAX:
            return [self._rebuilt(wid, entry, old, now) for wid, entry, old in columns]
        packed = msgpack.packb(expires_at)
        rows: list[CasRow] = []
        for wid, entry, old in columns:
            head_len, tail_len = entry.splice_lengths()
            if head_len:
                rows.append((entry.holder_key, old, packed.join((old[:head_len], old[-tail_len:]))))
            else:
                rows.append(self._rebuilt(wid, entry, old, now))
        return rows

    def _rebuilt(self, wid: str, entry: TrackedClaim, old: bytes, now: int) -> CasRow:
        """One renewal built by decoding and re-encoding the holder record."""
        fragment = build_renew_transition(
            workflow_id=wid, now=now, claim_ttl_ms=self._claim_ttl_ms, current_holder_bytes=old
        )
        return entry.holder_key, old, extract_put_value(fragment.operations, entry.holder_key)

    def _retry_ambiguous(
        self,
        members: list[Member],
        writes: list[CasRow],
        committed: list[bool],
        now: int,
        commit: Committer,
        errors: dict[str, Exception],
    ) -> None:
        """Re-examine failed CASes of entries with pending values; retry adopted ones once.

        Updates ``members``, ``writes`` and ``committed`` in place for the retried renewals.
        ``errors`` holds the ids already failed (their rows were locked), which are left alone;
        the ids whose re-read or retry fails are added to it, with the exception.
        """
        if all(committed):
            return
        adopted = self._adopt_landed(members, committed, errors)
        if not adopted:
            return
        retried = [members[i] for i in adopted]
        retry_writes: list[CasRow] = []
        try:
            retry_writes = self._writes(Chunk.of(retried), now)
            results = commit(retry_writes)
        except Exception as exc:
            self._remember_pending(retried, retry_writes)
            errors.update((wid, exc) for wid, _, _ in retried)
            return
        for i, row, ok in zip(adopted, retry_writes, results, strict=True):
            writes[i] = row
            committed[i] = ok is True
            if isinstance(ok, Exception):
                errors[members[i][0]] = ok

    def _adopt_landed(
        self, members: list[Member], committed: list[bool], errors: dict[str, Exception]
    ) -> list[int]:
        """Re-read the holder of each failed member with pending values; adopt the ones found.

        Replaces each adopted member by one expecting the adopted bytes; records read errors
        in ``errors``.

        :returns: the indexes of the adopted members.
        """
        table = self._table
        with table.lock:
            suspects = [
                i
                for i, (wid, entry, _) in enumerate(members)
                if not committed[i]
                and wid not in errors
                and entry.pending
                and table.claims.get(wid) is entry
            ]
        adopted: list[int] = []
        for i in suspects:
            wid, entry, _ = members[i]
            try:
                observed = self._storage.get(entry.holder_key)
            except Exception as exc:
                errors[wid] = exc
                continue
            if observed is not None and table.adopt_pending(wid, entry, observed):
                _log.debug(
                    "an earlier renewal of workflow %r had committed although it raised; "
                    "renewing again from it",
                    wid,
                )
                members[i] = (wid, entry, observed)
                adopted.append(i)
        return adopted

    def _settle(
        self,
        group: RenewalGroup,
        members: Sequence[Member],
        writes: Sequence[CasRow],
        committed: Sequence[bool],
        errors: dict[str, Exception],
        now: int,
        outcomes: Outcomes,
        lost: list[Lost],
    ) -> None:
        """Apply finished renewals to the entries they started from, then wake their waiters.

        Stores each outcome in ``outcomes`` and appends the ids of lost claims to ``lost``.
        """
        results, group_errors = group.results, group.errors
        table = self._table
        with table.lock:
            claims, in_flight = table.claims, table.in_flight
            for (wid, entry, _), row, ok in zip(members, writes, committed, strict=True):
                if in_flight.get(wid) is group:
                    del in_flight[wid]
                if errors:
                    error = errors.get(wid)
                    if error is not None:
                        group_errors[wid] = outcomes[wid] = error
                        continue
                if ok:
                    if claims.get(wid) is entry:
                        entry.holder_bytes = row[2]
                        entry.renewed_at = now
                        if entry.pending:
                            entry.pending = ()
                    result = entry.renewed
                    if result is None:
                        result = entry.renewed = RenewResult(_RENEWED, wid)
                    results[wid] = outcomes[wid] = result
                    continue
                if wid not in claims:
                    # Released locally meanwhile (a release folded into a host's transaction
                    # committed while this renewal waited for its lock): nothing is lost.
                    results[wid] = outcomes[wid] = RenewResult(RenewStatus.NOT_HELD, wid)
                    continue
                current = claims.get(wid)
                if current is entry:
                    del claims[wid]
                    # The window starts at this renewal's own clock reading.
                    table.cooldown.record_deposition(wid, now)
                results[wid] = outcomes[wid] = RenewResult(_LOST, wid)
                if current is not None:
                    # Not reported again when the entry is gone: whatever dropped it (a fenced
                    # write that found the claim deposed, a local loss) reported it already.
                    lost.append((wid, entry))
        group.done.set()

    def _settle_renewed(
        self,
        group: RenewalGroup,
        chunk: Chunk,
        writes: Sequence[CasRow],
        now: int,
        outcomes: Outcomes,
    ) -> None:
        """:meth:`_settle` for a chunk whose every renewal committed (the usual pass)."""
        results: dict[str, RenewResult] = {}
        table = self._table
        with table.lock:
            claims, in_flight = table.claims, table.in_flight
            for wid, entry, row in zip(chunk.wids, chunk.entries, writes, strict=True):
                if in_flight.get(wid) is group:
                    del in_flight[wid]
                if claims.get(wid) is entry:
                    entry.holder_bytes = row[2]
                    entry.renewed_at = now
                    if entry.pending:
                        entry.pending = ()
                result = entry.renewed
                if result is None:
                    result = entry.renewed = RenewResult(_RENEWED, wid)
                results[wid] = result
            group.results = results
        outcomes.update(results)
        group.done.set()

    def _fail_group(
        self,
        group: RenewalGroup,
        members: Sequence[Member],
        writes: Sequence[CasRow],
        exc: BaseException,
    ) -> None:
        """Fail every renewal of ``group`` with ``exc``; remember the values it may have written."""
        self._remember_pending(members, writes)
        with self._table.lock:
            for wid, _, _ in members:
                if self._table.in_flight.get(wid) is group:
                    del self._table.in_flight[wid]
        group.error = exc
        group.done.set()

    def _remember_pending(self, members: Sequence[Member], writes: Sequence[CasRow]) -> None:
        # zip stops at the writes built before the failure: only those can have been committed.
        with self._table.lock:
            for (wid, entry, _), row in zip(members, writes, strict=False):
                if self._table.claims.get(wid) is entry:
                    entry.remember_pending(row[2])

    # -- commits and reports ---------------------------------------------------------------

    def _commit_one(self, rows: Sequence[CasRow]) -> list[bool]:
        ((key, expected, new),) = rows
        return [
            storage_conditional_batch(self._storage, [Condition(key, expected)], [Put(key, new)])
        ]

    def _commit_many(self, rows: Sequence[CasRow]) -> list[Judged]:
        """Commit independent renewals in one transaction, checking the declared capability.

        A row another session holds locked fails alone (the store does not wait for it).
        """
        return storage_compare_and_set_many_isolated(self._storage, rows)

    def _report_lost(self, wid: str) -> None:
        _log.warning(
            "engine %s lost its claim on workflow %r: another engine or an external "
            "cancel/timeout/suspend/purge replaced it",
            self._engine_id,
            wid,
        )
        self._losses.remember((wid,), DEPOSED)
        metrics = self._losses.metrics
        if metrics is not None:
            metrics.record_claims_lost(DEPOSED)
        self._warn(WorkflowClaimLostWarning(wid))

    def _report_all_lost(self, lost: Sequence[Lost]) -> Outcomes:
        """Report each lost claim; return the outcomes that change, per id, without stopping.

        A claim whose store shows it went back in time (:mod:`~weft_sync.claims.rollback`) is
        lost with cause ``store_rollback``, with every other claim of this engine; the rest
        are ordinary depositions. What the warn sink raised replaces an id's outcome.
        """
        changed: Outcomes = {}
        rolled, evidence = self._rolled_back(lost)
        if rolled:
            every, sink_errors = self._losses.lose_rolled_back(
                rolled, describe_store(self._storage), evidence, self._clock()
            )
            # Every claim is lost, including ones renewed in this same pass.
            changed.update((wid, RenewResult(_LOST, wid, STORE_ROLLBACK)) for wid in every)
            changed.update(sink_errors)
        interrupted: BaseException | None = None
        for wid, _ in lost:
            if wid in changed:
                continue
            try:
                self._report_lost(wid)
            except Exception as exc:
                changed[wid] = exc
            except BaseException as exc:
                # Host code behind the sink (SystemExit, ...): the other losses are reported
                # first, since their claims have already left the table.
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted
        return changed

    def _rolled_back(self, lost: Sequence[Lost]) -> tuple[list[str], str]:
        """The lost claims whose epoch and holder show the store went back in time, and the
        first evidence found. Reads both keys of each lost claim (only after a failed renewal);
        a read that fails judges nothing."""
        keys_read: list[str] = []
        for wid, entry in lost:
            keys_read += (epoch_key(wid), entry.holder_key)
        try:
            values = storage_get_many(self._storage, keys_read)
        except Exception as exc:
            _log.debug("could not re-read lost claims to check for a store rollback: %r", exc)
            return [], ""
        rolled: list[str] = []
        first = ""
        for i, (wid, entry) in enumerate(lost):
            found = rollback_evidence(
                engine_id=self._engine_id,
                held_token=entry.epoch_bytes,
                held_holder=entry.holder_bytes,
                observed_token=values[2 * i],
                observed_holder=values[2 * i + 1],
            )
            if found is not None:
                rolled.append(wid)
                first = first or f"workflow {wid!r}: {found}"
        return rolled, first
