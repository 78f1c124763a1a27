"""The claim registry: this engine's view of the workflow claims it holds.

The registry is the only code that commits claim transitions. It remembers, per held workflow, the
exact epoch and holder bytes it last wrote, so every later compare-and-swap names those bytes and
fails if anyone else has written since. The public operations (checking their arguments) and the
tracking views live here; acquire and the tracking of a committed claim are in
:mod:`~weft_sync.claims.acquires`, takeover in :mod:`~weft_sync.claims.takeovers`, the renewal
machinery in :mod:`~weft_sync.claims.renewals`, release in :mod:`~weft_sync.claims.releases`,
and the tracked state in :mod:`~weft_sync.claims.tracking`.

Threading: one lock, the :class:`~weft_sync.claims.tracking.ClaimTable`'s, guards the claims map,
the per-workflow in-flight renewal groups, the releasing counts, the closed flag and the mutable
fields of every tracked entry; the registry and its renewal, release and loss parts all use that
one table. The operation gate (claim operations in flight, for :meth:`ClaimRegistry.close`) and
the replaced-store record each have a lock guarding only themselves. No lock is held across
storage I/O, clock reads, warning sinks or logging. Identity guards compare tracking entries with
``is``: a renewal or release only touches the entry it started from, never a newer one a
concurrent acquire or takeover installed. Local losses (renew deadline, replaced store) are in
:mod:`~weft_sync.claims.losses`, the close gate in :mod:`~weft_sync.claims.operation_gate`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Final, cast

from .._fork import process_bound_class
from ..clock import Clock
from ..codec import decode_holder
from ..errors import StoreIdentityError
from ..keys import validate_workflow_id
from ..metrics import ClaimLossCause, ClaimMetrics
from ..options import MAX_CLAIM_TTL_MS
from ..storage.base import Storage
from .acquires import Acquires
from .arguments import dead_engines_arg, optional_epoch, positive_int, workflow_ids_arg
from .losses import LocalLosses
from .operation_gate import OperationGate
from .releases import RELEASE_ALL_CONCURRENCY as RELEASE_ALL_CONCURRENCY
from .releases import ReleasePreparation as ReleasePreparation
from .releases import Releases
from .renewals import DEFAULT_RENEW_CHUNK_SIZE as DEFAULT_RENEW_CHUNK_SIZE
from .renewals import Renewals, default_warn
from .renewals import WarnSink as WarnSink
from .results import (
    AcquirePreparation,
    AcquireResult,
    ReleaseResult,
    RenewResult,
    TakeoverResult,
)
from .rollback import describe_store, rollback_evidence
from .takeovers import DEFAULT_TAKEOVER_CHUNK_SIZE as DEFAULT_TAKEOVER_CHUNK_SIZE
from .takeovers import Takeovers
from .tracking import ClaimTable

_log = logging.getLogger(__name__)
_RESULTS_ONLY: Final = frozenset([RenewResult])


@process_bound_class
class ClaimRegistry:
    """Acquires, renews, releases and takes over per-workflow claims for one engine.

    No method raises on a lost compare-and-swap: contention is reported in the result. Storage
    errors propagate (``release_all`` excepted). In a child process that inherited the registry
    across ``os.fork()`` every method raises :class:`~weft_sync.errors.ClosedError`.

    :param storage: the shared store; it must declare the ``conditional_batch`` capability.
    :param engine_id: this engine's id, written into every holder record it creates.
    :param clock: milliseconds since the Unix epoch (wall time: holders are compared across hosts).
    :param claim_ttl_ms: how long a claim lives after each acquire, takeover or renewal; at most
        :data:`~weft_sync.options.MAX_CLAIM_TTL_MS` (365 days).
    :param claim_renew_interval_ms: how often claims are renewed; also the takeover grace unit and
        the cooldown window after this engine lost a claim.
    :param warn: receives a :class:`~weft_sync.errors.WorkflowClaimLostWarning` once per lost
        claim; default :func:`warnings.warn`.
    :param metrics: counts lost claims by cause (``weft_workflow_claims_lost_total``).
    :param judge_clock: the clock other holders' expiry is judged on (default: ``clock``); see
        :class:`~weft_sync.claims.store_clock.StoreClock`.

    Local renew deadline: a claim whose renewal fails when no renewal of it has succeeded for
    ``claim_ttl_ms - claim_renew_interval_ms`` (counted from the clock reading that started the
    last successful write of its holder) is lost locally with cause ``deadline``: it is dropped,
    reported once, and its renewal returns ``lost``; before the deadline a failed renewal only
    raises, and the next pass retries it. A :class:`~weft_sync.errors.StoreIdentityError` from
    any renewal or fenced write loses every claim locally (cause ``store_identity``); from then
    on acquire and takeover raise that error without touching the store.
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
        metrics: ClaimMetrics | None = None,
        judge_clock: Clock | None = None,
    ) -> None:
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"engine_id must be a non-empty str, got {engine_id!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning int milliseconds, got {clock!r}")
        if warn is not None and not callable(warn):
            raise TypeError(f"warn must be a callable taking a Warning, or None, got {warn!r}")
        if judge_clock is not None and not callable(judge_clock):
            raise TypeError(f"judge_clock must be a callable or None, got {judge_clock!r}")
        self._claim_ttl_ms = positive_int("claim_ttl_ms", claim_ttl_ms)
        if claim_ttl_ms > MAX_CLAIM_TTL_MS:
            raise ValueError(
                f"claim_ttl_ms ({claim_ttl_ms}) is longer than the supported maximum of "
                f"{MAX_CLAIM_TTL_MS}ms (365 days)"
            )
        self._renew_interval_ms = positive_int("claim_renew_interval_ms", claim_renew_interval_ms)
        self._storage = storage
        self._engine_id = engine_id
        self._fork_pid = os.getpid()  # see process_bound_class
        self._clock = clock
        # The table's lock is the registry's one lock (see the module docstring); the gate's
        # and the losses' own locks guard only their own state.
        self._table = ClaimTable(self._renew_interval_ms)
        self._epoch_of = _epoch_lookup(self._table)  # reads the table as it is at each call
        self._gate = OperationGate(engine_id)
        sink = warn if warn is not None else default_warn
        self._losses = LocalLosses(
            self._table, sink, engine_id, self._claim_ttl_ms - self._renew_interval_ms, metrics
        )
        self._renewals = Renewals(
            self._table,
            storage,
            clock,
            self._claim_ttl_ms,
            sink,
            engine_id,
            self._losses,
            self.lose_store,
        )
        self._releases = Releases(self._table, storage)
        self._acquires = Acquires(
            self._table,
            storage,
            clock,
            self._losses,
            self._releases,
            engine_id=engine_id,
            claim_ttl_ms=self._claim_ttl_ms,
        )
        self._takeovers = Takeovers(
            self._table,
            storage,
            clock,
            self._acquires.install,
            self._releases.give_back,
            engine_id=engine_id,
            claim_ttl_ms=self._claim_ttl_ms,
            renew_interval_ms=self._renew_interval_ms,
            judge_clock=judge_clock,
        )

    # -- read-only views -------------------------------------------------------------------

    @property
    def engine_id(self) -> str:
        """The engine id written into this registry's holder records."""
        return self._engine_id

    @property
    def storage(self) -> Storage:
        """The store this registry commits to."""
        return self._storage

    @property
    def clock(self) -> Clock:
        """The clock every claim time is read from (milliseconds since the Unix epoch)."""
        return self._clock

    @property
    def claim_ttl_ms(self) -> int:
        """How long a claim lives after each acquire, takeover or renewal."""
        return self._claim_ttl_ms

    @property
    def claim_renew_interval_ms(self) -> int:
        """The renew interval: takeover grace unit and cooldown window."""
        return self._renew_interval_ms

    @property
    def renew_deadline_ms(self) -> int:
        """The local renew deadline: how long a claim may go without a successful renewal."""
        return self._losses.deadline_ms

    def current_epoch(self, workflow_id: str) -> int | None:
        """The epoch this engine holds for ``workflow_id``, or ``None`` if it holds none."""
        entry = self._table.get(validate_workflow_id(workflow_id))
        return None if entry is None else entry.epoch

    def confirm_held(self, workflow_id: str, epoch: int) -> bool:
        """Whether this engine still holds ``workflow_id`` at ``epoch``, on local evidence only.

        No storage I/O. A claim with no successful renewal for :attr:`renew_deadline_ms` (its
        renewals failing, or hanging) is lost locally here, as a failed renewal would lose it:
        dropped, reported once with cause ``deadline``, and ``False`` returned.
        """
        wid = validate_workflow_id(workflow_id)
        now = self._clock()
        with self._table.lock:
            entry = self._table.claims.get(wid)
            if entry is None or entry.epoch != epoch:
                return False
            if now - entry.renewed_at < self._losses.deadline_ms:
                return True
        self._losses.lose_overdue(wid, entry, now)
        return False

    def current_epoch_bytes(self, workflow_id: str) -> bytes | None:
        """The exact epoch bytes this engine wrote for ``workflow_id`` (the fence), or ``None``.

        :raises TypeError: ``workflow_id`` is not a ``str``.
        :raises ValueError: ``workflow_id`` cannot name a workflow.
        """
        return self._epoch_of(workflow_id)

    def epoch_lookup(self) -> Callable[[str], bytes | None]:
        """:meth:`current_epoch_bytes` as a function that does not check the calling process,
        for a caller that checks it itself on every call (``Ownership.fenced``): on the path of
        every fenced host write, that saves a system call."""
        return self._epoch_of

    def tracked_expires_at(self, workflow_id: str) -> int | None:
        """The expiry of the holder record this engine last confirmed for ``workflow_id``.

        ``None`` when it holds no claim on it (or the cached record does not decode).
        """
        entry = self._table.get(validate_workflow_id(workflow_id))
        holder = None if entry is None else decode_holder(entry.holder_bytes)
        return None if holder is None else holder.expires_at

    def list_held_workflow_ids(self) -> list[str]:
        """A snapshot of the workflow ids this engine tracks as held."""
        with self._table.lock:
            return list(self._table.claims)

    # -- acquire and folded acquire --------------------------------------------------------

    def acquire(self, workflow_id: str) -> AcquireResult:
        """Claim a workflow nobody holds; never steals a present holder, however old.

        :returns: ``acquired`` with the new epoch, or ``lost-race`` with the holder's engine id
            (``None`` when there is no readable holder).
        :raises CorruptEpochError: the epoch key is corrupt (nothing is written; see
            :func:`~weft_sync.claims.epochs.repair_corrupt_epoch`).
        """
        wid = validate_workflow_id(workflow_id)
        with self.operation("acquire()"):
            return self._acquires.acquire(wid)

    def prepare_acquire_fragment(self, workflow_id: str) -> AcquirePreparation:
        """Build an acquire fragment for the caller to fold into its own atomic write.

        Reads the epoch afresh on every call, so it is safe to call again on each retry. Commits
        nothing and tracks nothing: call :meth:`record_folded_acquire` after the caller's write
        (which must include every condition and operation of the fragment) committed.
        """
        return self._acquires.prepare(validate_workflow_id(workflow_id))

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
        self._acquires.record_folded(wid, preparation)

    # -- renewal ---------------------------------------------------------------------------

    def renew(self, workflow_id: str) -> RenewResult:
        """Extend this engine's claim on ``workflow_id``.

        Concurrent calls for one workflow share one renewal and receive the identical result
        object (or the identical exception). When the holder is no longer the one this engine
        last confirmed, but is the value of an earlier renewal whose commit raised (it landed
        all the same), that value is adopted and the renewal retried once from it.

        :returns: ``renewed``; ``lost`` when another writer replaced the holder (the local entry is
            dropped, the takeover cooldown starts and one
            :class:`~weft_sync.errors.WorkflowClaimLostWarning` is emitted); ``not-held`` when the
            workflow is not tracked or is being released; ``lost`` with cause ``deadline``
            when the commit failed past the local renew deadline (dropped, cooldown started and
            reported once, as above).
        :raises StorageError: the commit failed before the deadline; the claim stays tracked
            and nothing is emitted. A :class:`~weft_sync.errors.StoreIdentityError` is raised
            after every claim was lost locally.
        """
        return self._renewals.renew(validate_workflow_id(workflow_id))

    def renew_many(
        self, workflow_ids: Iterable[str], *, chunk_size: int = DEFAULT_RENEW_CHUNK_SIZE
    ) -> list[RenewResult]:
        """Renew many claims in a few transactions, one per chunk of ``chunk_size`` claims.

        Each id gets the outcome :meth:`renew` would give it, positionally; a repeated id is
        renewed once and its result object appears at each of its positions.

        :raises TypeError: ``workflow_ids`` is a ``str`` or ``bytes`` rather than ids.
        :raises StorageError: a chunk failed to commit. Every chunk is attempted first; the error
            raised is the first failure in input order (which may also be an exception the
            ``warn`` sink raised). :meth:`renew_many_outcomes` reports failures per id instead.
        """
        outcomes = self.renew_many_outcomes(workflow_ids, chunk_size=chunk_size)
        if set(map(type, outcomes)) <= _RESULTS_ONLY:  # checked in bulk: usually no error
            return cast("list[RenewResult]", outcomes)
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
        return cast("list[RenewResult]", outcomes)

    def renew_many_outcomes(
        self, workflow_ids: Iterable[str], *, chunk_size: int = DEFAULT_RENEW_CHUNK_SIZE
    ) -> list[RenewResult | Exception]:
        """Like :meth:`renew_many`, but report a failed renewal as its exception, in place.

        A storage error fails only the ids of the chunk whose commit raised (or the single id
        whose re-read or retry after an ambiguous earlier commit raised); an exception the
        ``warn`` sink raises while reporting a lost claim replaces only that id's ``lost`` result
        (the claim is dropped all the same), as :meth:`renew` would raise it. Ids whose renewal
        another caller already has in flight wait for that renewal; the renewals this call
        starts are shared the same way with concurrent callers.

        :raises TypeError: ``workflow_ids`` is a ``str`` or ``bytes`` rather than ids.
        """
        # Membership alone is read without the lock: a dict lookup is atomic, and an id that was
        # ever tracked is known to be valid whether or not it still is.
        ids = workflow_ids_arg(workflow_ids, self._table.claims)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        return self._renewals.renew_many_outcomes(ids, chunk_size)

    # -- release ---------------------------------------------------------------------------

    def release(self, workflow_id: str, expected_epoch: int | None = None) -> ReleaseResult:
        """Give up this engine's claim: delete the holder if epoch and holder are still ours.

        Renewals that start while the release runs return ``not-held``; a renewal already in
        flight is waited for first (its error is ignored). The epoch key is kept. When the
        holder condition fails but the holder is the value of an earlier renewal whose commit
        raised (it landed all the same), the release is retried from that value.

        :param expected_epoch: release only if the tracked epoch equals this one; otherwise
            return ``not-held`` without writing (protects a newer generation of the same id).
        :returns: ``released``; ``lost-race`` when the claim had already moved on (the local entry
            is dropped either way); ``not-held`` when nothing matching is tracked.
        :raises StorageError: the commit failed; the local entry is dropped all the same, so the
            renewal task does not keep renewing a claim the caller meant to give up.
        """
        wid = validate_workflow_id(workflow_id)
        return self._releases.release(wid, optional_epoch(expected_epoch))

    def prepare_release_fragment(
        self, workflow_id: str, expected_epoch: int | None = None, *, wait: bool = True
    ) -> ReleasePreparation | None:
        """Build a release fragment for the caller to fold into its own atomic write.

        Marks the workflow releasing (renewals return ``not-held`` from now on) after waiting
        for a renewal in flight, so the holder bytes the fragment names stay this engine's last
        write. Commits nothing. Every preparation must be ended by exactly one
        :meth:`finish_folded_release`, whether or not the caller's write committed.

        :param expected_epoch: prepare only if the tracked epoch equals this one.
        :param wait: wait for a renewal in flight (default). ``False`` is for a caller whose
            own open transaction that renewal may be waiting for (a release folded into a
            host's fenced SQLite transaction): the fragment then names the holder bytes known
            before that renewal, and the caller judges the holder itself.
        :returns: the preparation, or ``None`` (and no releasing mark) when the workflow is not
            held, or not at ``expected_epoch``.
        :raises StorageError: re-reading the holder after an ambiguous renewal failed.
        """
        wid = validate_workflow_id(workflow_id)
        return self._releases.prepare(wid, optional_epoch(expected_epoch), wait=wait)

    def finish_folded_release(
        self, workflow_id: str, preparation: ReleasePreparation, committed: bool
    ) -> None:
        """End a folded release: stop tracking the claim if the caller's write committed.

        Performs no I/O. The claim is dropped only if it is still the entry the preparation was
        built from (a newer generation survives); the releasing mark is cleared either way.
        Finishing the same preparation again does nothing.

        :param committed: whether the caller's write, including the whole fragment, committed.
        :raises TypeError: ``preparation`` is not from :meth:`prepare_release_fragment`.
        :raises ValueError: ``preparation`` was made for another workflow.
        """
        wid = validate_workflow_id(workflow_id)
        if not isinstance(preparation, ReleasePreparation):
            raise TypeError(
                f"preparation must come from prepare_release_fragment(), got {preparation!r:.80}"
            )
        if not isinstance(committed, bool):
            raise TypeError(f"committed must be a bool, got {committed!r}")
        self._releases.finish(wid, preparation, committed)

    def release_all(self, deadline: float | None = None) -> list[str]:
        """Release every held claim concurrently; swallow (and log) every failure. Never raises.

        See :meth:`Releases.release_all <weft_sync.claims.releases.Releases.release_all>`.

        :returns: the ids whose release failed: forgotten here, their holders left in the store.
        """
        held = self.list_held_workflow_ids()
        try:
            return self._releases.release_all(held, deadline)
        except Exception:
            _log.exception("releasing all claims failed")
            return held

    # -- closing ---------------------------------------------------------------------------

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called (new claim operations raise ``ClosedError``)."""
        return self._gate.closing

    def operation(self, what: str) -> AbstractContextManager[None]:
        """``with registry.operation(what):`` runs a claim-creating operation (the caller's,
        e.g. a folded acquire) as in flight.

        :meth:`close` waits for it before its final release, so what it claimed is released. A
        :class:`~weft_sync.errors.StoreIdentityError` leaving the block loses the store.

        :raises ClosedError: (on entering) :meth:`close` was called.
        """
        return _ClaimOperation(self, what)

    def close(self, timeout: float | None = None) -> list[str]:
        """Refuse new claims, wait for claim operations in flight, then release every claim.

        Waits up to ``timeout`` seconds (``None``: no bound) for operations running inside
        :meth:`operation` (acquire, takeover and the ledger's folded acquires); any claim one
        of them installs after the final release began is given back by that operation, which
        raises :class:`~weft_sync.errors.ClosedError`. The final release waits for renewals
        in flight by the same bound (see :meth:`release_all`). Idempotent; never raises.

        :returns: the ids this call could not release (their holders are left in the store).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._gate.close(timeout):
            _log.warning(
                "claim operations of engine %s were still running %s s into close(); a claim "
                "they make now is released by them",
                self._engine_id,
                timeout,
            )
        with self._table.lock:
            self._table.closed = True
        return self.release_all(deadline)

    # -- a replaced store ------------------------------------------------------------------

    def lose_store(self, error: StoreIdentityError) -> None:
        """Lose every claim locally because the store was replaced; refuse new claims on it.

        Logs one ERROR naming the store's location (the first time) and reports each claim
        with cause ``store_identity``. Never raises; warn-sink errors are logged.
        """
        self._losses.lose_store(error, self._clock())

    def loss_cause(self, workflow_id: str) -> ClaimLossCause | None:
        """Why this engine last lost its claim on ``workflow_id``, if that was recent.

        The last few thousand losses are remembered, so that a fenced write refused for a
        claim no longer held can say why (``EngineDeposedError.cause``).
        """
        return self._losses.cause_of(workflow_id)

    def lose_deposed(
        self,
        workflow_id: str,
        token: bytes,
        observed_token: bytes | None,
        observed_holder: bytes | None = None,
        *,
        judge: bool = True,
    ) -> bool:
        """A fenced write for ``workflow_id`` found the stored epoch is no longer ``token``.

        Drops the entry holding ``token`` (if it is still tracked) so that it is not renewed
        and reported lost a second time, and starts its takeover cooldown. When what the
        store holds instead shows it went back in time
        (:func:`~weft_sync.claims.rollback.rollback_evidence`), every claim is lost locally
        with cause ``store_rollback`` and reported (one warning each, through the warn sink);
        otherwise the caller reports the deposition.

        :param observed_token: the epoch key as read after the failed write (``None``: absent).
        :param observed_holder: the holder key, if the caller read it.
        :param judge: ``False`` when the caller does not know what the epoch key holds (no
            rollback judgement, an ordinary deposition).
        :returns: whether the caller still has to report the loss: ``True`` for an ordinary
            deposition of a claim tracked until now; ``False`` when nothing was tracked at
            ``token`` (the loss was reported already) or the rollback was reported here.
        """
        table = self._table
        now = self._clock()
        with table.lock:
            entry = table.claims.get(workflow_id)
            if entry is None or entry.epoch_bytes != token:
                return False
            del table.claims[workflow_id]
            table.cooldown.record_deposition(workflow_id, now)
        evidence = (
            None
            if not judge
            else rollback_evidence(
                engine_id=self._engine_id,
                held_token=token,
                held_holder=entry.holder_bytes if observed_holder is not None else None,
                observed_token=observed_token,
                observed_holder=observed_holder,
            )
        )
        if evidence is None:
            self._losses.remember((workflow_id,), "deposed")
            metrics = self._losses.metrics
            if metrics is not None:
                metrics.record_claims_lost("deposed")
            return True
        _, sink_errors = self._losses.lose_rolled_back(
            [workflow_id],
            describe_store(self._storage),
            f"workflow {workflow_id!r}: {evidence}",
            now,
        )
        for wid, exc in sink_errors.items():
            _log.warning("the warn sink raised reporting workflow %r lost: %r", wid, exc)
        return False

    def lose_all_locally(self, cause: ClaimLossCause) -> list[str]:
        """Drop every tracked claim without touching the store and report each with ``cause``.

        :returns: the ids dropped.
        """
        return self._losses.lose_all(cause, self._clock())

    def forget_local_claim(self, workflow_id: str, expected_epoch: int | None = None) -> None:
        """Drop the local entry for ``workflow_id`` without touching the store.

        For callers whose own commit already removed the durable holder (e.g. a suspend that
        rotated the epoch).

        :param expected_epoch: forget only if the tracked epoch equals this one, so a newer
            generation of the same id survives.
        """
        self._releases.forget(validate_workflow_id(workflow_id), optional_epoch(expected_epoch))

    # -- takeover --------------------------------------------------------------------------

    def takeover(self, workflow_id: str, *, dead_engines: Collection[str] = ()) -> TakeoverResult:
        """Take over a claim whose holder expired (or is unreadable), minting epoch + 1.

        Makes at most one compare-and-swap attempt; callers retry. Reads nothing while this
        engine's cooldown for the workflow (after it lost the claim) is active.

        :param dead_engines: engines known dead: a holder naming one is taken even before it
            expires (still conditioned on the exact holder and epoch bytes read), and the result
            says ``before_expiry``; this engine's own id is ignored. A mapping gives with each
            engine id the exact bytes of the engine record its death was judged on: its holder
            is then taken early only if that record, read after the holder, still has those
            bytes (an engine writes its record before its first claim, so a holder of an engine
            restarted under the same id is never taken early); otherwise it goes by its expiry.

        :returns: ``acquired`` with the new epoch; ``backoff-skipped`` during the cooldown;
            ``no-claim`` when there is no holder or no epoch; ``not-expired`` with the live
            holder's engine id and expiry; ``lost-race`` with the new holder's engine id.
        :raises CorruptEpochError: the holder is takeover-eligible but the epoch key is corrupt
            (nothing is written; :meth:`takeover_many` reports it as that id's outcome).
        """
        wid = validate_workflow_id(workflow_id)
        dead = dead_engines_arg(dead_engines)
        with self.operation("takeover()"):
            self._losses.refuse_lost_store()
            return self._takeovers.takeover(wid, dead)

    def takeover_many(
        self,
        workflow_ids: Iterable[str],
        *,
        chunk_size: int = DEFAULT_TAKEOVER_CHUNK_SIZE,
        dead_engines: Collection[str] = (),
    ) -> list[TakeoverResult | Exception]:
        """Like :meth:`takeover` for each id, reading and committing a chunk at a time.

        Each id gets the outcome :meth:`takeover` would give it (one compare-and-swap attempt;
        no retries), positionally; a repeated id is attempted once and its result appears at each
        of its positions. The clock is read once for the whole call (every holder is written
        from that reading), and once more after each chunk's commit (a commit that stalled
        renews what it wrote; see :mod:`~weft_sync.claims.takeovers`). Per chunk of ``chunk_size``
        ids, the holders and epochs are read with one ``get_many`` (a single snapshot where the
        store has one) and the takeovers committed with one ``conditional_batches``. A chunk
        whose read or commit raised reports that exception for each of its ids not yet decided,
        and the other chunks still run.

        :raises TypeError: ``workflow_ids`` is a ``str`` or ``bytes`` rather than ids.
        :raises ValueError: an invalid id, or ``chunk_size`` is not a positive int.
        """
        ids, dead = workflow_ids_arg(workflow_ids), dead_engines_arg(dead_engines)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        with self.operation("takeover_many()"):
            self._losses.refuse_lost_store()
            return self._takeovers.takeover_many(ids, chunk_size, dead)

    # -- fork ------------------------------------------------------------------------------

    def _after_fork_in_child(self) -> None:
        """Forget everything inherited through ``fork()``, with no storage I/O.

        The parent still owns those claims. A fresh lock replaces one a parent thread may have
        held at fork time; claims, in-flight renewals and releasing marks are emptied and the
        takeover cooldown starts afresh.
        """
        self._table.reset()
        self._gate.reset()
        self._losses.reset()

    def __repr__(self) -> str:
        with self._table.lock:
            held = len(self._table.claims)
        return f"ClaimRegistry(engine_id={self._engine_id!r}, held={held})"


def _epoch_lookup(table: ClaimTable) -> Callable[[str], bytes | None]:
    """The lookup of :meth:`ClaimRegistry.current_epoch_bytes` in ``table``."""

    def lookup(workflow_id: str) -> bytes | None:
        # Without table.lock: one dict lookup is atomic, and an entry's epoch_bytes never
        # changes (a takeover installs a new entry). An id found tracked was validated when it
        # was claimed, so only an id not found is validated (and refused when it is bad).
        if type(workflow_id) is str:
            entry = table.claims.get(workflow_id)
            if entry is not None:
                return entry.epoch_bytes
        validate_workflow_id(workflow_id)
        return None

    return lookup


class _ClaimOperation:
    """The ``with`` block of :meth:`ClaimRegistry.operation` (a class, not a generator: every
    acquire and takeover enters one)."""

    __slots__ = ("_inner", "_registry")

    def __init__(self, registry: ClaimRegistry, what: str) -> None:
        self._registry = registry
        self._inner = registry._gate.operation(what)

    def __enter__(self) -> None:
        self._inner.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if isinstance(exc, StoreIdentityError):
                self._registry.lose_store(exc)
        finally:
            self._inner.__exit__(exc_type, exc, tb)
