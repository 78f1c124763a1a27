"""Self transitions: ``complete`` and ``fail``, committed by the owner with its release folded in.

The final state (record, status-index entry, outcome) and the release of this engine's claim
(holder deleted, epoch kept) commit in ONE compare-and-swap (spec §1.3 step 4). It is conditioned
on the exact record bytes read and on the release fragment's conditions: the epoch key still
holds this engine's epoch bytes (the fence) and the holder key the bytes it last wrote. While the
release is prepared, renewals of the workflow return ``not-held``, so the holder bytes cannot
move under the write.

A failed CAS is read back: an epoch or holder that is no longer this engine's means it was
deposed; otherwise only the record changed, and the transition is retried from a fresh read.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from .. import keys
from ..claims.registry import ReleasePreparation
from ..claims.transitions import extract_put_value
from ..clock import Clock
from ..codec import WorkflowRecord
from ..errors import FencedWriteConflict
from ..storage.base import Condition, Operation, Put, Storage, storage_conditional_batch
from .fencing import Fence
from .records import (
    WorkflowNotFoundError,
    WorkflowStateError,
    pack_payload,
    read_record,
    result_key,
    status_change_operations,
    with_status,
)

__all__ = ["SELF_MAX_ATTEMPTS", "SelfTransitions"]

_log = logging.getLogger(__name__)

SELF_MAX_ATTEMPTS: Final = 5
"""CAS attempts of one self transition whose base condition (the record bytes) keeps failing."""

_RUNNING: Final = ("running",)


class SelfTransitions:
    """Commits ``complete``/``fail`` for the workflows this engine owns.

    :param storage: the shared store (the registry's own store).
    :param fence: gives the registry and reports a deposed engine.
    :param clock: stamps ``updated_at`` and ``finished_at``.
    """

    def __init__(self, storage: Storage, fence: Fence, clock: Clock) -> None:
        self._storage = storage
        self._fence = fence
        self._clock = clock

    def finish(
        self, wid: str, status: str, operation: str, fields: dict[str, Any]
    ) -> WorkflowRecord:
        """Move the running workflow to ``status`` and release its claim, in one write.

        :param operation: what the host called (``"complete"``/``"fail"``), for errors.
        :param fields: stored in the outcome record next to ``status`` and ``finished_at``.
        :raises EngineDeposedError: this engine no longer owns the workflow.
        :raises WorkflowStateError: the workflow is not running.
        :raises FencedWriteConflict: the record kept changing under the write.
        :raises ValueError: ``fields`` are not MessagePack-encodable.
        """
        registry = self._fence.registry()
        held_epoch = registry.current_epoch(wid)
        if held_epoch is None:
            self._fence.deposed(wid)
        finished_at = self._clock()
        outcome = pack_payload(
            f"the {operation} outcome of workflow {wid!r}",
            {"status": status, **fields, "finished_at": finished_at},
        )
        preparation = registry.prepare_release_fragment(wid, expected_epoch=held_epoch)
        if preparation is None:
            self._fence.deposed(wid)
        committed = False
        try:
            new = self._commit(wid, preparation, status, operation, finished_at, outcome)
            committed = True
        finally:
            registry.finish_folded_release(wid, preparation, committed)
        _log.info("workflow %r %s at epoch %d; claim released", wid, status, preparation.epoch)
        return new

    def _commit(
        self,
        wid: str,
        preparation: ReleasePreparation,
        status: str,
        operation: str,
        finished_at: int,
        outcome: bytes,
    ) -> WorkflowRecord:
        for _ in range(SELF_MAX_ATTEMPTS):
            found = read_record(self._storage, wid)
            if found is None:
                raise WorkflowNotFoundError(wid)
            raw, record = found
            if record.status != "running":
                raise WorkflowStateError(wid, record.status, operation, _RUNNING)
            new = with_status(record, status, finished_at)
            conditions, operations = status_change_operations(raw, record, new)
            operations.append(Put(result_key(wid), outcome))
            if self._commit_once(wid, preparation, conditions, operations):
                return new
            self._check_still_owner(wid, preparation)
            _log.debug("%s of workflow %r: the record changed; retrying", operation, wid)
        raise FencedWriteConflict(wid)

    def _commit_once(
        self,
        wid: str,
        preparation: ReleasePreparation,
        conditions: list[Condition],
        operations: list[Operation],
    ) -> bool:
        conditions = [*conditions, *preparation.fragment.conditions]
        operations = [*operations, *preparation.fragment.operations]
        try:
            return storage_conditional_batch(self._storage, conditions, operations)
        except Exception:
            # A commit can land although it raised (a connection lost during COMMIT).
            if self._landed(wid, preparation, operations):
                _log.info("the final write of workflow %r raised but had committed", wid)
                return True
            raise

    def _landed(
        self, wid: str, preparation: ReleasePreparation, operations: list[Operation]
    ) -> bool:
        """Whether the store shows what this write leaves: its record, the same epoch, no holder.

        A store that cannot be read counts as not landed.
        """
        record_key = keys.workflow(wid)
        record_bytes = extract_put_value(operations, record_key)
        try:
            return (
                self._storage.get(record_key) == record_bytes
                and self._storage.get(keys.workflow_owner_epoch(wid)) == preparation.epoch_bytes
                and self._storage.get(keys.workflow_owner_holder(wid)) is None
            )
        except Exception:
            _log.debug("could not read back the final write of workflow %r", wid, exc_info=True)
            return False

    def _check_still_owner(self, wid: str, preparation: ReleasePreparation) -> None:
        """After a failed CAS: raise ``EngineDeposedError`` unless epoch and holder are ours."""
        try:
            epoch = self._storage.get(keys.workflow_owner_epoch(wid))
            holder = self._storage.get(keys.workflow_owner_holder(wid))
        except Exception as exc:
            # Unable to prove the claim still holds: fail closed.
            self._fence.deposed(wid, exc)
        if epoch != preparation.epoch_bytes or holder != preparation.holder_bytes:
            self._fence.deposed(wid)
