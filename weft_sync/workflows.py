"""The workflow ledger a host writes through: records, fenced writes, transitions, signals.

Invariants the ledger keeps:

- A workflow record ``wf:<id>`` and its status-index entry ``wf-idx-status:<status>:<id>`` only
  ever change together, in one compare-and-swap conditioned on the exact record bytes read.
- ``start`` folds the claim acquire into the write that creates the record; ``complete``/``fail``
  fold the release of this engine's own claim into the write of the final state (one CAS,
  conditioned on its epoch and holder bytes); ``cancel``/``timeout``/``suspend``/``purge`` (from
  any process) fold an epoch rotation into the state change, deposing whoever owned the
  workflow. The epoch key is never deleted.
- Every owner write (checkpoints, consumed signals, delivered updates, self transitions) is a
  fenced write: it fails at the store once this engine no longer holds the workflow's epoch.

Wiring with the maintenance layer (the bootstrap creates the registry, and the renewal task needs
the poll targets at that moment). Either construct the ledger first, without a registry::

    workflows = Workflows(storage, None, clock=clock, warn=warn)
    boot = bootstrap_workflow_lease_ownership(
        storage=storage, ..., signal_poll_target=workflows.signal_poll_target,
        update_poll_target=workflows.update_poll_target, warn=warn)
    workflows.bind_registry(boot.registry)

or build the targets first from a callable that returns the ledger once it exists (``None``
before: the targets then report nothing)::

    signal_target = WorkflowSignalPollTarget(lambda: ledger_box.get("ledger"))

Without a registry the ledger still serves every non-owner operation (``get``, ``list``,
``send_signal``, ``submit_update``, external transitions); owner operations raise ``WeftError``.
The ledger starts no threads and holds one lock, guarding its registry binding.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from . import keys
from ._fork import process_bound, process_bound_class
from .claims.registry import ClaimRegistry, WarnSink
from .clock import Clock, system_clock
from .codec import (
    WorkflowRecord,
)
from .errors import (
    ClosedError,
    EngineDeposedError,
    FencedWriteConflict,
    WorkflowClaimUnavailableError,
)
from .ledger.driving import DriverTracker
from .ledger.external import EXTERNAL_MAX_ATTEMPTS, SUSPENDABLE_STATUSES, ExternalTransitions
from .ledger.fenced_writes import (
    Fence,
    FenceObserver,
    checked_conditions,
    checked_host_operations,
    default_warn,
)
from .ledger.finishing import HostWritesLookup, SelfTransitions
from .ledger.listing import list_records
from .ledger.records import (
    ACTIVE_STATUSES,
    ExternalCommitConflictError,
    WorkflowNotFoundError,
    WorkflowOutcome,
    WorkflowStateError,
    checkpoint_key,
    decode_payload_map,
    read_record,
    result_key,
    validate_name,
    validate_status,
)
from .ledger.signals import SignalBuffer
from .ledger.starting import RESUMABLE_STATUSES, Starts
from .ledger.updates import UpdateHandler, UpdateQueue, WorkflowUpdate
from .maintenance.targets import ParkedSignalWait
from .metrics import ClaimMetrics
from .storage.base import Condition, Operation, Put, Storage

__all__ = [
    "DriveContext",
    "EXTERNAL_MAX_ATTEMPTS",
    "ExternalCommitConflictError",
    "Workflows",
    "WorkflowNotFoundError",
    "WorkflowOutcome",
    "WorkflowSignalPollTarget",
    "WorkflowStateError",
    "WorkflowUpdate",
    "WorkflowUpdatePollTarget",
]

_log = logging.getLogger(__name__)


@process_bound_class
class Workflows:
    """The workflow ledger of one engine (reached as ``Ownership.workflows``).

    In a child that inherited it across ``os.fork()`` every method but :meth:`close` raises
    :class:`~weft_sync.errors.ClosedError` (it would write under the parent's engine id).

    :param storage: the shared store; it must be the registry's own store, since acquire and
        release fragments are committed in the ledger's writes.
    :param registry: the engine's claim registry, or ``None`` to bind it later with
        :meth:`bind_registry`.
    :param clock: milliseconds since the Unix epoch, for record timestamps and key order.
    :param warn: receives claim-lost and wake-discarded warnings; default :func:`warnings.warn`.
    :param metrics: counts every claim ``start`` and ``resume`` acquire as an ``acquired``
        attempt.
    :param fence_observers: told of every fenced commit (latency metrics, tracing).
    """

    def __init__(
        self,
        storage: Storage,
        registry: ClaimRegistry | None = None,
        *,
        clock: Clock = system_clock,
        warn: WarnSink | None = None,
        metrics: ClaimMetrics | None = None,
        fence_observers: Sequence[FenceObserver] = (),
    ) -> None:
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning int milliseconds, got {clock!r}")
        if warn is not None and not callable(warn):
            raise TypeError(f"warn must be a callable taking a Warning, or None, got {warn!r}")
        self._storage = storage
        self._clock = clock
        self._fork_pid = os.getpid()  # see process_bound_class
        self._metrics = metrics
        # _lock guards _registry, _drivers and _closed.
        self._lock = threading.Lock()
        self._registry: ClaimRegistry | None = None
        self._drivers: DriverTracker | None = None
        self._closed = False
        self._fence = Fence(
            storage,
            self._current_registry,
            warn or default_warn,
            fence_observers,
            drive_token=self._drive_token,
        )
        self._signals = SignalBuffer(storage, self._fence, clock)
        self._updates = UpdateQueue(storage, self._fence, clock)
        self._external = ExternalTransitions(
            storage, self._fence, self._signals, self._updates, clock
        )
        self._self_transitions = SelfTransitions(storage, self._fence, clock)
        self._starts = Starts(storage, self._fence, clock, metrics)
        self._signal_target = WorkflowSignalPollTarget(lambda: self)
        self._update_target = WorkflowUpdatePollTarget(lambda: self)
        if registry is not None:
            self.bind_registry(registry)

    # -- wiring ----------------------------------------------------------------------------

    @property
    def storage(self) -> Storage:
        """The shared store."""
        return self._storage

    @property
    @process_bound
    def registry(self) -> ClaimRegistry | None:
        """The bound claim registry, or ``None``."""
        return self._current_registry()

    def _current_registry(self) -> ClaimRegistry | None:
        with self._lock:
            closed, registry = self._closed, self._registry
        if closed:
            raise ClosedError(
                "this workflow ledger was closed with its Ownership, so it can no longer act "
                "for an engine (nothing would renew or release its claims); open a new Ownership"
            )
        return registry

    def close(self) -> None:
        """Refuse owner operations from now on; idempotent. ``Ownership.close()`` calls it.

        Reads (``get``, ``list``) keep working while the store is open.
        """
        with self._lock:
            self._closed = True

    def bind_registry(self, registry: ClaimRegistry) -> None:
        """Bind the engine's registry; binding the same one again is a no-op.

        :raises ValueError: another registry is already bound, or ``registry`` uses another store.
        """
        if not isinstance(registry, ClaimRegistry):
            raise TypeError(f"registry must be a ClaimRegistry, got {registry!r:.80}")
        if registry.storage is not self._storage:
            raise ValueError(
                "the registry commits to a different storage object than this ledger; both must "
                "share one store so acquire and release fold into the ledger's writes"
            )
        with self._lock:
            if self._closed:
                raise ClosedError("cannot bind a registry to a closed workflow ledger")
            if self._registry is not None and self._registry is not registry:
                raise ValueError(
                    f"this ledger is already bound to the registry of engine "
                    f"{self._registry.engine_id!r}; one ledger serves one engine"
                )
            self._registry = registry

    @property
    def signal_poll_target(self) -> WorkflowSignalPollTarget:
        """The owner-side signal-poll target over this ledger's parked waits."""
        return self._signal_target

    @property
    def update_poll_target(self) -> WorkflowUpdatePollTarget:
        """The owner-side update-poll target over this ledger's update handlers."""
        return self._update_target

    # -- start and reads -------------------------------------------------------------------

    def start(self, workflow_id: str, type: str, *, input: Any = None) -> WorkflowRecord:
        """Create a running workflow and claim it, in one atomic write.

        The write is conditioned on the record being absent and on the acquire fragment (holder
        absent, epoch as read); it also clears related records a purge may have left behind.

        :raises WorkflowExistsError: a workflow with this id exists (its ``status`` says in
            which state); nothing was written. A :class:`WorkflowClaimUnavailableError`.
        :raises WorkflowClaimUnavailableError: a claim without a record (``Ownership.claim()``)
            holds the id (``held_by`` names the holder when one is readable); nothing was
            written.
        :raises ValueError: bad id or type, or ``input`` is not MessagePack-encodable.
        """
        wid = keys.validate_workflow_id(workflow_id)
        validate_name("workflow type", type)
        registry = self._fence.registry()
        # In flight for the registry's close(): it waits for this start before releasing all.
        with registry.operation("Workflows.start()"):
            record = self._starts.start(registry, wid, type, input)
        self._expect_driver(registry, wid)
        return record

    def get(self, workflow_id: str) -> WorkflowRecord | None:
        """The workflow's record, or ``None``.

        :raises ValueError: the stored record is corrupt.
        """
        found = read_record(self._storage, keys.validate_workflow_id(workflow_id))
        return None if found is None else found[1]

    def get_outcome(self, workflow_id: str) -> WorkflowOutcome | None:
        """What a completed or failed workflow ended with, or ``None`` (not finished by itself)."""
        wid = keys.validate_workflow_id(workflow_id)
        raw = self._storage.get(result_key(wid))
        data = None if raw is None else decode_payload_map(raw)
        if data is None:
            return None
        finished_at = data.get("finished_at")
        return WorkflowOutcome(
            wid,
            str(data.get("status")),
            data.get("result"),
            data.get("error"),
            finished_at if isinstance(finished_at, int) else 0,
        )

    def load_checkpoint(self, workflow_id: str) -> bytes | None:
        """The workflow's checkpoint bytes, or ``None`` (a plain read: anyone may read)."""
        return self._storage.get(checkpoint_key(keys.validate_workflow_id(workflow_id)))

    # -- owner writes ----------------------------------------------------------------------

    def fenced_write(
        self,
        workflow_id: str,
        operations: Iterable[Operation],
        conditions: Iterable[Condition] = (),
    ) -> None:
        """Commit ``operations`` if ``conditions`` hold and this engine still owns the workflow.

        The claim keys, the mode marker, workflow records and the status index belong to the
        library and cannot be written here (use ``start``/``complete``/... for records).

        :raises EngineDeposedError: the epoch fence failed (after a claim-lost warning).
        :raises FencedWriteConflict: only a base condition failed; nothing was written.
        :raises ValueError: an operation names a library-owned key.
        """
        wid = keys.validate_workflow_id(workflow_id)
        ops = checked_host_operations(operations)
        conds = checked_conditions(conditions)
        if not self._fence.commit(wid, conds, ops):
            raise FencedWriteConflict(wid)

    def save_checkpoint(self, workflow_id: str, value: bytes) -> None:
        """Store the workflow's checkpoint with a fenced write.

        :raises EngineDeposedError: this engine no longer owns the workflow.
        """
        wid = keys.validate_workflow_id(workflow_id)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"a checkpoint must be bytes, got {type(value).__name__}")
        if not self._fence.commit(wid, [], [Put(checkpoint_key(wid), bytes(value))]):
            raise FencedWriteConflict(wid)

    def complete(self, workflow_id: str, result: Any = None) -> WorkflowRecord:
        """Mark the running workflow ``completed`` with ``result``; release its claim in that write.

        Inside ``Ownership.fenced(workflow_id, conn)`` (or Django's ``fenced_atomic``) on the
        store's own database, the write is made in the host's transaction and commits (or rolls
        back) with the host's rows; the claim is released when that transaction commits.

        :raises EngineDeposedError: this engine no longer owns the workflow (whatever its
            status).
        :raises WorkflowStateError: the workflow is not running.
        :raises ValueError: ``result`` is not MessagePack-encodable.
        """
        return self._finish(workflow_id, "completed", "complete", {"result": result})

    def fail(self, workflow_id: str, error: Any) -> WorkflowRecord:
        """Mark the running workflow ``failed`` with ``error``; release its claim in that write.

        An exception is stored as ``{"type": <class name>, "message": str(exc)}``; any other
        value must be MessagePack-encodable.
        """
        if isinstance(error, BaseException):
            error = {"type": type(error).__name__, "message": str(error)}
        return self._finish(workflow_id, "failed", "fail", {"error": error})

    def _finish(
        self, workflow_id: str, status: str, operation: str, fields: dict[str, Any]
    ) -> WorkflowRecord:
        wid = keys.validate_workflow_id(workflow_id)
        new = self._self_transitions.finish(wid, status, operation, fields)
        self._signals.notify_all(wid)
        self._updates.forget(wid)
        return new

    # -- external transitions (any process) ------------------------------------------------

    def cancel(self, workflow_id: str) -> WorkflowRecord:
        """Cancel the workflow and depose its owner (epoch rotation in the same write).

        :raises WorkflowNotFoundError: no such workflow.
        :raises WorkflowStateError: it already finished.
        :raises ExternalCommitConflictError: the record or epoch kept changing under it.
        """
        wid = keys.validate_workflow_id(workflow_id)
        return self._external.transition(wid, "cancel", "cancelled", ACTIVE_STATUSES)

    def timeout(self, workflow_id: str) -> WorkflowRecord:
        """Mark the workflow ``timed-out`` and depose its owner; raises as :meth:`cancel`."""
        wid = keys.validate_workflow_id(workflow_id)
        return self._external.transition(wid, "timeout", "timed-out", ACTIVE_STATUSES)

    def suspend(self, workflow_id: str) -> WorkflowRecord:
        """Suspend a pending or running workflow and depose its owner until :meth:`resume`.

        Raises as :meth:`cancel`; suspending a suspended workflow is a ``WorkflowStateError``.
        """
        wid = keys.validate_workflow_id(workflow_id)
        return self._external.transition(wid, "suspend", "suspended", SUSPENDABLE_STATUSES)

    def purge(self, workflow_id: str) -> None:
        """Delete the workflow's record, index entry and related records; depose its owner.

        The epoch key is rotated, never deleted, so a later workflow with the same id gets a
        larger epoch than any stale owner could hold.

        :raises WorkflowNotFoundError: no such workflow.
        :raises ExternalCommitConflictError: the record or epoch kept changing under it.
        """
        self._external.purge(keys.validate_workflow_id(workflow_id))

    # -- resume ----------------------------------------------------------------------------

    def resume(self, workflow_id: str) -> WorkflowRecord:
        """Claim a running or suspended workflow on this engine; a suspended one runs again.

        If this engine already tracks a claim, the holder is re-read first: still ours → kept;
        gone → acquired afresh; anyone else's (or unreadable) → unavailable.

        :raises WorkflowClaimUnavailableError: another engine holds it (``held_by`` when known).
        :raises WorkflowNotFoundError: no such workflow.
        :raises WorkflowStateError: it is neither running nor suspended.
        """
        wid = keys.validate_workflow_id(workflow_id)
        registry = self._fence.registry()
        with registry.operation("Workflows.resume()"):
            record = self._starts.resume(registry, wid)
        self._expect_driver(registry, wid)
        return record

    # -- driving ---------------------------------------------------------------------------

    def bind_host_writes(self, lookup: HostWritesLookup) -> None:
        """Let ``complete()``/``fail()`` inside a fenced block write through the host's
        transaction: ``lookup(workflow_id)`` finds the block open on this thread, if any."""
        self._self_transitions.host_writes = lookup

    def bind_drivers(self, drivers: DriverTracker) -> None:
        """Track the drivers of this ledger's claims with ``drivers`` (the facade binds it)."""
        with self._lock:
            self._drivers = drivers

    def _current_drivers(self) -> DriverTracker | None:
        with self._lock:
            return self._drivers

    def _check_drive(self, workflow_id: str) -> None:
        """Refuse the calling thread's drive of ``workflow_id`` if this engine holds the
        workflow with another epoch token (see :meth:`Fence.check_drive`)."""
        held = self._fence.registry().current_epoch_bytes(workflow_id)
        if held is not None:
            self._fence.check_drive(workflow_id, held)

    def _drive_token(self, workflow_id: str) -> bytes | None:
        drivers = self._current_drivers()
        return None if drivers is None else drivers.drive_token(workflow_id)

    def _expect_driver(self, registry: ClaimRegistry, wid: str) -> None:
        drivers = self._current_drivers()
        epoch = registry.current_epoch(wid)
        if drivers is not None and epoch is not None:
            drivers.expect(wid, epoch)

    @contextmanager
    def drive(self, workflow_id: str) -> Iterator[DriveContext]:
        """Drive ``workflow_id`` on this thread for the length of a ``with`` block.

        A workflow this engine holds is driven at its epoch; one it does not hold is claimed
        first, as :meth:`resume` claims it (a running or suspended record nobody holds), or
        taken over when its holder expired. Finish it inside the block with
        ``ctx.complete()``, ``ctx.fail()`` or ``ctx.suspend()``. Leaving the block with an
        exception, or without finishing, releases the claim for a redrive by a handler (the
        attempts are counted; see :mod:`weft_sync.ledger.driving`); the exception propagates.
        Inside a handler (the thread already driving it) the block is nested and the handler
        decides; on another thread, while a handler or another block drives it, it is refused.

        :raises WorkflowClaimUnavailableError: another engine holds a live claim on it, or
            another thread of this engine drives it already (``held_by`` is this engine).
        :raises WorkflowNotFoundError: no such workflow.
        :raises WorkflowStateError: it is neither running nor suspended.
        """
        wid = keys.validate_workflow_id(workflow_id)
        registry = self._fence.registry()
        epoch = registry.current_epoch(wid)
        if epoch is None:
            epoch = self._claim_to_drive(registry, wid)
        else:
            # Held already: by this ledger's start() or resume(), a handler, or a bare claim()
            # block, which has no record to drive (and whose claim a drive must not give back).
            record = self.get(wid)
            if record is None:
                raise WorkflowNotFoundError(wid)
            if record.status not in RESUMABLE_STATUSES:
                raise WorkflowStateError(wid, record.status, "drive", RESUMABLE_STATUSES)
        drivers = self._current_drivers()
        context = DriveContext(wid, epoch, self)
        if drivers is None:
            yield context
            return
        with drivers.driving(wid, epoch, "drive() block"):
            yield context

    def _claim_to_drive(self, registry: ClaimRegistry, wid: str) -> int:
        try:
            self.resume(wid)
        except WorkflowClaimUnavailableError:
            taken = registry.takeover(wid)
            if taken.status != "acquired" or taken.epoch is None:
                raise
            if self._metrics is not None:
                self._metrics.record_claim_attempt("takeover")
        epoch = registry.current_epoch(wid)
        if epoch is None:
            raise EngineDeposedError(wid)
        return epoch

    # -- signals and updates ---------------------------------------------------------------

    def send_signal(self, workflow_id: str, name: str, payload: Any = None) -> None:
        """Buffer a signal for the workflow (from any process); its owner consumes it.

        :raises WorkflowNotFoundError: no such workflow.
        :raises WorkflowStateError: it already finished.
        :raises ValueError: bad name, or ``payload`` is not MessagePack-encodable.
        """
        self._signals.send(keys.validate_workflow_id(workflow_id), name, payload)

    def wait_for_signal(self, workflow_id: str, name: str, timeout: float) -> Any:
        """Consume one signal ``name`` (owner only), waiting up to ``timeout`` seconds.

        Returns at once when one is already buffered. Each signal is consumed exactly once,
        by a fenced delete. A signal sent through this ledger wakes the wait at once; one sent
        by another process is noticed by the owner-side signal poll of the maintenance task
        (within one renew interval, or at the next ``run_maintenance()`` of a manual host).

        :raises EngineDeposedError: this engine does not (or no longer) own the workflow.
        :raises TimeoutError: none arrived in time; nothing was consumed.
        """
        return self._signals.wait(keys.validate_workflow_id(workflow_id), name, timeout)

    def submit_update(self, workflow_id: str, name: str, payload: Any = None) -> str:
        """Queue an update for the workflow (from any process); return its ``update_id``.

        The owner's handler (:meth:`on_update`) receives it on the next update poll.

        :raises WorkflowNotFoundError: no such workflow.
        :raises WorkflowStateError: it already finished.
        """
        return self._updates.submit(keys.validate_workflow_id(workflow_id), name, payload)

    def on_update(self, workflow_id: str, handler: UpdateHandler | None) -> None:
        """Register the owner's handler for the workflow's updates (``None`` removes it).

        The handler is called with one :class:`WorkflowUpdate` at a time, from the update poll's
        thread, only while this engine holds the workflow.
        """
        self._updates.set_handler(keys.validate_workflow_id(workflow_id), handler)

    # -- helpers ---------------------------------------------------------------------------

    def _after_fork_in_child(self) -> None:
        """Drop state inherited through ``fork()``: parked waiters, handlers and held locks.

        Called by the facade's fork handler; the registry binding is kept (the facade resets the
        registry itself).
        """
        # A parent thread may have held a lock at fork time; only this thread exists now.
        self._lock = threading.Lock()
        self._signals.after_fork_in_child()
        self._updates.after_fork_in_child()

    def __repr__(self) -> str:
        registry = self._current_registry()
        engine = None if registry is None else registry.engine_id
        return f"Workflows(engine_id={engine!r})"

    # ``list`` comes last: inside the class body its name shadows the builtin.
    def list(
        self, *, status: str | None = None, limit: int | None = None
    ) -> builtins.list[WorkflowRecord]:
        """Workflow records in id order: through the status index, or all records.

        :param status: only workflows with this status (one of the workflow statuses).
        :param limit: at most this many records (``None``: all).
        """
        if status is not None:
            validate_status(status)
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
        ):
            raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
        return list_records(self._storage, status, limit)


# -- poll targets ----------------------------------------------------------------------------


class WorkflowSignalPollTarget:
    """The :class:`~weft_sync.maintenance.SignalPollTarget` of a ledger.

    :param ledger: returns the ledger, or ``None`` before it exists (nothing is reported then).
    """

    def __init__(self, ledger: Callable[[], Workflows | None]) -> None:
        self._ledger = ledger

    def list_parked_signal_waits(self) -> list[ParkedSignalWait]:
        """The waits parked in ``wait_for_signal`` on workflows this engine holds."""
        ledger = self._ledger()
        return [] if ledger is None else ledger._signals.parked_waits()

    def has_buffered_signal(self, workflow_id: str, signal_name: str) -> bool:
        """Whether a signal is buffered (a scan; consumes nothing)."""
        ledger = self._ledger()
        return ledger is not None and ledger._signals.has_buffered(workflow_id, signal_name)

    def wake_workflow(self, workflow_id: str) -> None:
        """Wake the workflow's waiters after the wake-ownership check."""
        ledger = self._ledger()
        if ledger is not None:
            ledger._signals.wake(workflow_id)


class WorkflowUpdatePollTarget:
    """The :class:`~weft_sync.maintenance.UpdatePollTarget` of a ledger.

    :param ledger: returns the ledger, or ``None`` before it exists (nothing is reported then).
    """

    def __init__(self, ledger: Callable[[], Workflows | None]) -> None:
        self._ledger = ledger

    def list_held_workflow_ids(self) -> list[str]:
        """Held workflows that have an update handler registered."""
        ledger = self._ledger()
        return [] if ledger is None else ledger._updates.held_with_handlers()

    def has_pending_updates(self, workflow_id: str) -> bool:
        """Whether an update is queued (a scan; consumes nothing)."""
        ledger = self._ledger()
        return ledger is not None and ledger._updates.has_pending(workflow_id)

    def drain_pending_updates(self, workflow_id: str) -> None:
        """Deliver the queued updates to the workflow's handler; a raising handler propagates."""
        ledger = self._ledger()
        if ledger is not None:
            ledger._updates.drain(workflow_id)


class DriveContext:
    """What ``with workflows.drive(workflow_id) as ctx:`` yields: the claim's driver API.

    :param workflow_id: the workflow driven.
    :param epoch: the epoch this engine holds it at (the fencing token of its writes).
    :param workflows: the ledger to write through.
    """

    __slots__ = ("_epoch", "_workflow_id", "_workflows")

    def __init__(self, workflow_id: str, epoch: int, workflows: Workflows) -> None:
        self._workflow_id = workflow_id
        self._epoch = epoch
        self._workflows = workflows

    @property
    def workflow_id(self) -> str:
        """The workflow driven."""
        return self._workflow_id

    @property
    def epoch(self) -> int:
        """The epoch this drive holds the claim at."""
        return self._epoch

    @property
    def workflows(self) -> Workflows:
        """The ledger (fenced writes, signals, updates) of the engine driving it."""
        return self._workflows

    def checkpoint(self, data: bytes) -> None:
        """Save ``data`` as the workflow's checkpoint (a fenced write).

        :raises EngineDeposedError: this engine no longer owns the workflow.
        """
        self._workflows.save_checkpoint(self._workflow_id, data)

    def complete(self, result: Any = None) -> None:
        """Complete the workflow with ``result`` and release its claim, in one write.

        Inside ``Ownership.fenced(workflow_id, conn)`` on the store's own database, the write
        commits in the host's transaction.

        :raises EngineDeposedError: this engine no longer owns the workflow.
        """
        self._workflows.complete(self._workflow_id, result)

    def fail(self, error: Any) -> None:
        """Fail the workflow with ``error`` and release its claim, in one write (as complete).

        :raises EngineDeposedError: this engine no longer owns the workflow.
        """
        self._workflows.fail(self._workflow_id, error)

    def suspend(self) -> None:
        """Suspend the workflow (its claim ends; ``resume()`` or ``drive()`` takes it again).

        :raises EngineDeposedError: cause ``"superseded"``: this engine holds the workflow at
            a later epoch than this drive's, for another driver.
        """
        self._workflows._check_drive(self._workflow_id)
        self._workflows.suspend(self._workflow_id)

    def __repr__(self) -> str:
        return f"DriveContext({self._workflow_id!r}, epoch={self._epoch})"
