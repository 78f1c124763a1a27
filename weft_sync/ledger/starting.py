"""Claiming a workflow from the ledger: ``start`` (create + claim in one write) and ``resume``.

``start`` folds the registry's acquire fragment into the write that creates the record and its
status-index entry, so a workflow never exists unclaimed, nor a claim without its record. It is
conditioned on the record being absent; a failed write is read back to say why (the workflow
exists, another engine holds the id, or only the epoch moved under a concurrent purge, which is
prepared again).

``resume`` claims an existing running or suspended workflow on this engine (a suspended one runs
again), reusing a claim this engine still holds when the holder record confirms it.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from .. import keys
from ..claims.registry import ClaimRegistry
from ..clock import Clock
from ..codec import (
    WorkflowRecord,
    decode_holder,
    encode_workflow_record,
    try_decode_workflow_record,
)
from ..errors import FencedWriteConflict, WorkflowClaimUnavailableError, WorkflowExistsError
from ..metrics import ClaimMetrics
from ..storage.base import Condition, Delete, Operation, Put, Storage, storage_conditional_batch
from .fenced_writes import Fence, WakeCheckStatus, wake_ownership_check
from .finishing import SELF_MAX_ATTEMPTS
from .records import (
    WorkflowNotFoundError,
    WorkflowStateError,
    read_record,
    related_prefix,
    status_change_operations,
    with_status,
)

_log = logging.getLogger("weft_sync.workflows")

START_MAX_ATTEMPTS: Final = 3
"""Acquire folds ``start`` re-prepares when only the epoch moved (a concurrent purge)."""

RESUMABLE_STATUSES: Final = frozenset({"running", "suspended"})


class Starts:
    """``start`` and ``resume`` of one ledger; stateless apart from its collaborators.

    :param metrics: counts each claim acquired as an ``acquired`` attempt (optional).
    """

    def __init__(
        self, storage: Storage, fence: Fence, clock: Clock, metrics: ClaimMetrics | None
    ) -> None:
        self._storage = storage
        self._fence = fence
        self._clock = clock
        self._metrics = metrics

    def start(self, registry: ClaimRegistry, wid: str, type: str, input: Any) -> WorkflowRecord:
        """See :meth:`weft_sync.workflows.Workflows.start` (``wid`` and ``type`` are checked)."""
        now = self._clock()
        record = WorkflowRecord(wid, type, "running", input, now, now)
        record_bytes = encode_workflow_record(record)
        record_key = keys.workflow(wid)
        for _ in range(START_MAX_ATTEMPTS):
            existing = self._storage.get(record_key)
            if existing is not None:
                raise self._exists_error(wid, existing)
            leftovers = [Delete(key) for key, _ in self._storage.scan(related_prefix(wid))]
            prep = registry.prepare_acquire_fragment(wid)
            conditions = [Condition(record_key, None), *prep.fragment.conditions]
            operations: list[Operation] = [
                *leftovers,
                Put(record_key, record_bytes),
                Put(keys.workflow_status_index("running", wid), b""),
                *prep.fragment.operations,
            ]
            if storage_conditional_batch(self._storage, conditions, operations):
                registry.record_folded_acquire(wid, prep)
                self._count_acquired()
                _log.info("started workflow %r (%s) at epoch %d", wid, type, prep.epoch)
                return record
            existing = self._storage.get(record_key)
            if existing is not None:
                raise self._exists_error(wid, existing)
            holder = self._storage.get(keys.workflow_owner_holder(wid))
            if holder is not None:
                decoded = decode_holder(holder)
                held_by = None if decoded is None else decoded.engine_id
                # This engine's own claim() block holds the id: say so, not "retry later".
                held_here = (
                    held_by == registry.engine_id and registry.current_epoch(wid) is not None
                )
                raise WorkflowClaimUnavailableError(wid, held_by, held_here=held_here)
            _log.debug("start of workflow %r: only the epoch moved; preparing again", wid)
        raise WorkflowClaimUnavailableError(wid, None)

    def resume(self, registry: ClaimRegistry, wid: str) -> WorkflowRecord:
        """See :meth:`weft_sync.workflows.Workflows.resume` (``wid`` is checked)."""
        _raw, record = self._require_record(wid)
        if record.status not in RESUMABLE_STATUSES:
            raise WorkflowStateError(wid, record.status, "resume", RESUMABLE_STATUSES)
        epoch = self._acquire_standalone(registry, wid)
        try:
            return self._mark_running(wid)
        except (WorkflowStateError, WorkflowNotFoundError):
            # Finished or purged between the check and the acquire: give the claim back.
            registry.release(wid, expected_epoch=epoch)
            raise

    def _acquire_standalone(self, registry: ClaimRegistry, wid: str) -> int:
        epoch = registry.current_epoch(wid)
        if epoch is not None:
            check = wake_ownership_check(
                self._storage,
                wid,
                "signal",
                expected_engine_id=registry.engine_id,
                expected_epoch=epoch,
                warn=self._fence.warn,
            )
            if check.status is WakeCheckStatus.MATCH:
                return epoch
            if check.status is not WakeCheckStatus.HOLDER_ABSENT:
                raise WorkflowClaimUnavailableError(wid, check.observed_engine_id)
        result = registry.acquire(wid)
        if result.status != "acquired" or result.epoch is None:
            raise WorkflowClaimUnavailableError(wid, result.held_by)
        self._count_acquired()
        return result.epoch

    def _mark_running(self, wid: str) -> WorkflowRecord:
        for _ in range(SELF_MAX_ATTEMPTS):
            raw, record = self._require_record(wid)
            if record.status == "running":
                return record
            if record.status != "suspended":
                raise WorkflowStateError(wid, record.status, "resume", RESUMABLE_STATUSES)
            new = with_status(record, "running", self._clock())
            conditions, operations = status_change_operations(raw, record, new)
            if self._fence.commit(wid, conditions, operations):
                _log.info("resumed suspended workflow %r", wid)
                return new
        raise FencedWriteConflict(wid)

    def _require_record(self, wid: str) -> tuple[bytes, WorkflowRecord]:
        found = read_record(self._storage, wid)
        if found is None:
            raise WorkflowNotFoundError(wid)
        return found

    def _exists_error(self, wid: str, record_bytes: bytes) -> WorkflowExistsError:
        record = try_decode_workflow_record(record_bytes)
        status = "unreadable" if record is None else record.status
        holder = decode_holder(self._storage.get(keys.workflow_owner_holder(wid)))
        return WorkflowExistsError(wid, status, None if holder is None else holder.engine_id)

    def _count_acquired(self) -> None:
        if self._metrics is not None:
            self._metrics.record_claim_attempt("acquired")
