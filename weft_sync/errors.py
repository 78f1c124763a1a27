"""Exceptions and warnings raised by weft_sync.

Expected contention (a lost race, a claim held elsewhere) is reported as a result value, never as
an exception. Exceptions are reserved for misuse, infrastructure failure and use after close.
"""

from __future__ import annotations

__all__ = [
    "ClosedError",
    "CorruptEpochError",
    "EpochExhaustedError",
    "CorruptOwnershipMarkerError",
    "EngineDeposedError",
    "FencedWriteConflict",
    "MissingStoreError",
    "OwnershipModeMismatchError",
    "ReadOnlyStorageError",
    "StorageCapabilityError",
    "StorageError",
    "StoreIdentityError",
    "WeftError",
    "WorkflowClaimLostError",
    "WorkflowClaimLostWarning",
    "WorkflowClaimUnavailableError",
    "WorkflowExistsError",
    "WorkflowWakeDiscardedWarning",
]


class WeftError(Exception):
    """Base class of every exception weft_sync raises on purpose."""


class StorageError(WeftError):
    """A storage backend failed; the driver's exception is kept as ``__cause__``."""


class ReadOnlyStorageError(StorageError):
    """A write was attempted on a store opened read-only (``open_storage(url, read_only=True)``)."""


class MissingStoreError(StorageError):
    """A store opened read-only does not exist (no SQLite file or no table); none was created."""


class StoreIdentityError(StorageError):
    """The store this engine opened is no longer the one at its location.

    Raised when a SQLite file was deleted, replaced or lost its write-ahead log under a running
    engine (or a store's identity record changed). The engine stops writing to it: every claim it
    held is lost locally, because another process may now see a different store at that path.
    Also raised by an open that refuses a file with more than one name (``at_open``): nothing
    was opened, and no claim is affected.

    :param location: the path (or redacted URL) of the store.
    :param detail: what changed, e.g. ``"the file was replaced (inode 12 -> 57)"``.
    :param at_open: the store was refused as it opened, not changed under a running engine.
    """

    def __init__(self, location: str, detail: str, *, at_open: bool = False) -> None:
        self.location = location
        self.detail = detail
        self.at_open = at_open
        if at_open:
            super().__init__(f"the store at {location} cannot be opened: {detail}")
            return
        super().__init__(
            f"the store at {location} is no longer the one this engine opened: {detail}; "
            f"every claim held on it is treated as lost"
        )


class ClosedError(WeftError):
    """An object was used after ``close()``."""


class StorageCapabilityError(WeftError):
    """A feature needs a capability the storage backend does not declare.

    :param feature: what was being set up, e.g. ``"ownership: 'workflow-lease'"``.
    :param capability: the missing capability, e.g. ``"conditional_batch"``.
    :param detail: optional extra sentence for the message.
    """

    def __init__(self, feature: str, capability: str, detail: str | None = None) -> None:
        self.feature = feature
        self.capability = capability
        message = (
            f"{feature} requires a storage backend with the {capability!r} capability, "
            f"but the configured storage does not declare it"
        )
        if detail:
            message = f"{message}; {detail}"
        else:
            message = f"{message}; use a backend that supports it (SQLite or PostgreSQL)"
        super().__init__(message)


class CorruptEpochError(WeftError):
    """A workflow's epoch key holds bytes that do not decode as an epoch.

    No epoch is minted over it: a fresh epoch 1 (or any guess) might equal one handed out before
    and let a stale owner's fenced writes match again. Acquire, takeover and external rotation
    refuse the workflow until an operator repairs the key with
    :func:`weft_sync.claims.epochs.repair_corrupt_epoch`.

    :param workflow_id: the workflow whose epoch is corrupt.
    :param key: the epoch key.
    """

    def __init__(self, workflow_id: str, key: str) -> None:
        self.workflow_id = workflow_id
        self.key = key
        super().__init__(
            f"the epoch key {key!r} of workflow {workflow_id!r} does not decode as an epoch, so "
            f"no new epoch is minted for it (it could repeat one handed out before); repair it "
            f"with weft_sync.claims.epochs.repair_corrupt_epoch(storage, {workflow_id!r}), "
            f"which sets it above any epoch handed out and deposes the current holder"
        )


class EpochExhaustedError(CorruptEpochError):
    """A workflow's epoch key holds the last epoch that can be minted over (``2**53 - 2``).

    Minting the next one would leave the range every engine can represent, so no epoch is
    minted and the workflow is refused, as for a corrupt epoch, until an operator repairs it
    (``weft-sync repair-epoch``), which writes an epoch derived from the time and deposes the
    holder.

    :param workflow_id: the workflow whose epochs are exhausted.
    :param key: the epoch key.
    :param epoch: the epoch stored there.
    """

    def __init__(self, workflow_id: str, key: str, epoch: int) -> None:
        WeftError.__init__(
            self,
            f"the epoch key {key!r} of workflow {workflow_id!r} holds epoch {epoch}, the last "
            f"that can be minted over: no further epoch is minted for it; repair it with "
            f"'weft-sync --url STORE_URL repair-epoch {workflow_id}' (or "
            f"weft_sync.claims.epochs.repair_corrupt_epoch(storage, {workflow_id!r}, "
            f"at_least=1)), which writes a fresh epoch and deposes the current holder",
        )
        self.workflow_id = workflow_id
        self.key = key
        self.epoch = epoch


class CorruptOwnershipMarkerError(WeftError):
    """The ownership-mode marker exists but does not decode as a valid record."""


class OwnershipModeMismatchError(WeftError):
    """The store was stamped by engines running a different ownership mode.

    :param configured_mode: the mode this process was configured with.
    :param stored_mode: the mode recorded in the store's marker.
    :param established_at: when the marker was written (ms since the Unix epoch).
    """

    code = "WEFT_OWNERSHIP_MODE_MISMATCH"

    def __init__(self, configured_mode: str, stored_mode: str, established_at: int) -> None:
        self.configured_mode = configured_mode
        self.stored_mode = stored_mode
        self.established_at = established_at
        super().__init__(
            f"this process is configured with ownership mode {configured_mode!r}, but the store "
            f"was established with mode {stored_mode!r} at {established_at} ms; every process on "
            f"one store must agree: stop all processes, pick one mode, and restart them"
        )


class WorkflowClaimUnavailableError(WeftError):
    """Another engine holds a live claim on the workflow (or it already exists).

    Also raised for a claim this engine itself holds (``held_here``): claims are not
    reentrant, so a second ``claim()`` of an id held by a ``claim()`` block or a workflow of
    the same engine is refused.

    :param workflow_id: the workflow whose claim could not be acquired.
    :param held_by: the engine id of the current holder, when known.
    :param held_here: the holder is the engine that raised this, not another one.
    """

    def __init__(
        self, workflow_id: str, held_by: str | None = None, *, held_here: bool = False
    ) -> None:
        self.workflow_id = workflow_id
        self.held_by = held_by
        if held_here:
            super().__init__(
                f"could not acquire the claim for workflow {workflow_id!r}: it is already held "
                f"by this engine ({held_by!r}): a claim() block or a workflow of this process "
                f"holds it, and claims are not reentrant; use the claim already held, or claim "
                f"again once it is released"
            )
            return
        holder = f" (currently held by {held_by!r})" if held_by else ""
        super().__init__(
            f"could not acquire the claim for workflow {workflow_id!r}{holder}; retry later, or "
            f"check whether the holder crashed (its claim becomes takeover-eligible once it "
            f"expires)"
        )


class WorkflowExistsError(WorkflowClaimUnavailableError):
    """``start()`` was given the id of a workflow that already exists.

    A subclass of :class:`WorkflowClaimUnavailableError`, so callers catching that still catch
    it; waiting does not help here, since the record stays until it is purged.

    :param workflow_id: the id that is taken.
    :param status: the existing workflow's status (``"running"``, ``"completed"``, ...).
    :param held_by: the engine id of the current holder, when known.
    """

    def __init__(self, workflow_id: str, status: str, held_by: str | None = None) -> None:
        self.workflow_id = workflow_id
        self.held_by = held_by
        self.status = status
        holder = f", claimed by {held_by!r}" if held_by else ""
        # Skips the parent's message, which advises waiting for a crashed holder.
        WeftError.__init__(
            self,
            f"workflow {workflow_id!r} already exists with status {status!r}{holder}; start "
            f"it under a new id, or purge the old one first",
        )

    def __reduce__(self) -> tuple[type[WorkflowExistsError], tuple[str, str, str | None]]:
        return (type(self), (self.workflow_id, self.status, self.held_by))


class EngineDeposedError(WeftError):
    """A fenced write failed because this engine no longer holds the workflow's epoch.

    :param workflow_id: the workflow whose fence was lost.
    :param cause: why, as far as this engine knows: ``"deposed"`` (another writer holds the
        epoch now), ``"deadline"`` (this engine gave the claim up: no renewal succeeded within
        the local renew deadline), ``"storage"`` (the store failed, so the fence could not be
        confirmed and the write fails closed), ``"store_identity"``, ``"store_rollback"`` (see
        :class:`WorkflowClaimLostWarning`), ``"not_held"`` (no claim is held: never claimed
        or released) or ``"superseded"`` (the write came from a drive whose claim was lost;
        this engine holds the workflow again, at a later epoch, for another driver).
    """

    def __init__(self, workflow_id: str, cause: str = "deposed") -> None:
        self.workflow_id = workflow_id
        self.cause = cause
        why = _DEPOSED_REASONS.get(cause, cause)
        super().__init__(
            f"this engine no longer owns workflow {workflow_id!r}: its epoch fence failed, so the "
            f"write was refused; {why}"
        )

    def __reduce__(self) -> tuple[type[EngineDeposedError], tuple[str, str]]:
        return (type(self), (self.workflow_id, self.cause))


_DEPOSED_REASONS = {
    "deposed": "another engine has taken the workflow over (or an external cancel, timeout, "
    "suspend or purge deposed this one)",
    "deadline": "this engine gave its claim up itself: no renewal succeeded within the local "
    "renew deadline (the store was failing or slow), so another engine may take it over",
    "storage": "the store failed while the fence was checked, so the write fails closed",
    "store_identity": "the store was replaced or deleted under this engine",
    "store_rollback": "the store went back in time and forgot writes made for this claim",
    "not_held": "this engine holds no claim on it (never claimed here, or released)",
    "superseded": "this drive's claim was lost, and this engine has taken the workflow again at "
    "a later epoch for another driver: only that drive writes now",
}


class FencedWriteConflict(WeftError):
    """A fenced write's own base conditions failed while the epoch fence still held.

    :param workflow_id: the workflow the write was for.
    """

    def __init__(self, workflow_id: str) -> None:
        self.workflow_id = workflow_id
        super().__init__(
            f"a fenced write for workflow {workflow_id!r} was refused because one of its base "
            f"conditions no longer matched (the claim is still held); re-read and retry"
        )


class WorkflowClaimLostError(WeftError):
    """A claim held by a ``claim()`` block was lost before the block finished.

    Also raised by ``ClaimHandle.assert_held()`` on a handle whose block has ended
    (``released``): that claim was given back, not lost, but it is no longer held either.

    :param workflow_id: the workflow whose claim was lost.
    :param released: this engine released the claim when its ``claim()`` block ended.
    """

    def __init__(self, workflow_id: str, *, released: bool = False) -> None:
        self.workflow_id = workflow_id
        self.released = released
        if released:
            super().__init__(
                f"the claim on workflow {workflow_id!r} was released when its claim() block "
                f"ended, so this handle no longer holds it; side effects belong inside the "
                f"block (or in a new claim() block)"
            )
            return
        super().__init__(
            f"the claim on workflow {workflow_id!r} was lost while it was held; another engine "
            f"may now own it, so side effects after the loss must be treated as unfenced"
        )


class WorkflowClaimLostWarning(UserWarning):
    """Emitted once per lost claim: this engine found it deposed or gave it up locally.

    :param workflow_id: the workflow whose claim was lost.
    :param cause: why: ``"deposed"`` (a renewal or fenced write found another writer's epoch or
        holder), ``"deadline"`` (no renewal succeeded within the local renew deadline) or
        ``"store_identity"`` (the store was replaced under this engine) or
        ``"store_rollback"`` (the store lost writes this engine made: its epoch or holder went
        back to an older value).
    """

    def __init__(self, workflow_id: str, cause: str = "deposed") -> None:
        self.workflow_id = workflow_id
        self.cause = cause
        reason = _LOSS_REASONS.get(cause, cause)
        super().__init__(f"lost the ownership claim on workflow {workflow_id!r}{reason}")


_LOSS_REASONS = {
    "deposed": "",
    "deadline": (
        ": no renewal succeeded within the local renew deadline (claim TTL minus renew "
        "interval), so another engine may take it over soon"
    ),
    "store_identity": ": the store was replaced or deleted under this engine",
    "store_rollback": (
        ": the store went back in time (it lost writes this engine made there, e.g. a restore "
        "of an older copy or a failover to a replica that lacked them)"
    ),
}


class WorkflowWakeDiscardedWarning(UserWarning):
    """Emitted when a wake-up is discarded because this engine no longer owns the workflow.

    :param workflow_id: the workflow whose wake was discarded.
    :param wake_kind: what kind of wake it was (``"signal"``, ``"sleep"``, ...).
    """

    def __init__(self, workflow_id: str, wake_kind: str) -> None:
        self.workflow_id = workflow_id
        self.wake_kind = wake_kind
        super().__init__(
            f"discarded a {wake_kind!r} wake for workflow {workflow_id!r}: this engine no longer "
            f"owns it"
        )
