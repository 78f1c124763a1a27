"""Claim acquire: committed on its own, or folded into the caller's own write; and tracking.

An acquire claims a workflow that has no holder record (a present holder, however old, is only
ever replaced by a takeover), minting epoch + 1 conditioned on the holder being absent and on the
exact epoch bytes read. The same batch adds the claim's by-engine entry
(see :mod:`~weft_sync.claims.engine_index`). Read and write are one transaction where the store
can (:mod:`~weft_sync.storage.read_then_write`), else a read and a compare-and-swap. A folded
acquire hands that batch to the caller, who commits it inside its own write and then has it
tracked with :meth:`Acquires.record_folded`.

:meth:`Acquires.install` is the one place a committed claim, acquired or taken over, starts to
be tracked: from the exact bytes its fragment put, so later compare-and-swaps name them. The
claim table's lock (the registry's one lock) guards what it installs; nothing here holds it
across storage I/O or logging.
"""

from __future__ import annotations

import logging

from .. import keys
from ..clock import Clock
from ..codec import decode_epoch, decode_holder
from ..errors import ClosedError, CorruptEpochError
from ..storage.base import Storage
from ..storage.read_then_write import Decision, storage_read_then_write
from .engine_index import with_claim_entry
from .losses import LocalLosses
from .releases import Releases
from .results import AcquirePreparation, AcquireResult, AcquireStatus
from .tracking import ClaimTable, TrackedClaim
from .transitions import Fragment, build_acquire_transition, extract_put_value

# Logs under the registry's logger: one logger names every claim operation of the registry.
_log = logging.getLogger("weft_sync.claims.registry")


class Acquires:
    """The registry's acquire part; ids reaching it are already validated.

    :param table: the registry's tracking state.
    :param storage: the shared store.
    :param clock: the registry's clock.
    :param losses: refuses new claims once the store was replaced.
    :param releases: gives back a claim committed after the registry closed.
    :param engine_id: written into the new holder records.
    :param claim_ttl_ms: the new holder's ``expires_at`` is the acquire's clock reading plus this.
    """

    def __init__(
        self,
        table: ClaimTable,
        storage: Storage,
        clock: Clock,
        losses: LocalLosses,
        releases: Releases,
        *,
        engine_id: str,
        claim_ttl_ms: int,
    ) -> None:
        self._table = table
        self._storage = storage
        self._clock = clock
        self._losses = losses
        self._releases = releases
        self._engine_id = engine_id
        self._claim_ttl_ms = claim_ttl_ms

    def acquire(self, wid: str) -> AcquireResult:
        """See :meth:`ClaimRegistry.acquire <weft_sync.claims.registry.ClaimRegistry.acquire>`."""
        self._losses.refuse_lost_store()
        holder_key = keys.workflow_owner_holder(wid)
        epoch_key = keys.workflow_owner_epoch(wid)
        now = self._clock()
        built: list[Fragment] = []

        def decide(values: list[bytes | None]) -> Decision | None:
            # Runs inside the store's write transaction: no I/O, no logging.
            observed_holder, observed_epoch = values
            if observed_holder is not None:
                return None  # held, however old: only a takeover replaces it
            fragment = self._acquire_fragment(wid, now, observed_epoch)
            built.append(fragment)
            return fragment.conditions, fragment.operations

        try:
            (observed_holder, _), committed = storage_read_then_write(
                self._storage, [holder_key, epoch_key], decide
            )
        except CorruptEpochError as exc:
            _log.warning("%s", exc)
            raise
        if not committed:
            held_by = self._held_by(holder_key, observed_holder)
            _log.debug("acquire of workflow %r lost the race (held by %r)", wid, held_by)
            return AcquireResult(AcquireStatus.LOST_RACE, wid, held_by=held_by)
        fragment = built[-1]
        epoch, token = self._install(wid, fragment, now, epoch_key, holder_key)
        _log.info("engine %s acquired workflow %r at epoch %d", self._engine_id, wid, epoch)
        return AcquireResult(AcquireStatus.ACQUIRED, wid, epoch=epoch, token=token)

    def prepare(self, wid: str) -> AcquirePreparation:
        """See :meth:`ClaimRegistry.prepare_acquire_fragment
        <weft_sync.claims.registry.ClaimRegistry.prepare_acquire_fragment>`.
        """
        self._losses.refuse_lost_store()
        observed_epoch = self._storage.get(keys.workflow_owner_epoch(wid))
        now = self._clock()
        try:
            fragment = self._acquire_fragment(wid, now, observed_epoch)
        except CorruptEpochError as exc:
            _log.warning("%s", exc)
            raise
        epoch = decode_epoch(extract_put_value(fragment.operations, keys.workflow_owner_epoch(wid)))
        assert epoch is not None  # the fragment was just encoded from a valid epoch
        _log.debug("prepared an acquire fragment for workflow %r at epoch %d", wid, epoch)
        return AcquirePreparation(fragment=fragment, epoch=epoch, claimed_at=now)

    def record_folded(self, wid: str, preparation: AcquirePreparation) -> None:
        """See :meth:`ClaimRegistry.record_folded_acquire
        <weft_sync.claims.registry.ClaimRegistry.record_folded_acquire>`.
        """
        self.install(wid, preparation.fragment, preparation.claimed_at)
        _log.info(
            "engine %s acquired workflow %r at epoch %d (folded into the caller's write)",
            self._engine_id,
            wid,
            preparation.epoch,
        )

    def install(self, wid: str, fragment: Fragment, claimed_at: int) -> int:
        """Track the claim ``fragment`` wrote, from its exact put values; return its epoch.

        :raises ClosedError: the registry closed meanwhile; the claim was given back.
        """
        holder_key = keys.workflow_owner_holder(wid)
        epoch, _ = self._install(
            wid, fragment, claimed_at, keys.workflow_owner_epoch(wid), holder_key
        )
        return epoch

    def _install(
        self, wid: str, fragment: Fragment, claimed_at: int, epoch_key: str, holder_key: str
    ) -> tuple[int, bytes]:
        """:meth:`install` with the workflow's keys at hand; also return the token put."""
        epoch_bytes = extract_put_value(fragment.operations, epoch_key)
        holder_bytes = extract_put_value(fragment.operations, holder_key)
        epoch = decode_epoch(epoch_bytes)
        if epoch is None:
            raise ValueError(f"the fragment for workflow {wid!r} puts an invalid epoch")
        entry = TrackedClaim(epoch, claimed_at, epoch_bytes, holder_bytes, holder_key)
        if not self._table.install(wid, entry):
            self._releases.give_back(wid, epoch_bytes, holder_bytes)
            raise ClosedError(
                f"the claim registry of engine {self._engine_id} closed while workflow {wid!r} "
                f"was being claimed; the claim was released again"
            )
        return epoch, epoch_bytes

    def _acquire_fragment(self, wid: str, now: int, observed_epoch: bytes | None) -> Fragment:
        """The acquire's batch, by-engine entry included.

        :raises CorruptEpochError: the observed epoch bytes do not decode.
        """
        fragment = build_acquire_transition(
            workflow_id=wid,
            engine_id=self._engine_id,
            now=now,
            claim_ttl_ms=self._claim_ttl_ms,
            observed_epoch_bytes=observed_epoch,
        )
        return with_claim_entry(fragment, wid, self._engine_id, None)

    def _held_by(self, holder_key: str, observed: bytes | None) -> str | None:
        """The engine id in ``observed`` holder bytes, or in a fresh read when none were seen."""
        raw = observed if observed is not None else self._storage.get(holder_key)
        holder = decode_holder(raw)
        return None if holder is None else holder.engine_id
