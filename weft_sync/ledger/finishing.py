"""Self transitions: ``complete`` and ``fail``, committed by the owner with its release folded in.

The final state (record, status-index entry, outcome) and the release of this engine's claim
(holder deleted, epoch kept) commit in ONE compare-and-swap (spec §1.3 step 4). It is conditioned
on the exact record bytes read and on the release fragment's conditions: the epoch key still
holds this engine's epoch bytes (the fence) and the holder key the bytes it last wrote. While the
release is prepared, renewals of the workflow return ``not-held``, so the holder bytes cannot
move under the write.

A failed CAS is read back: an epoch or holder that is no longer this engine's means it was
deposed; otherwise only the record changed, and the transition is retried from a fresh read.

Inside a fenced block on the store's own database (``Ownership.fenced(workflow_id, conn)``,
Django's ``fenced_atomic``), the same write is made through the host's transaction instead
(:class:`HostWrites`): the epoch, holder and record are read there (row-locked on PostgreSQL; the
block holds SQLite's write lock) and judged, and the final state and the release are written
there, so they commit — or roll back — with the host's own rows. The claim is forgotten locally
when the host's transaction commits; a rollback leaves it held (renewals resume).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final, NoReturn, Protocol

from .. import keys
from ..claims.registry import ReleasePreparation
from ..claims.transitions import extract_put_value
from ..clock import Clock
from ..codec import WorkflowRecord, decode_epoch, decode_holder, decode_workflow_record
from ..errors import FencedWriteConflict
from ..storage.base import Condition, Delete, Operation, Put, Storage, storage_conditional_batch
from .fenced_writes import Fence
from .records import (
    WorkflowNotFoundError,
    WorkflowStateError,
    pack_payload,
    read_record,
    result_key,
    status_change_operations,
    with_status,
)

_log = logging.getLogger(__name__)

SELF_MAX_ATTEMPTS: Final = 5
"""CAS attempts of one self transition whose base condition (the record bytes) keeps failing."""

_RUNNING: Final = ("running",)


class HostWrites(Protocol):
    """The store's table seen through a host transaction a fenced block holds open."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def on_end(self, hook: Callable[[bool], None]) -> None: ...


HostWritesLookup = Callable[[str], "HostWrites | None"]
"""``workflow_id -> writes`` of a fenced block open on this thread for it, or ``None``."""


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
        self.host_writes: HostWritesLookup | None = None

    def finish(
        self, wid: str, status: str, operation: str, fields: dict[str, Any]
    ) -> WorkflowRecord:
        """Move the running workflow to ``status`` and release its claim, in one write.

        :param operation: what the host called (``"complete"``/``"fail"``), for errors.
        :param fields: stored in the outcome record next to ``status`` and ``finished_at``.
        :raises EngineDeposedError: this engine no longer owns the workflow, whatever its status.
        :raises WorkflowStateError: the workflow is not running and this engine still holds it.
        :raises FencedWriteConflict: the record kept changing under the write.
        :raises ValueError: ``fields`` are not MessagePack-encodable.
        """
        registry = self._fence.registry()
        held = registry.current_epoch_bytes(wid)
        if held is None:
            # Not held: a loss is reported when it happens (renewal, fence), not again here.
            self._fence.fence_bytes(wid)
        self._fence.check_drive(wid, held)
        held_epoch = None if held is None else decode_epoch(held)
        finished_at = self._clock()
        outcome = pack_payload(
            f"the {operation} outcome of workflow {wid!r}",
            {"status": status, **fields, "finished_at": finished_at},
        )
        lookup = self.host_writes
        host = None if lookup is None else lookup(wid)
        # In a host's transaction a renewal of this claim may be waiting for that very
        # transaction's lock (SQLite): do not wait for it, judge the holder as read there.
        preparation = registry.prepare_release_fragment(
            wid, expected_epoch=held_epoch, wait=host is None
        )
        if preparation is None:
            self._fence.fence_bytes(wid)  # lost meanwhile: raises, naming the loss's cause
            self._fence.deposed(wid)  # held at another epoch now: refused as deposed
        if host is not None:
            return self._finish_in_host(
                host, wid, preparation, status, operation, finished_at, outcome
            )
        committed = False
        try:
            new = self._commit(wid, preparation, status, operation, finished_at, outcome)
            committed = True
        finally:
            registry.finish_folded_release(wid, preparation, committed)
        _log.info("workflow %r %s at epoch %d; claim released", wid, status, preparation.epoch)
        return new

    def _finish_in_host(
        self,
        host: HostWrites,
        wid: str,
        preparation: ReleasePreparation,
        status: str,
        operation: str,
        finished_at: int,
        outcome: bytes,
    ) -> WorkflowRecord:
        """The final write through the host's fenced transaction; released when it commits."""
        registry = self._fence.registry()
        try:
            # Epoch and holder first: deposed comes before any state. The holder may be newer
            # than the bytes the preparation knows (a renewal that committed meanwhile); it
            # must still be this engine's at this epoch.
            holder_key = keys.workflow_owner_holder(wid)
            for condition in preparation.fragment.conditions:
                found = host.get(condition.key)
                if found == condition.expected:
                    continue
                holder = decode_holder(found) if condition.key == holder_key else None
                if (
                    holder is None
                    or holder.engine_id != registry.engine_id
                    or holder.epoch != preparation.epoch
                ):
                    self._lost(
                        wid,
                        preparation,
                        host.get(keys.workflow_owner_epoch(wid)),
                        host.get(holder_key),
                    )
            raw = host.get(keys.workflow(wid))
            if raw is None:
                raise WorkflowNotFoundError(wid)
            record = decode_workflow_record(raw)
            if record.status != "running":
                raise WorkflowStateError(wid, record.status, operation, _RUNNING)
            new = with_status(record, status, finished_at)
            _, operations = status_change_operations(raw, record, new)
            operations.append(Put(result_key(wid), outcome))
            for op in [*operations, *preparation.fragment.operations]:
                if isinstance(op, Delete):
                    host.delete(op.key)
                else:
                    host.put(op.key, op.value)
        except BaseException:
            registry.finish_folded_release(wid, preparation, False)
            raise

        def ended(committed: bool) -> None:
            registry.finish_folded_release(wid, preparation, committed)
            if committed:
                _log.info(
                    "workflow %r %s at epoch %d with the host's transaction; claim released",
                    wid,
                    status,
                    preparation.epoch,
                )

        host.on_end(ended)
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
                # Deposed comes first here too: a record gone with the claim (a store restored
                # from before the workflow started) is a claim this engine lost.
                self._check_still_owner(wid, preparation)
                raise WorkflowNotFoundError(wid)
            raw, record = found
            if record.status != "running":
                # Deposed comes first: a workflow cancelled (epoch rotated) or finished by its
                # new owner is, to this engine, a claim it lost.
                self._check_still_owner(wid, preparation)
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
            self._lost(wid, preparation, epoch, holder)

    def _lost(
        self,
        wid: str,
        preparation: ReleasePreparation,
        observed_token: bytes | None,
        observed_holder: bytes | None,
    ) -> NoReturn:
        """The claim is proven not this engine's: drop it from the registry (so its renewal
        does not report it a second time; a store that went back in time loses every claim,
        cause ``store_rollback``) and raise ``EngineDeposedError`` naming the cause."""
        registry = self._fence.registry()
        report = registry.lose_deposed(
            wid, preparation.epoch_bytes, observed_token, observed_holder
        )
        why = "deposed" if report else (registry.loss_cause(wid) or "deposed")
        self._fence.deposed(wid, why=why, report=report)
