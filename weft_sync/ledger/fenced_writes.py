"""Fenced writes and the wake-ownership check: how the ledger proves it still owns a workflow.

A fenced write adds one condition to the caller's compare-and-swap: the workflow's epoch key still
holds the exact bytes this engine's registry wrote when it acquired the claim. Any change of owner
(takeover, external cancel/timeout/suspend/purge) rewrites the epoch key, so a deposed engine's
write fails at the store. When the CAS fails, the epoch key is read again to tell the two causes
apart: a changed, absent, corrupt or unreadable epoch means this engine was deposed; an unchanged
one means only the caller's own conditions failed.

The wake-ownership check (spec §5.9) re-reads the holder record before a parked wait is woken and
discards the wake unless the holder still names this engine at the epoch it holds.
"""

from __future__ import annotations

import enum
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NoReturn

from .. import keys
from ..claims.registry import ClaimRegistry, WarnSink
from ..codec import decode_epoch, decode_holder
from ..errors import (
    EngineDeposedError,
    StoreIdentityError,
    WeftError,
    WorkflowClaimLostWarning,
    WorkflowWakeDiscardedWarning,
)
from ..maintenance.polls import SignalWakeDecision
from ..storage.base import (
    Condition,
    Delete,
    Operation,
    Put,
    Storage,
    storage_conditional_batch,
)

_log = logging.getLogger(__name__)

RegistrySource = Callable[[], "ClaimRegistry | None"]
"""Returns the engine's registry, or ``None`` while none is bound."""

DriveTokenSource = Callable[[str], "bytes | None"]
"""``workflow_id -> token``: the epoch token of the drive of it the calling thread is inside,
or ``None``."""

FenceObserver = Callable[[str, int, float, "BaseException | None"], object]
"""Told of every fenced commit: workflow id, wall-clock start (``time.time_ns()``), duration in
seconds, and what it raised (``None`` when it committed or only a base condition failed)."""


def default_warn(warning: Warning) -> None:
    """Emit ``warning`` with :func:`warnings.warn` (the sink used when none is injected)."""
    warnings.warn(warning, stacklevel=3)


class WakeCheckStatus(str, enum.Enum):
    """Verdict of :func:`wake_ownership_check`; anything but ``match`` discards the wake."""

    MATCH = "match"
    HOLDER_ABSENT = "holder-absent"
    HOLDER_UNDECODABLE = "holder-undecodable"
    GENERATION_MISMATCH = "generation-mismatch"


@dataclass(frozen=True, slots=True)
class WakeCheck:
    """The verdict and what the holder record said (``None`` when absent or unreadable)."""

    status: WakeCheckStatus
    observed_engine_id: str | None = None
    observed_epoch: int | None = None


def wake_ownership_check(
    storage: Storage,
    workflow_id: str,
    wake_kind: str,
    *,
    expected_engine_id: str,
    expected_epoch: int,
    warn: WarnSink,
) -> WakeCheck:
    """Re-read the holder and judge whether a wake of ``workflow_id`` may proceed.

    Read-only. ``match`` only if the holder decodes and names ``expected_engine_id`` **and**
    ``expected_epoch``: the same engine at another epoch is a new generation (it released and
    re-acquired) and must not resume a wait of the old one. Every other verdict emits one
    :class:`~weft_sync.errors.WorkflowWakeDiscardedWarning` through ``warn``.

    :raises StorageError: the holder could not be read.
    """
    raw = storage.get(keys.workflow_owner_holder(workflow_id))
    return _judge_holder(raw, workflow_id, wake_kind, expected_engine_id, expected_epoch, warn)


def _judge_holder(
    raw: bytes | None,
    workflow_id: str,
    wake_kind: str,
    expected_engine_id: str,
    expected_epoch: int,
    warn: WarnSink,
) -> WakeCheck:
    if raw is None:
        check = WakeCheck(WakeCheckStatus.HOLDER_ABSENT)
    else:
        holder = decode_holder(raw)
        if holder is None:
            check = WakeCheck(WakeCheckStatus.HOLDER_UNDECODABLE)
        elif holder.engine_id != expected_engine_id or holder.epoch != expected_epoch:
            check = WakeCheck(WakeCheckStatus.GENERATION_MISMATCH, holder.engine_id, holder.epoch)
        else:
            return WakeCheck(WakeCheckStatus.MATCH, holder.engine_id, holder.epoch)
    _log.warning(
        "discarded a %r wake of workflow %r: %s (holder engine %r, epoch %r; this engine %r, "
        "epoch %d)",
        wake_kind,
        workflow_id,
        check.status.value,
        check.observed_engine_id,
        check.observed_epoch,
        expected_engine_id,
        expected_epoch,
    )
    warn(WorkflowWakeDiscardedWarning(workflow_id, wake_kind))
    return check


class Fence:
    """Commits fenced writes for the workflows this engine's registry holds.

    Stateless apart from its collaborators, so it is safe to use from any thread.

    :param storage: the shared store (the registry's own store).
    :param registry: returns the engine's registry, or ``None`` while none is bound.
    :param warn: receives :class:`~weft_sync.errors.WorkflowClaimLostWarning` when a fenced write
        finds the claim lost, and wake-discarded warnings.
    :param drive_token: the epoch token of the drive of a workflow the calling thread is
        inside, or ``None`` (see :meth:`~weft_sync.ledger.driving.DriverTracker.drive_token`):
        such a thread writes with that token only.
    """

    def __init__(
        self,
        storage: Storage,
        registry: RegistrySource,
        warn: WarnSink,
        observers: Sequence[FenceObserver] = (),
        *,
        drive_token: DriveTokenSource | None = None,
    ) -> None:
        self._storage = storage
        self._registry = registry
        self._warn = warn
        self._observers = tuple(observers)
        self._drive_token = drive_token

    @property
    def warn(self) -> WarnSink:
        """The warning sink."""
        return self._warn

    def registry(self) -> ClaimRegistry:
        """The bound registry.

        :raises WeftError: no registry is bound yet (owner operations need one).
        """
        registry = self._registry()
        if registry is None:
            raise WeftError(
                "this workflow ledger has no claim registry bound, so it cannot act as a "
                "workflow's owner; call bind_registry(registry) first or open it through "
                "weft_sync.Ownership"
            )
        return registry

    def optional_registry(self) -> ClaimRegistry | None:
        """The bound registry, or ``None``."""
        return self._registry()

    def deposed(
        self,
        workflow_id: str,
        cause: BaseException | None = None,
        *,
        why: str = "deposed",
        report: bool = True,
    ) -> NoReturn:
        """Report the lost claim (log + warning sink) and raise ``EngineDeposedError``.

        :param why: the error's ``cause`` (see :class:`~weft_sync.errors.EngineDeposedError`).
        :param report: ``False`` when the loss was reported already (by the renewal or the
            local loss that dropped the claim): one lost claim gives one warning.
        """
        if report:
            _log.warning(
                "a fenced write for workflow %r found this engine deposed (its epoch fence no "
                "longer holds)",
                workflow_id,
            )
            self._warn(WorkflowClaimLostWarning(workflow_id))
        else:
            _log.info(
                "a fenced write for workflow %r was refused: this engine holds no claim on it (%s)",
                workflow_id,
                why,
            )
        raise EngineDeposedError(workflow_id, why) from cause

    def fence_bytes(self, workflow_id: str) -> bytes:
        """The epoch token this engine holds for ``workflow_id``.

        :raises EngineDeposedError: it holds none; its ``cause`` says why the claim was lost
            when that was recent (the loss was reported then, so no second warning).
        """
        registry = self.registry()
        fence = registry.current_epoch_bytes(workflow_id)
        if fence is None:
            why = registry.loss_cause(workflow_id)
            self.deposed(workflow_id, why=why or "not_held", report=False)
        self.check_drive(workflow_id, fence)
        return fence

    def check_drive(self, workflow_id: str, held: bytes | None) -> None:
        """Refuse a write from a thread inside a drive of ``workflow_id`` with another epoch
        token than ``held``, the one this engine holds it with.

        :raises EngineDeposedError: cause ``"superseded"``: the drive's claim was lost, then
            taken again here for another driver (the loss was reported when it happened).
        """
        if self._drive_token is None:
            return
        driving = self._drive_token(workflow_id)
        if driving is not None and driving != held:
            self.deposed(workflow_id, why="superseded", report=False)

    def commit(
        self,
        workflow_id: str,
        conditions: Sequence[Condition],
        operations: Sequence[Operation],
    ) -> bool:
        """Commit ``operations`` if ``conditions`` hold and this engine still owns the workflow.

        :returns: ``True`` when committed; ``False`` when only the caller's conditions failed
            (the epoch was re-read and is still this engine's).
        :raises EngineDeposedError: the registry holds no epoch (no storage round trip), or the
            CAS failed and the epoch key is now absent, different, corrupt or unreadable.
        :raises StorageError: the commit itself failed.
        :raises StoreIdentityError: the store was replaced; every claim of this engine has been
            lost locally (cause ``store_identity``).
        """
        if not self._observers:
            return self._commit(workflow_id, conditions, operations)
        started_ns, started = time.time_ns(), time.perf_counter()
        error: BaseException | None = None
        try:
            return self._commit(workflow_id, conditions, operations)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._notify(workflow_id, started_ns, time.perf_counter() - started, error)

    def _notify(
        self, workflow_id: str, started_ns: int, seconds: float, error: BaseException | None
    ) -> None:
        for observer in self._observers:
            try:
                observer(workflow_id, started_ns, seconds, error)
            except Exception:
                _log.exception("a fenced-write observer failed for workflow %r", workflow_id)

    def _commit(
        self,
        workflow_id: str,
        conditions: Sequence[Condition],
        operations: Sequence[Operation],
    ) -> bool:
        fence = self.fence_bytes(workflow_id)
        epoch_key = keys.workflow_owner_epoch(workflow_id)
        fenced = [*conditions, Condition(epoch_key, fence)]
        try:
            if storage_conditional_batch(self._storage, fenced, operations):
                return True
        except StoreIdentityError as exc:
            # Another store now sits at this location: nothing this engine holds is vouched for.
            self.registry().lose_store(exc)
            raise
        try:
            observed = self._storage.get(epoch_key)
        except Exception as exc:
            # Unable to prove the fence still holds: fail closed. The claim may still be ours,
            # so it stays tracked (its renewals decide) and no loss is reported.
            self.deposed(workflow_id, exc, why="storage", report=False)
        if observed is None or decode_epoch(observed) is None or observed != fence:
            # Proven: the stored token is not ours. Drop the claim here, so that its next
            # renewal does not report it a second time; a store that went back in time loses
            # every claim (reported by the registry).
            report = self.registry().lose_deposed(workflow_id, fence, observed)
            why = "deposed" if report else (self.registry().loss_cause(workflow_id) or "deposed")
            self.deposed(workflow_id, why=why, report=report)
        _log.debug("fenced write for workflow %r: a base condition failed", workflow_id)
        return False

    def confirm_wake(self, workflow_id: str, wake_kind: str) -> SignalWakeDecision:
        """Decide whether a wake of ``workflow_id`` may proceed on this engine.

        No registry → ``proceed`` without reading. No local epoch → warning + ``discard``.
        Otherwise the verdict of :func:`wake_ownership_check`; if that read raises, ``proceed``
        (the fenced write that follows the wake is the real backstop, and a store blip must not
        strand a wake).
        """
        registry = self._registry()
        if registry is None:
            return SignalWakeDecision.PROCEED
        epoch = registry.current_epoch(workflow_id)
        if epoch is None:
            _log.warning(
                "discarded a %r wake of workflow %r: this engine holds no claim on it",
                wake_kind,
                workflow_id,
            )
            self._warn(WorkflowWakeDiscardedWarning(workflow_id, wake_kind))
            return SignalWakeDecision.DISCARD
        try:
            raw = self._storage.get(keys.workflow_owner_holder(workflow_id))
        except Exception:
            _log.debug(
                "wake check of workflow %r could not read the holder; proceeding",
                workflow_id,
                exc_info=True,
            )
            return SignalWakeDecision.PROCEED
        check = _judge_holder(raw, workflow_id, wake_kind, registry.engine_id, epoch, self._warn)
        if check.status is WakeCheckStatus.MATCH:
            return SignalWakeDecision.PROCEED
        return SignalWakeDecision.DISCARD


# -- what a host may write through a fenced write --------------------------------------------

_LIBRARY_PREFIXES: Final = ("wf-owner-", "wf-idx-status:")


def is_library_owned(key: str) -> bool:
    """Claim keys, the mode marker, status-index entries and the workflow records themselves."""
    if key == keys.OWNERSHIP_MODE_MARKER or key.startswith(_LIBRARY_PREFIXES):
        return True
    # An encoded id never contains ":", so "wf:<id>" without a further colon is a record key.
    return key.startswith("wf:") and ":" not in key[3:]


def checked_host_operations(operations: Iterable[Operation]) -> list[Operation]:
    """The operations as a list, after refusing non-operations and library-owned keys.

    :raises TypeError: an item is not a ``Put`` or ``Delete``.
    :raises ValueError: an operation names a library-owned key.
    """
    ops = list(operations)
    for op in ops:
        if not isinstance(op, (Put, Delete)):
            raise TypeError(f"operations must be Put or Delete, got {op!r:.80}")
        if is_library_owned(op.key):
            raise ValueError(
                f"a fenced write may not touch {op.key!r}: claim keys, the mode marker, workflow "
                f"records and the status index are written by the library only (use start, "
                f"complete, fail, cancel, ... to change a workflow's record)"
            )
    return ops


def checked_conditions(conditions: Iterable[Condition]) -> list[Condition]:
    """The conditions as a list.

    :raises TypeError: an item is not a ``Condition``.
    """
    conds = list(conditions)
    for cond in conds:
        if not isinstance(cond, Condition):
            raise TypeError(f"conditions must be Condition objects, got {cond!r:.80}")
    return conds
