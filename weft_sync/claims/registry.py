"""The claim registry: this engine's view of the workflow claims it holds.

The registry is the only code that commits claim transitions. It remembers, per held workflow, the
exact epoch and holder bytes it last wrote, so every later compare-and-swap names those bytes and
fails if anyone else has written since.

Threading: one lock guards the claims map, the per-workflow in-flight renewal groups and the
releasing counts. The lock is never held across storage I/O, clock reads, warning sinks or
logging. Identity guards compare tracking entries with ``is``: a renewal or release only touches
the entry it started from, never a newer one a concurrent acquire or takeover installed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import msgpack

from .. import keys
from ..clock import Clock
from ..codec import SAFE_INT_MAX, decode_epoch, decode_holder, encode_holder
from ..errors import StorageCapabilityError, StorageError, WorkflowClaimLostWarning
from ..keys import validate_workflow_id
from ..storage.base import Batch, Condition, Put, Storage, storage_conditional_batch
from .cooldown import TakeoverCooldown
from .results import (
    AcquirePreparation,
    AcquireResult,
    AcquireStatus,
    ReleaseResult,
    ReleaseStatus,
    RenewResult,
    RenewStatus,
    TakeoverResult,
    TakeoverStatus,
)
from .transitions import (
    Fragment,
    build_acquire_transition,
    build_release_transition,
    build_renew_transition,
    build_takeover_transition,
    extract_put_value,
    is_claim_expired,
)

__all__ = ["DEFAULT_RENEW_CHUNK_SIZE", "RELEASE_ALL_CONCURRENCY", "ClaimRegistry", "WarnSink"]

_log = logging.getLogger(__name__)

WarnSink = Callable[[Warning], None]
DEFAULT_RENEW_CHUNK_SIZE: Final = 500
RELEASE_ALL_CONCURRENCY: Final = 16

_T = TypeVar("_T")

_HOLDER_PREFIX: Final = keys.workflow_owner_holder("")
# Ids made only of these characters are their own key component: encodeURIComponent keeps them.
_PLAIN_ID: Final = re.compile(r"[A-Za-z0-9_.!~*'()-]+")
_PACKED_EXPIRES_AT_KEY: Final = msgpack.packb("expires_at")


def _default_warn(warning: Warning) -> None:
    # Points at the caller of the public registry method that found the claim lost.
    warnings.warn(warning, stacklevel=4)


@dataclass(eq=False, slots=True)
class _Entry:
    """One held claim. Compared by identity: each acquire or takeover installs a new object.

    ``holder_bytes`` is replaced after each successful renewal, under the registry lock. A renewal
    rewrites only the ``expires_at`` value: ``head_len`` bytes before it and ``tail_len`` bytes
    after it stay as they are (``head_len == 0``: renew through ``build_renew_transition``).
    """

    epoch: int
    claimed_at: int
    epoch_bytes: bytes
    holder_bytes: bytes
    head_len: int = 0
    tail_len: int = 0


# A renewal in flight: the workflow id, the entry it started from and the holder bytes it expects.
_Member = tuple[str, "_Entry", bytes]


class _RenewalGroup:
    """Renewals committed in one transaction; callers joining one of them wait on ``done``.

    ``results`` and ``error`` are written before ``done`` is set and never after it.
    """

    __slots__ = ("done", "error", "results")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.results: dict[str, RenewResult] = {}
        self.error: BaseException | None = None

    def result(self, workflow_id: str) -> RenewResult:
        """Wait for the group; return the id's result or raise the group's error."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.results[workflow_id]

    def outcome(self, workflow_id: str) -> RenewResult | Exception:
        """Like :meth:`result`, but return an ``Exception`` instead of raising it."""
        self.done.wait()
        error = self.error
        if error is None:
            return self.results[workflow_id]
        if isinstance(error, Exception):
            return error
        raise error


def _holder_key(workflow_id: str) -> str:
    """``keys.workflow_owner_holder``, without percent-encoding ids that encode to themselves."""
    if _PLAIN_ID.fullmatch(workflow_id):
        return _HOLDER_PREFIX + workflow_id
    return keys.workflow_owner_holder(workflow_id)


def _renewal_split(holder_bytes: bytes) -> tuple[int, int]:
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


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int number of milliseconds, got {value!r}")
    return value


class ClaimRegistry:
    """Acquires, renews, releases and takes over per-workflow claims for one engine.

    No method raises on a lost compare-and-swap: contention is reported in the result. Storage
    errors propagate (``release_all`` excepted).

    :param storage: the shared store; it must declare the ``conditional_batch`` capability.
    :param engine_id: this engine's id, written into every holder record it creates.
    :param clock: milliseconds since the Unix epoch (wall time: holders are compared across hosts).
    :param claim_ttl_ms: how long a claim lives after each acquire, takeover or renewal.
    :param claim_renew_interval_ms: how often claims are renewed; also the takeover grace unit and
        the cooldown window after this engine lost a claim.
    :param warn: receives a :class:`~weft_sync.errors.WorkflowClaimLostWarning` once per lost
        claim; default :func:`warnings.warn`.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        engine_id: str,
        clock: Clock,
        claim_ttl_ms: int,
        claim_renew_interval_ms: int,
        warn: WarnSink | None = None,
    ) -> None:
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"engine_id must be a non-empty str, got {engine_id!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning int milliseconds, got {clock!r}")
        if warn is not None and not callable(warn):
            raise TypeError(f"warn must be a callable taking a Warning, or None, got {warn!r}")
        self._storage = storage
        self._engine_id = engine_id
        self._clock = clock
        self._claim_ttl_ms = _positive_int("claim_ttl_ms", claim_ttl_ms)
        self._renew_interval_ms = _positive_int("claim_renew_interval_ms", claim_renew_interval_ms)
        self._warn: WarnSink = warn if warn is not None else _default_warn
        self._cooldown = TakeoverCooldown(self._renew_interval_ms)
        # _lock guards _claims, _in_flight and _releasing. Nothing that can block or call out
        # (storage, clock, warn sink, logging) runs while it is held.
        self._lock = threading.Lock()
        self._claims: dict[str, _Entry] = {}
        self._in_flight: dict[str, _RenewalGroup] = {}
        self._releasing: dict[str, int] = {}

    # -- read-only views -------------------------------------------------------------------

    @property
    def engine_id(self) -> str:
        """The engine id written into this registry's holder records."""
        return self._engine_id

    @property
    def storage(self) -> Storage:
        """The store this registry commits to."""
        return self._storage

    def current_epoch(self, workflow_id: str) -> int | None:
        """The epoch this engine holds for ``workflow_id``, or ``None`` if it holds none."""
        wid = validate_workflow_id(workflow_id)
        with self._lock:
            entry = self._claims.get(wid)
            return None if entry is None else entry.epoch

    def current_epoch_bytes(self, workflow_id: str) -> bytes | None:
        """The exact epoch bytes this engine wrote for ``workflow_id`` (the fence), or ``None``."""
        wid = validate_workflow_id(workflow_id)
        with self._lock:
            entry = self._claims.get(wid)
            # bytes are immutable, so handing out the cached object cannot alter the cache.
            return None if entry is None else entry.epoch_bytes

    def list_held_workflow_ids(self) -> list[str]:
        """A snapshot of the workflow ids this engine tracks as held."""
        with self._lock:
            return list(self._claims)

    # -- acquire and folded acquire --------------------------------------------------------

    def acquire(self, workflow_id: str) -> AcquireResult:
        """Claim a workflow nobody holds; never steals a present holder, however old.

        :returns: ``acquired`` with the new epoch, or ``lost-race`` with the holder's engine id
            (``None`` when there is no readable holder).
        """
        wid = validate_workflow_id(workflow_id)
        holder_key = keys.workflow_owner_holder(wid)
        observed_holder = self._storage.get(holder_key)
        observed_epoch = self._storage.get(keys.workflow_owner_epoch(wid))
        now = self._clock()
        fragment = build_acquire_transition(
            workflow_id=wid,
            engine_id=self._engine_id,
            now=now,
            claim_ttl_ms=self._claim_ttl_ms,
            observed_epoch_bytes=observed_epoch,
        )
        if not self._commit(fragment):
            held_by = self._held_by(holder_key, observed_holder)
            _log.debug("acquire of workflow %r lost the race (held by %r)", wid, held_by)
            return AcquireResult(AcquireStatus.LOST_RACE, wid, held_by=held_by)
        epoch = self._install(wid, fragment, now)
        _log.info("engine %s acquired workflow %r at epoch %d", self._engine_id, wid, epoch)
        return AcquireResult(AcquireStatus.ACQUIRED, wid, epoch=epoch)

    def prepare_acquire_fragment(self, workflow_id: str) -> AcquirePreparation:
        """Build an acquire fragment for the caller to fold into its own atomic write.

        Reads the epoch afresh on every call, so it is safe to call again on each retry. Commits
        nothing and tracks nothing: call :meth:`record_folded_acquire` after the caller's write
        (which must include every condition and operation of the fragment) committed.
        """
        wid = validate_workflow_id(workflow_id)
        observed_epoch = self._storage.get(keys.workflow_owner_epoch(wid))
        now = self._clock()
        fragment = build_acquire_transition(
            workflow_id=wid,
            engine_id=self._engine_id,
            now=now,
            claim_ttl_ms=self._claim_ttl_ms,
            observed_epoch_bytes=observed_epoch,
        )
        epoch = decode_epoch(extract_put_value(fragment.operations, keys.workflow_owner_epoch(wid)))
        assert epoch is not None  # the fragment was just encoded from a valid epoch
        _log.debug("prepared an acquire fragment for workflow %r at epoch %d", wid, epoch)
        return AcquirePreparation(fragment=fragment, epoch=epoch, claimed_at=now)

    def record_folded_acquire(self, workflow_id: str, preparation: AcquirePreparation) -> None:
        """Track a claim whose acquire fragment the caller committed in its own write.

        Performs no I/O. Call it only after that write committed.

        :raises ValueError: ``preparation`` was built for another workflow.
        """
        wid = validate_workflow_id(workflow_id)
        if not isinstance(preparation, AcquirePreparation):
            raise TypeError(
                f"preparation must come from prepare_acquire_fragment(), got {preparation!r:.80}"
            )
        self._install(wid, preparation.fragment, preparation.claimed_at)
        _log.info(
            "engine %s acquired workflow %r at epoch %d (folded into the caller's write)",
            self._engine_id,
            wid,
            preparation.epoch,
        )

    # -- renewal ---------------------------------------------------------------------------

    def renew(self, workflow_id: str) -> RenewResult:
        """Extend this engine's claim on ``workflow_id``.

        Concurrent calls for one workflow share one renewal and receive the identical result
        object (or the identical exception).

        :returns: ``renewed``; ``lost`` when another writer replaced the holder (the local entry is
            dropped, the takeover cooldown starts and one
            :class:`~weft_sync.errors.WorkflowClaimLostWarning` is emitted); ``not-held`` when the
            workflow is not tracked or is being released.
        :raises StorageError: the commit failed; the claim stays tracked and nothing is emitted.
        """
        wid = validate_workflow_id(workflow_id)
        group = _RenewalGroup()
        member: _Member | None = None
        with self._lock:
            joined = self._in_flight.get(wid)
            if joined is None:
                member = self._start_renewal(wid, group)
        if joined is not None:
            _log.debug("renewal of workflow %r joins the renewal already in flight", wid)
            return joined.result(wid)
        if member is None:
            _log.debug("renewal of workflow %r: not held", wid)
            return RenewResult(RenewStatus.NOT_HELD, wid)
        try:
            now = self._clock()
            batches, new_values = self._renewal_writes([member], now)
            committed = storage_conditional_batch(self._storage, *batches[0])
        except BaseException as exc:
            self._fail_groups([(group, [member])], exc)
            _log.debug("renewal of workflow %r failed: %r", wid, exc)
            raise
        (result,) = self._settle_group(group, [member], new_values, [committed], now)
        if result.status is RenewStatus.LOST:
            self._report_lost(wid)
        else:
            _log.debug("renewed the claim on workflow %r", wid)
        return result

    def renew_many(
        self, workflow_ids: Iterable[str], *, chunk_size: int = DEFAULT_RENEW_CHUNK_SIZE
    ) -> list[RenewResult]:
        """Renew many claims in a few transactions, one per chunk of ``chunk_size`` claims.

        Each id gets the outcome :meth:`renew` would give it, positionally; a repeated id is
        renewed once and its result object appears at each of its positions.

        :raises StorageError: a chunk failed to commit. Every chunk is attempted first; the error
            raised is the first failure in input order (which may also be an exception the
            ``warn`` sink raised). :meth:`renew_many_outcomes` reports failures per id instead.
        """
        outcomes = self.renew_many_outcomes(workflow_ids, chunk_size=chunk_size)
        results: list[RenewResult] = []
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
            results.append(outcome)
        return results

    def renew_many_outcomes(
        self, workflow_ids: Iterable[str], *, chunk_size: int = DEFAULT_RENEW_CHUNK_SIZE
    ) -> list[RenewResult | Exception]:
        """Like :meth:`renew_many`, but report a failed renewal as its exception, in place.

        A storage error fails only the ids of the chunk whose commit raised; an exception the
        ``warn`` sink raises while reporting a lost claim replaces only that id's ``lost`` result
        (the claim is dropped all the same), as :meth:`renew` would raise it. Ids whose renewal
        another caller already has in flight wait for that renewal; the renewals this call
        starts are shared the same way with concurrent callers.
        """
        ids = [validate_workflow_id(w) for w in workflow_ids]
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        outcomes: dict[str, RenewResult | Exception] = {}
        joined: dict[str, _RenewalGroup] = {}
        groups: list[tuple[_RenewalGroup, list[_Member]]] = []
        with self._lock:
            for wid in dict.fromkeys(ids):
                in_flight = self._in_flight.get(wid)
                if in_flight is not None:
                    joined[wid] = in_flight
                    continue
                if not groups or len(groups[-1][1]) >= chunk_size:
                    groups.append((_RenewalGroup(), []))
                group, members = groups[-1]
                member = self._start_renewal(wid, group)
                if member is None:
                    outcomes[wid] = RenewResult(RenewStatus.NOT_HELD, wid)
                else:
                    members.append(member)
        lost: list[str] = []
        try:
            for group, members in groups:
                if members:
                    self._renew_group(group, members, outcomes, lost)
        except BaseException as exc:
            self._fail_groups([(g, m) for g, m in groups if not g.done.is_set()], exc)
            raise
        for wid, in_flight in joined.items():
            outcomes[wid] = in_flight.outcome(wid)
        # A warn sink that raises fails only the id it was reporting, as renew() would.
        outcomes.update(self._report_all_lost(lost))
        return [outcomes[wid] for wid in ids]

    def _start_renewal(self, wid: str, group: _RenewalGroup) -> _Member | None:
        """Register a renewal of ``wid`` in ``group``; ``None`` if it is not renewable. Locked."""
        if wid in self._releasing:
            return None
        entry = self._claims.get(wid)
        if entry is None:
            return None
        self._in_flight[wid] = group
        return (wid, entry, entry.holder_bytes)

    def _renewal_writes(
        self, members: Sequence[_Member], now: int
    ) -> tuple[list[Batch], list[bytes]]:
        """Build each member's renewal CAS and the holder bytes it writes.

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
                key = _holder_key(wid)
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

    def _renew_group(
        self,
        group: _RenewalGroup,
        members: list[_Member],
        outcomes: dict[str, RenewResult | Exception],
        lost: list[str],
    ) -> None:
        try:
            now = self._clock()
            batches, new_values = self._renewal_writes(members, now)
            committed = self._commit_many(batches)
        except Exception as exc:
            self._fail_groups([(group, members)], exc)
            for wid, _, _ in members:
                outcomes[wid] = exc
            _log.debug("batched renewal of %d claims failed: %r", len(members), exc)
            return
        results = self._settle_group(group, members, new_values, committed, now)
        lost_here = 0
        for result in results:
            outcomes[result.workflow_id] = result
            if result.status is RenewStatus.LOST:
                lost.append(result.workflow_id)
                lost_here += 1
        _log.debug(
            "batched renewal of %d claims: %d renewed, %d lost",
            len(members),
            len(members) - lost_here,
            lost_here,
        )

    def _settle_group(
        self,
        group: _RenewalGroup,
        members: Sequence[_Member],
        new_values: Sequence[bytes],
        committed: Sequence[bool],
        now: int,
    ) -> list[RenewResult]:
        """Apply finished renewals to the entries they started from, then wake their waiters."""
        results: list[RenewResult] = []
        renewed, lost = RenewStatus.RENEWED, RenewStatus.LOST
        with self._lock:
            claims, in_flight = self._claims, self._in_flight
            for (wid, entry, _), new, ok in zip(members, new_values, committed, strict=True):
                tracked = claims.get(wid) is entry
                if ok and tracked:
                    entry.holder_bytes = new
                elif not ok and tracked:
                    del claims[wid]
                    # The window starts at this renewal's own clock reading.
                    self._cooldown.record_deposition(wid, now)
                if in_flight.get(wid) is group:
                    del in_flight[wid]
                result = RenewResult(renewed if ok else lost, wid)
                group.results[wid] = result
                results.append(result)
        group.done.set()
        return results

    def _fail_groups(
        self, groups: Sequence[tuple[_RenewalGroup, Sequence[_Member]]], exc: BaseException
    ) -> None:
        with self._lock:
            for group, members in groups:
                for wid, _, _ in members:
                    if self._in_flight.get(wid) is group:
                        del self._in_flight[wid]
        for group, _ in groups:
            group.error = exc
            group.done.set()

    # -- release ---------------------------------------------------------------------------

    def release(self, workflow_id: str, expected_epoch: int | None = None) -> ReleaseResult:
        """Give up this engine's claim: delete the holder if epoch and holder are still ours.

        Renewals that start while the release runs return ``not-held``; a renewal already in
        flight is waited for first (its error is ignored). The epoch key is kept.

        :param expected_epoch: release only if the tracked epoch equals this one; otherwise
            return ``not-held`` without writing (protects a newer generation of the same id).
        :returns: ``released``; ``lost-race`` when the claim had already moved on (the local entry
            is dropped either way); ``not-held`` when nothing matching is tracked.
        :raises StorageError: the commit failed; the local entry is dropped all the same, so the
            renewal task does not keep renewing a claim the caller meant to give up.
        """
        wid = validate_workflow_id(workflow_id)
        if expected_epoch is not None and (
            isinstance(expected_epoch, bool) or not isinstance(expected_epoch, int)
        ):
            raise TypeError(f"expected_epoch must be an int or None, got {expected_epoch!r}")
        with self._lock:
            self._releasing[wid] = self._releasing.get(wid, 0) + 1
            in_flight = self._in_flight.get(wid)
        try:
            if in_flight is not None:
                _log.debug("release of workflow %r waits for the renewal in flight", wid)
                # Waits without raising: the renewal's own caller sees its error.
                in_flight.done.wait()
            return self._release_tracked(wid, expected_epoch)
        finally:
            with self._lock:
                remaining = self._releasing[wid] - 1
                if remaining:
                    self._releasing[wid] = remaining
                else:
                    del self._releasing[wid]

    def _release_tracked(self, wid: str, expected_epoch: int | None) -> ReleaseResult:
        with self._lock:
            entry = self._claims.get(wid)
            cached = None if entry is None else (entry.epoch_bytes, entry.holder_bytes)
        if (
            entry is None
            or cached is None
            or (expected_epoch is not None and entry.epoch != expected_epoch)
        ):
            _log.debug(
                "release of workflow %r: not held at epoch %r (tracked epoch %r)",
                wid,
                expected_epoch,
                None if entry is None else entry.epoch,
            )
            return ReleaseResult(ReleaseStatus.NOT_HELD, wid)
        fragment = build_release_transition(
            workflow_id=wid, current_epoch_bytes=cached[0], current_holder_bytes=cached[1]
        )
        try:
            committed = self._commit(fragment)
        finally:
            self._drop_if_same(wid, entry)
        if committed:
            _log.debug("released the claim on workflow %r at epoch %d", wid, entry.epoch)
            return ReleaseResult(ReleaseStatus.RELEASED, wid)
        _log.info(
            "release of workflow %r at epoch %d found the claim already moved on", wid, entry.epoch
        )
        return ReleaseResult(ReleaseStatus.LOST_RACE, wid)

    def release_all(self) -> None:
        """Release every held claim concurrently; swallow (and log) every failure. Never raises."""
        try:
            ids = self.list_held_workflow_ids()
            if ids:
                _run_concurrently(self._release_quietly, ids, RELEASE_ALL_CONCURRENCY)
        except Exception:
            _log.exception("releasing all claims failed")

    def _release_quietly(self, wid: str) -> None:
        try:
            self.release(wid)
        except Exception:
            _log.warning("could not release the claim on workflow %r", wid, exc_info=True)

    def forget_local_claim(self, workflow_id: str) -> None:
        """Drop the local entry for ``workflow_id`` without touching the store.

        For callers whose own commit already removed the durable holder (e.g. a suspend that
        rotated the epoch). Check :meth:`current_epoch` first so a newer generation survives.
        """
        wid = validate_workflow_id(workflow_id)
        with self._lock:
            entry = self._claims.pop(wid, None)
        if entry is not None:
            _log.debug("forgot the local claim on workflow %r at epoch %d", wid, entry.epoch)

    # -- takeover --------------------------------------------------------------------------

    def takeover(self, workflow_id: str) -> TakeoverResult:
        """Take over a claim whose holder expired (or is unreadable), minting epoch + 1.

        Makes at most one compare-and-swap attempt; callers retry. Reads nothing while this
        engine's cooldown for the workflow (after it lost the claim) is active.

        :returns: ``acquired`` with the new epoch; ``backoff-skipped`` during the cooldown;
            ``no-claim`` when there is no holder or no epoch; ``not-expired`` with the live
            holder's engine id and expiry; ``lost-race`` with the new holder's engine id.
        """
        wid = validate_workflow_id(workflow_id)
        now = self._clock()
        if self._cooldown.is_active(wid, now):
            _log.debug("takeover of workflow %r skipped: cooldown active", wid)
            return TakeoverResult(TakeoverStatus.BACKOFF_SKIPPED, wid)
        holder_key = keys.workflow_owner_holder(wid)
        observed_holder = self._storage.get(holder_key)
        observed_epoch = (
            None if observed_holder is None else self._storage.get(keys.workflow_owner_epoch(wid))
        )
        if observed_holder is None or observed_epoch is None:
            # A holder without an epoch breaks the invariant: there is nothing safe to fence on.
            _log.debug(
                "takeover of workflow %r: no claim (holder %s, epoch absent)",
                wid,
                "absent" if observed_holder is None else "present",
            )
            return TakeoverResult(TakeoverStatus.NO_CLAIM, wid)
        holder = decode_holder(observed_holder)
        if holder is not None and not is_claim_expired(
            expires_at=holder.expires_at, now=now, renew_interval_ms=self._renew_interval_ms
        ):
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
        fragment = build_takeover_transition(
            workflow_id=wid,
            engine_id=self._engine_id,
            now=now,
            claim_ttl_ms=self._claim_ttl_ms,
            observed_holder_bytes=observed_holder,
            observed_epoch_bytes=observed_epoch,
        )
        if not self._commit(fragment):
            held_by = self._held_by(holder_key, None)
            _log.debug("takeover of workflow %r lost the race (held by %r)", wid, held_by)
            return TakeoverResult(TakeoverStatus.LOST_RACE, wid, held_by=held_by)
        epoch = self._install(wid, fragment, now)
        _log.info(
            "engine %s took over workflow %r at epoch %d from %r",
            self._engine_id,
            wid,
            epoch,
            None if holder is None else holder.engine_id,
        )
        return TakeoverResult(TakeoverStatus.ACQUIRED, wid, epoch=epoch)

    # -- helpers ---------------------------------------------------------------------------

    def _commit(self, fragment: Fragment) -> bool:
        return storage_conditional_batch(self._storage, fragment.conditions, fragment.operations)

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

    def _held_by(self, holder_key: str, observed: bytes | None) -> str | None:
        """The engine id in ``observed`` holder bytes, or in a fresh read when none were seen."""
        raw = observed if observed is not None else self._storage.get(holder_key)
        holder = decode_holder(raw)
        return None if holder is None else holder.engine_id

    def _install(self, wid: str, fragment: Fragment, claimed_at: int) -> int:
        """Track the claim ``fragment`` wrote, from its exact put values; return its epoch."""
        epoch_bytes = extract_put_value(fragment.operations, keys.workflow_owner_epoch(wid))
        holder_bytes = extract_put_value(fragment.operations, keys.workflow_owner_holder(wid))
        epoch = decode_epoch(epoch_bytes)
        if epoch is None:
            raise ValueError(f"the fragment for workflow {wid!r} puts an invalid epoch")
        entry = _Entry(epoch, claimed_at, epoch_bytes, holder_bytes, *_renewal_split(holder_bytes))
        with self._lock:
            self._claims[wid] = entry
            self._cooldown.clear(wid)
        return epoch

    def _drop_if_same(self, wid: str, entry: _Entry) -> None:
        with self._lock:
            if self._claims.get(wid) is entry:
                del self._claims[wid]

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

    def __repr__(self) -> str:
        with self._lock:
            held = len(self._claims)
        return f"ClaimRegistry(engine_id={self._engine_id!r}, held={held})"


def _run_concurrently(fn: Callable[[_T], None], items: Sequence[_T], max_workers: int) -> None:
    """Call ``fn`` on every item from up to ``max_workers`` named daemon threads; join them all.

    ``fn`` must not raise (exceptions would end that worker early and be printed by threading).
    """
    if len(items) == 1:
        fn(items[0])
        return
    # lock guards position.
    lock = threading.Lock()
    position = iter(range(len(items)))

    def worker() -> None:
        while True:
            with lock:
                index = next(position, None)
            if index is None:
                return
            fn(items[index])

    threads = [
        threading.Thread(target=worker, name=f"weft-sync-release-{n}", daemon=True)
        for n in range(min(max_workers, len(items)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
