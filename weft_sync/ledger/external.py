"""External transitions: cancel, timeout, suspend and purge, committed by any process.

Each folds an epoch rotation (spec §4.5: epoch + 1, holder deleted) into the same compare-and-swap
as the state change, conditioned on the exact record bytes read and the exact epoch bytes read. A
running owner anywhere is deposed by that write: its next fenced write fails and its next renewal
reports the claim lost. A lost precondition is retried from fresh reads a bounded number of times.
"""

from __future__ import annotations

import logging
from typing import Final

from .. import keys
from ..claims.engine_index import release_entry_ops
from ..claims.transitions import build_external_rotation_transition, extract_put_value
from ..clock import Clock
from ..codec import WORKFLOW_STATUSES, WorkflowRecord, try_decode_workflow_record
from ..errors import CorruptEpochError
from ..storage.base import Condition, Delete, Operation, Storage, storage_conditional_batch
from ..storage.reads import storage_get_many
from .fenced_writes import Fence
from .records import (
    ACTIVE_STATUSES,
    ExternalCommitConflictError,
    WorkflowNotFoundError,
    WorkflowStateError,
    read_record,
    related_prefix,
    status_change_operations,
    with_status,
)
from .signals import SignalBuffer
from .updates import UpdateQueue

_log = logging.getLogger(__name__)

EXTERNAL_MAX_ATTEMPTS: Final = 5
"""CAS attempts of one external transition before it reports a lost precondition."""

SUSPENDABLE_STATUSES: Final = frozenset({"pending", "running"})


class ExternalTransitions:
    """Commits external transitions and tidies this engine's local state after them.

    :param storage: the shared store.
    :param fence: gives the registry (when bound) whose stale local entry is dropped.
    :param signals: its waiters of the workflow are woken to notice the change.
    :param updates: its handler of a finished workflow is dropped.
    :param clock: stamps ``updated_at``.
    """

    def __init__(
        self,
        storage: Storage,
        fence: Fence,
        signals: SignalBuffer,
        updates: UpdateQueue,
        clock: Clock,
    ) -> None:
        self._storage = storage
        self._fence = fence
        self._signals = signals
        self._updates = updates
        self._clock = clock

    def transition(
        self, workflow_id: str, operation: str, status: str, allowed: frozenset[str]
    ) -> WorkflowRecord:
        """Move the workflow from one of ``allowed`` to ``status``, deposing its owner.

        :raises WorkflowNotFoundError: no such workflow.
        :raises WorkflowStateError: its status is not in ``allowed``.
        :raises ExternalCommitConflictError: the record or epoch kept changing under it.
        """
        for _ in range(EXTERNAL_MAX_ATTEMPTS):
            found = read_record(self._storage, workflow_id)
            if found is None:
                raise WorkflowNotFoundError(workflow_id)
            raw, record = found
            if record.status not in allowed:
                raise WorkflowStateError(workflow_id, record.status, operation, allowed)
            new = with_status(record, status, self._clock())
            conditions, operations = status_change_operations(raw, record, new)
            if self._commit_rotating(workflow_id, conditions, operations) is not None:
                _log.info("workflow %r %s by an external %s", workflow_id, status, operation)
                if status not in ACTIVE_STATUSES:
                    self._updates.forget(workflow_id)
                return new
        raise ExternalCommitConflictError(workflow_id, operation, EXTERNAL_MAX_ATTEMPTS)

    def purge(self, workflow_id: str) -> None:
        """Delete the record, every index entry and every related record; rotate the epoch.

        :raises WorkflowNotFoundError: no such workflow.
        :raises ExternalCommitConflictError: the record or epoch kept changing under it.
        """
        record_key = keys.workflow(workflow_id)
        for _ in range(EXTERNAL_MAX_ATTEMPTS):
            raw = self._storage.get(record_key)
            if raw is None:
                raise WorkflowNotFoundError(workflow_id)
            # A corrupt record has no readable status: delete the entry of every status.
            record = try_decode_workflow_record(raw)
            statuses = set(WORKFLOW_STATUSES) | ({record.status} if record else set())
            operations: list[Operation] = [Delete(record_key)]
            operations += [
                Delete(keys.workflow_status_index(s, workflow_id)) for s in sorted(statuses)
            ]
            related = self._storage.scan(related_prefix(workflow_id))
            operations += [Delete(key) for key, _ in related]
            minted = self._commit_rotating(workflow_id, [Condition(record_key, raw)], operations)
            if minted is not None:
                _log.info("purged workflow %r", workflow_id)
                self._updates.forget(workflow_id)
                self._sweep_after_purge(workflow_id, minted)
                return
        raise ExternalCommitConflictError(workflow_id, "purge", EXTERNAL_MAX_ATTEMPTS)

    def _commit_rotating(
        self, wid: str, conditions: list[Condition], operations: list[Operation]
    ) -> bytes | None:
        """Commit with the epoch rotation folded in; return the minted epoch bytes, or ``None``."""
        registry = self._fence.optional_registry()
        held_before = None if registry is None else registry.current_epoch(wid)
        epoch_key = keys.workflow_owner_epoch(wid)
        # Epoch first, then holder (one snapshot where the store has one): the rotation commits
        # only if the epoch never moved since, and a holder's engine changes only with its epoch,
        # so the holder read names the engine whose by-engine entry goes (or is gone, entry too).
        observed_epoch, holder_bytes = storage_get_many(
            self._storage, [epoch_key, keys.workflow_owner_holder(wid)]
        )
        try:
            rotation = build_external_rotation_transition(
                workflow_id=wid, observed_epoch_bytes=observed_epoch
            )
        except CorruptEpochError as exc:
            _log.warning("%s", exc)
            raise
        if not storage_conditional_batch(
            self._storage,
            [*conditions, *rotation.conditions],
            [*operations, *rotation.operations, *release_entry_ops(wid, holder_bytes)],
        ):
            _log.debug("external commit for workflow %r lost its precondition; retrying", wid)
            return None
        # This engine's own entry is stale now; drop it unless a newer generation replaced it.
        if registry is not None and held_before is not None:
            registry.forget_local_claim(wid, expected_epoch=held_before)
        self._signals.notify_all(wid)
        return extract_put_value(rotation.operations, epoch_key)

    def _sweep_after_purge(self, wid: str, minted: bytes) -> None:
        # A signal or update committed between the purge's scan and its write survives it. None
        # can commit afterwards (their writes need the record), so one sweep, conditioned on the
        # record still being absent at the purge's epoch, removes them all.
        try:
            leftovers = [Delete(key) for key, _ in self._storage.scan(related_prefix(wid))]
            if leftovers:
                storage_conditional_batch(
                    self._storage,
                    [
                        Condition(keys.workflow(wid), None),
                        Condition(keys.workflow_owner_epoch(wid), minted),
                    ],
                    leftovers,
                )
        except Exception:
            _log.warning("could not sweep leftovers of purged workflow %r", wid, exc_info=True)
