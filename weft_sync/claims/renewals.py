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

import dataclasses
import logging
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Final

import msgpack

from .. import keys
from ..clock import Clock
from ..codec import SAFE_INT_MAX, decode_holder, encode_holder
from ..errors import StorageCapabilityError, StorageError, WorkflowClaimLostWarning
from ..storage.base import Batch, Condition, Put, Storage, storage_conditional_batch
from .results import RenewResult, RenewStatus
from .tracking import ClaimTable, RenewalGroup, TrackedClaim
from .transitions import build_renew_transition, extract_put_value

__all__ = [
    "DEFAULT_RENEW_CHUNK_SIZE",
    "Renewals",
    "WarnSink",
    "default_warn",
    "holder_key",
    "renewal_split",
]

# Logs under the registry's logger: one logger names every claim operation of the registry.
_log = logging.getLogger("weft_sync.claims.registry")

WarnSink = Callable[[Warning], None]
DEFAULT_RENEW_CHUNK_SIZE: Final = 500

_HOLDER_PREFIX: Final = keys.workflow_owner_holder("")
# Ids made only of these characters are their own key component: encodeURIComponent keeps them.
_PLAIN_ID: Final = re.compile(r"[A-Za-z0-9_.!~*'()-]+")
_PACKED_EXPIRES_AT_KEY: Final = msgpack.packb("expires_at")

# A renewal in flight: the workflow id, the entry it started from and the holder bytes it expects.
Member = tuple[str, TrackedClaim, bytes]
# Commits independent batches; returns whether each committed.
Committer = Callable[[Sequence[Batch]], list[bool]]
Outcomes = dict[str, "RenewResult | BaseException"]


def default_warn(warning: Warning) -> None:
    """Emit ``warning`` with :func:`warnings.warn`, pointing at the caller of ``renew()``."""
    # Frames: this sink, _report_lost, Renewals.renew, ClaimRegistry.renew, the caller.
    warnings.warn(warning, stacklevel=5)


def holder_key(workflow_id: str) -> str:
    """``keys.workflow_owner_holder``, without percent-encoding ids that encode to themselves."""
    if _PLAIN_ID.fullmatch(workflow_id):
        return _HOLDER_PREFIX + workflow_id
    return keys.workflow_owner_holder(workflow_id)


def renewal_split(holder_bytes: bytes) -> tuple[int, int]:
    """Return ``(head_len, tail_len)`` around the packed ``expires_at`` value, or ``(0, 0)``.

    Splicing a packed value between the head and the tail must give exactly what
    ``encode_holder`` gives for that value; this is checked here on a probe value, so a holder
    this cannot be shown for is renewed through ``build_renew_transition`` instead.
    """
    record = decode_holder(holder_bytes)
    if record is None or encode_holder(record) != holder_bytes:
        return 0, 0
    marker = _PACKED_EXPIRES_AT_KEY + msgpack.packb(record.expires_at)
    at = holder_bytes.find(marker)
    if at < 0 or holder_bytes.find(marker, at + 1) >= 0:
        return 0, 0
    head_len = at + len(_PACKED_EXPIRES_AT_KEY)
    tail_len = len(holder_bytes) - at - len(marker)
    probe = record.expires_at - 1 if record.expires_at > 0 else 1
    spliced = holder_bytes[:head_len] + msgpack.packb(probe) + holder_bytes[at + len(marker) :]
    if spliced != encode_holder(dataclasses.replace(record, expires_at=probe)):
        return 0, 0
    return head_len, tail_len


class Renewals:
    """The registry's renewal part; ids reaching it are already validated.

    :param table: the registry's tracking state (its lock guards what renewals touch).
    :param storage: the shared store.
    :param clock: the registry's clock.
    :param claim_ttl_ms: the new ``expires_at`` is the renewal's clock reading plus this.
    :param warn: receives one :class:`~weft_sync.errors.WorkflowClaimLostWarning` per lost claim.
    :param engine_id: this engine's id, for log messages.
    """

    def __init__(
        self,
        table: ClaimTable,
        storage: Storage,
        clock: Clock,
        claim_ttl_ms: int,
        warn: WarnSink,
        engine_id: str,
    ) -> None:
        self._table = table
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
        outcome = self._run_group(group, [member], self._commit_one)[wid]
        if isinstance(outcome, BaseException):
            _log.debug("renewal of workflow %r failed: %r", wid, outcome)
            raise outcome
        if outcome.status is RenewStatus.LOST:
            self._report_lost(wid)
        else:
            _log.debug("renewed the claim on workflow %r", wid)
        return outcome

    def renew_many_outcomes(
        self, ids: Sequence[str], chunk_size: int
    ) -> list[RenewResult | Exception]:
        """See :meth:`ClaimRegistry.renew_many_outcomes
        <weft_sync.claims.registry.ClaimRegistry.renew_many_outcomes>`.
        """
        outcomes: dict[str, RenewResult | Exception] = {}
        joined: dict[str, RenewalGroup] = {}
        groups: list[tuple[RenewalGroup, list[Member]]] = []
        table = self._table
        with table.lock:
            for wid in dict.fromkeys(ids):
                in_flight = table.in_flight.get(wid)
                if in_flight is not None:
                    joined[wid] = in_flight
                    continue
                if not groups or len(groups[-1][1]) >= chunk_size:
                    groups.append((RenewalGroup(), []))
                group, members = groups[-1]
                member = self._start(wid, group)
                if member is None:
                    outcomes[wid] = RenewResult(RenewStatus.NOT_HELD, wid)
                else:
                    members.append(member)
        lost: list[str] = []
        try:
            for group, members in groups:
                if members:
                    self._renew_chunk(group, members, outcomes, lost)
        except BaseException as exc:
            for group, members in groups:
                if not group.done.is_set():
                    self._fail_group(group, members, [], exc)
            raise
        for wid, in_flight in joined.items():
            outcomes[wid] = in_flight.outcome(wid)
        # A warn sink that raises fails only the id it was reporting, as renew() would.
        outcomes.update(self._report_all_lost(lost))
        return [outcomes[wid] for wid in ids]

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
        self,
        group: RenewalGroup,
        members: list[Member],
        outcomes: dict[str, RenewResult | Exception],
        lost: list[str],
    ) -> None:
        lost_here = failed = 0
        for wid, outcome in self._run_group(group, members, self._commit_many).items():
            if isinstance(outcome, Exception):
                outcomes[wid] = outcome
                failed += 1
                continue
            assert isinstance(outcome, RenewResult)  # a BaseException was raised, not returned
            outcomes[wid] = outcome
            if outcome.status is RenewStatus.LOST:
                lost.append(wid)
                lost_here += 1
        _log.debug(
            "batched renewal of %d claims: %d renewed, %d lost, %d failed",
            len(members),
            len(members) - lost_here - failed,
            lost_here,
            failed,
        )

    def _run_group(self, group: RenewalGroup, members: list[Member], commit: Committer) -> Outcomes:
        """Renew ``members`` in one commit, settle them and wake the group's waiters.

        :returns: each id's result, or the ``Exception`` that failed it.
        :raises BaseException: anything that is not an ``Exception`` (the group fails with it).
        """
        writes: list[bytes] = []
        try:
            now = self._clock()
            batches, writes = self._writes(members, now)
            committed = commit(batches)
            errors = self._retry_ambiguous(members, writes, committed, now, commit)
        except BaseException as exc:
            self._fail_group(group, members, writes, exc)
            if not isinstance(exc, Exception):
                raise
            return {wid: exc for wid, _, _ in members}
        return self._settle(group, members, writes, committed, errors, now)

    def _writes(self, members: Sequence[Member], now: int) -> tuple[list[Batch], list[bytes]]:
        """Build each member's renewal CAS; return the batches and the holder bytes they write.

        Holders with a known split get the packed ``expires_at`` spliced in, which is byte for
        byte what :func:`build_renew_transition` would write; the others go through it.
        """
        expires_at = now + self._claim_ttl_ms
        packed = msgpack.packb(expires_at) if 0 <= expires_at <= SAFE_INT_MAX else None
        batches: list[Batch] = []
        new_values: list[bytes] = []
        for wid, entry, old in members:
            if packed is not None and entry.head_len:
                new = old[: entry.head_len] + packed + old[len(old) - entry.tail_len :]
                key = holder_key(wid)
                batches.append(((Condition(key, old),), (Put(key, new),)))
            else:
                fragment = build_renew_transition(
                    workflow_id=wid,
                    now=now,
                    claim_ttl_ms=self._claim_ttl_ms,
                    current_holder_bytes=old,
                )
                new = extract_put_value(fragment.operations, keys.workflow_owner_holder(wid))
                batches.append((fragment.conditions, fragment.operations))
            new_values.append(new)
        return batches, new_values

    def _retry_ambiguous(
        self,
        members: list[Member],
        writes: list[bytes],
        committed: list[bool],
        now: int,
        commit: Committer,
    ) -> dict[str, Exception]:
        """Re-examine failed CASes of entries with pending values; retry adopted ones once.

        Updates ``members``, ``writes`` and ``committed`` in place for the retried renewals.

        :returns: the ids whose re-read or retry raised, with the exception.
        """
        errors: dict[str, Exception] = {}
        adopted = self._adopt_landed(members, committed, errors)
        if not adopted:
            return errors
        retried = [members[i] for i in adopted]
        retry_writes: list[bytes] = []
        try:
            batches, retry_writes = self._writes(retried, now)
            results = commit(batches)
        except Exception as exc:
            self._remember_pending(retried, retry_writes)
            errors.update((wid, exc) for wid, _, _ in retried)
            return errors
        for i, new, ok in zip(adopted, retry_writes, results, strict=True):
            writes[i] = new
            committed[i] = ok
        return errors

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
                if not committed[i] and entry.pending and table.claims.get(wid) is entry
            ]
        adopted: list[int] = []
        for i in suspects:
            wid, entry, _ = members[i]
            try:
                observed = self._storage.get(holder_key(wid))
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
        writes: Sequence[bytes],
        committed: Sequence[bool],
        errors: dict[str, Exception],
        now: int,
    ) -> Outcomes:
        """Apply finished renewals to the entries they started from, then wake their waiters."""
        outcomes: Outcomes = {}
        renewed, lost = RenewStatus.RENEWED, RenewStatus.LOST
        table = self._table
        with table.lock:
            claims, in_flight = table.claims, table.in_flight
            for (wid, entry, _), new, ok in zip(members, writes, committed, strict=True):
                if in_flight.get(wid) is group:
                    del in_flight[wid]
                error = errors.get(wid)
                if error is not None:
                    group.errors[wid] = outcomes[wid] = error
                    continue
                tracked = claims.get(wid) is entry
                if ok and tracked:
                    entry.holder_bytes = new
                    entry.pending = ()
                elif not ok and tracked:
                    del claims[wid]
                    # The window starts at this renewal's own clock reading.
                    table.cooldown.record_deposition(wid, now)
                result = RenewResult(renewed if ok else lost, wid)
                group.results[wid] = outcomes[wid] = result
        group.done.set()
        return outcomes

    def _fail_group(
        self,
        group: RenewalGroup,
        members: Sequence[Member],
        writes: Sequence[bytes],
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

    def _remember_pending(self, members: Sequence[Member], writes: Sequence[bytes]) -> None:
        # zip stops at the writes built before the failure: only those can have been committed.
        with self._table.lock:
            for (wid, entry, _), new in zip(members, writes, strict=False):
                if self._table.claims.get(wid) is entry:
                    entry.remember_pending(new)

    # -- commits and reports ---------------------------------------------------------------

    def _commit_one(self, batches: Sequence[Batch]) -> list[bool]:
        ((conditions, operations),) = batches
        return [storage_conditional_batch(self._storage, conditions, operations)]

    def _commit_many(self, batches: Sequence[Batch]) -> list[bool]:
        """Commit independent batches in one transaction, checking the declared capability."""
        if not self._storage.capabilities.conditional_batch:
            raise StorageCapabilityError("batched claim renewal", "conditional_batch")
        results = self._storage.conditional_batches(batches)
        if len(results) != len(batches):
            raise StorageError(
                f"conditional_batches() returned {len(results)} results for {len(batches)} "
                f"batches; the backend breaks the Storage contract"
            )
        return [bool(ok) for ok in results]

    def _report_lost(self, wid: str) -> None:
        _log.warning(
            "engine %s lost its claim on workflow %r: another engine or an external "
            "cancel/timeout/suspend/purge replaced it",
            self._engine_id,
            wid,
        )
        self._warn(WorkflowClaimLostWarning(wid))

    def _report_all_lost(self, lost: Sequence[str]) -> dict[str, Exception]:
        """Report each lost claim; return what the sink raised, per id, without stopping."""
        sink_errors: dict[str, Exception] = {}
        for wid in lost:
            try:
                self._report_lost(wid)
            except Exception as exc:
                sink_errors[wid] = exc
        return sink_errors
