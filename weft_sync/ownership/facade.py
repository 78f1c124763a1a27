"""The ``Ownership`` facade: the one object a host opens, claims through, and closes.

``Ownership.open(url)`` runs the ownership gates, builds the claim registry, metrics and renewal
task, and (by default) starts interval maintenance. ``claim(workflow_id)`` holds one workflow for
the length of a ``with`` block; ``close()`` stops maintenance, releases every claim and closes
the store it opened.

Threading model:

- Each ``Ownership`` has one lock guarding its lifecycle state, the live ``claim()`` handles and
  the ``on_lost`` callbacks. Registry calls, storage I/O, callbacks and logging happen outside it.
- Workflow handlers (:mod:`weft_sync.ownership.handler_table`) run on the engine's handler threads
  (:mod:`weft_sync.ownership.handler_executor`), after the reclaim pass took the claim over;
  they must not call :meth:`Ownership.close`.
- Lost claims are reported by the registry through a warning sink this object installs; the sink
  runs on whichever thread found the loss (usually a maintenance thread), marks the matching
  handle lost, calls the ``on_lost`` callbacks (their exceptions are logged, never raised into
  that thread) and then forwards the warning.
- Fork safety: the library's one fork hook (:mod:`weft_sync._fork`, registered when the first
  store or ``Ownership`` opens, never at import) resets every live ``Ownership`` in a child.
  The child forgets the parent's claims without touching the store (the parent still owns
  them), has no timer or worker pool, and can no longer use the inherited object: it opens its
  own ``Ownership``. Every public method also compares the process id, for forks that bypass
  the hook (the ledger, registry and storages too).
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar

from .. import _fork
from ..claims.registry import ClaimRegistry, WarnSink
from ..claims.results import ReleaseStatus
from ..clock import Clock, system_clock
from ..codec import WorkflowRecord
from ..errors import (
    ClosedError,
    WorkflowClaimLostError,
    WorkflowClaimLostWarning,
    WorkflowClaimUnavailableError,
)
from ..fencing.core import HostFence, open_fence_writes
from ..keys import validate_workflow_id
from ..ledger.driving import DriverTracker
from ..maintenance.targets import PassResult
from ..maintenance.task import RenewalTask
from ..metrics import ClaimMetrics
from ..options import OwnershipOptions
from ..reclaim.target import EligibilityPredicate
from ..storage import Storage
from ..workflows import Workflows
from . import prefork
from .bare_claims import ClaimAttempt, attempt_claim, claim_is_gone, claim_with_wait
from .claim_handle import ClaimHandle as ClaimHandle
from .closing import close_engine
from .engine import build_engine
from .handler_table import HandlerTable
from .opening import EngineSettings, close_quietly, resolve_storage, validate_settings

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReclaimedWorkflow:
    """A workflow this engine just took over, handed to the handler for its type.

    :param workflow_id: the workflow's id.
    :param type: its workflow type (the key its handler was registered under).
    :param epoch: the epoch this engine holds it at (the fencing token of its writes).
    :param record: its record as read right before the handler was called.
    :param ownership: this engine's ``Ownership``.
    :param workflows: the ledger to write through (``ownership.workflows``).
    """

    workflow_id: str
    type: str
    epoch: int
    record: WorkflowRecord
    ownership: Ownership
    workflows: Workflows


WorkflowHandler = Callable[[ReclaimedWorkflow], object]
"""Drives (resumes) a reclaimed workflow of one type; its return value is ignored."""

Background = Literal["thread", "manual"]
LostCallback = Callable[[str], object]
"""Called with the id of a workflow whose claim this engine lost."""
_Callback = TypeVar("_Callback", bound=LostCallback)
_Handler = TypeVar("_Handler", bound=WorkflowHandler)


class _State(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    FORKED = "inherited across fork"


class Ownership:
    """Per-workflow ownership claims over one store, for one engine (process).

    Build it with :meth:`open`. Attributes: ``storage``, ``registry``, ``workflows``,
    ``metrics``, ``engine_id``. Every method except :meth:`close` raises
    :class:`~weft_sync.errors.ClosedError` after ``close()``, and in a child process that
    inherited the object across ``os.fork()``.
    """

    def __init__(self, storage: Storage, *, owns_storage: bool, settings: EngineSettings) -> None:
        """Bootstrap on ``storage``; start nothing. Hosts call :meth:`open` instead."""
        self._storage = storage
        self._owns_storage = owns_storage
        warn = settings.warn
        self._forward_warning: WarnSink = warn if warn is not None else _warnings_warn
        self._pid = os.getpid()
        # _lock guards _state, _handles and _lost_callbacks.
        self._lock = threading.Lock()
        self._state = _State.OPEN
        self._handles: dict[str, ClaimHandle] = {}
        self._lost_callbacks: list[LostCallback] = []
        parts = build_engine(storage, settings, self._on_warning)
        workflows = parts.workflows

        def reclaimed(
            workflow_id: str, workflow_type: str, epoch: int, record: WorkflowRecord
        ) -> ReclaimedWorkflow:
            return ReclaimedWorkflow(workflow_id, workflow_type, epoch, record, self, workflows)

        parts.handlers.bind(reclaimed, workflows, parts.registry)
        self._handlers = parts.handlers
        self._workflows = parts.workflows
        self._registry: ClaimRegistry = parts.registry
        self._task: RenewalTask = parts.task
        self._metrics: ClaimMetrics = parts.metrics
        self._crash = parts.crash
        self._drivers = parts.drivers
        self._handler_executor = parts.handler_executor
        self._on_fork = settings.options.on_fork
        self._fence = HostFence(
            storage,
            self._registry,
            warn=self._on_warning,
            # fenced() checks the process itself; a drive's thread writes at its drive's epoch.
            epoch_of=self._drivers.narrowed(self._registry.epoch_lookup()),
        )
        self._workflows.bind_host_writes(lambda wid: open_fence_writes(wid, storage))
        _fork.track(self)

    # ----------------------------------------------------------------------------------------
    # Opening
    # ----------------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        url_or_storage: str | Storage,
        *,
        options: OwnershipOptions | None = None,
        handlers: Mapping[str, WorkflowHandler] | None = None,
        max_claims: int | None = None,
        on_reclaimed: Callable[[str], object] | None = None,
        is_eligible: EligibilityPredicate | None = None,
        background: Background = "thread",
        clock: Clock = system_clock,
        warn: WarnSink | None = None,
        engine_id: str | None = None,
        tracing: object = False,
    ) -> Ownership:
        """Open a store, run the ownership gates and bootstrap this engine's claims.

        :param url_or_storage: a storage URL (see :func:`~weft_sync.storage.open_storage`),
            opened here and closed by :meth:`close`; or an open ``Storage``, which ``close()``
            leaves open.
        :param options: claim timing and time source; defaults to ``OwnershipOptions()`` (TTL
            30 s, renew 5 s, the backend's time source: the database clock on PostgreSQL).
        :param handlers: workflow type -> handler. A running workflow of one of these types whose
            owner died is taken over here and its handler called with a
            :class:`ReclaimedWorkflow`, on a handler thread (see the handlers guide). More can
            be added with :meth:`handler`.
        :param max_claims: the most claims this engine holds before its reclaim passes stop
            taking over (``None``: no limit). Each pass takes at most a fair share of the
            stranded workflows anyway, so survivors share a dead engine's work.
        :param on_reclaimed: drives, by id, a reclaimed workflow of a type without a handler;
            given without ``is_eligible``, every type is reclaimed.
        :param is_eligible: ``(type, revision) -> bool`` for types without a handler. An engine
            with no handlers, no ``is_eligible`` and no ``on_reclaimed`` reclaims no workflows.
        :param background: ``"thread"`` starts interval maintenance now; ``"manual"`` leaves it
            to the host, which calls :meth:`run_maintenance` at least once per renew interval.
        :param clock: integer milliseconds since the Unix epoch; with the store time source,
            claim expiry is this clock plus the sampled offset to the database server's clock.
        :param warn: receives every warning after this object has handled it; default
            :func:`warnings.warn`.
        :param engine_id: this engine's id in holder records; a fresh UUID when omitted.
        :param tracing: ``True`` for OpenTelemetry spans on the global tracer provider, or a
            ``TracerProvider``; needs the ``otel`` extra (see :mod:`weft_sync.tracing`).
        :raises ValueError: ``background`` is not ``"thread"`` or ``"manual"``; a bad URL;
            ``max_claims`` is not ``None`` or an ``int >= 1``.
        :raises TypeError: ``options`` is not an ``OwnershipOptions``, a callback is not
            callable, ``clock()`` (read once, before the store is opened) did not return an
            ``int``, or ``url_or_storage`` is neither a URL nor a ``Storage``.
        :raises StorageCapabilityError: the store lacks a capability the mode needs (what this
            call opened is closed again).
        :raises OwnershipModeMismatchError: the store is stamped with another ownership mode
            (closed again).
        :raises CorruptOwnershipMarkerError: the store's mode stamp does not decode (closed
            again).
        """
        settings = validate_settings(
            background=background,
            options=options,
            clock=clock,
            handlers=handlers,
            max_claims=max_claims,
            on_reclaimed=on_reclaimed,
            is_eligible=is_eligible,
            warn=warn,
            engine_id=engine_id,
            tracing=tracing,
        )
        storage, owns_storage = resolve_storage(
            url_or_storage, settings.options.claim_renew_interval_ms
        )
        try:
            ownership = cls(storage, owns_storage=owns_storage, settings=settings)
        except BaseException:
            if owns_storage:
                close_quietly(storage)
            raise
        if background == "thread":
            try:
                ownership.start()
            except BaseException:
                ownership.close()
                raise
        return ownership

    # ----------------------------------------------------------------------------------------
    # Attributes
    # ----------------------------------------------------------------------------------------

    @property
    def storage(self) -> Storage:
        """The store the claims live in."""
        return self._storage

    @property
    def registry(self) -> ClaimRegistry:
        """This engine's claim registry (what it holds, at which epochs)."""
        return self._registry

    @property
    def workflows(self) -> Workflows:
        """The workflow ledger over this engine's claims (start, fenced writes, signals)."""
        return self._workflows

    @property
    def metrics(self) -> ClaimMetrics:
        """Claim attempt, active-claim, renewal-failure and handler-failure counters."""
        return self._metrics

    @property
    def handlers(self) -> HandlerTable:
        """The workflow handlers by type (register more with :meth:`handler`)."""
        return self._handlers

    def handler(self, workflow_type: str) -> Callable[[_Handler], _Handler]:
        """Register the decorated function as the handler of ``workflow_type``.

        Usable any time while open; workflows of that type are reclaimed from the next
        maintenance pass on. Returns the function unchanged.

        :raises ValueError: ``workflow_type`` is not a valid name or already has a handler.
        :raises TypeError: the decorated object is not callable.
        :raises ClosedError: after ``close()`` or in a forked child.
        """
        self._require_open("handler()")
        return self._handlers.handler(workflow_type)

    @property
    def engine_id(self) -> str:
        """This engine's id, written into every holder record it creates."""
        return self._registry.engine_id

    @property
    def started(self) -> bool:
        """Whether interval maintenance is running."""
        return self._process_state() is _State.OPEN and self._task.started

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or this object was inherited across a fork)."""
        self._ensure_process()
        return self._state is not _State.OPEN

    # ----------------------------------------------------------------------------------------
    # Maintenance
    # ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start interval maintenance (renewal, reclaim, polls every renew interval); idempotent.

        :raises ClosedError: after ``close()`` or in a forked child.
        """
        self._require_open("start()")
        self._task.start()
        self._crash.start_watching()
        if self._on_fork == "stop":
            prefork.watch(self)

    def run_maintenance(self, *, wait_handlers: float | None = None) -> PassResult:
        """Run one full maintenance pass now, on this thread, and return its result.

        Hosts opened with ``background="manual"`` call this at least once per renew interval.
        The handlers of the workflows the pass reclaimed run on the handler threads; this call
        returns once no handler is queued or running (a cron host's script can exit then),
        or after ``wait_handlers`` seconds (``0``: at once). Called from a handler, it does
        not wait.

        :param wait_handlers: the most seconds to wait for handlers; ``None``: no bound.
        :raises TypeError: ``wait_handlers`` is not ``None`` or a number.
        :raises ValueError: ``wait_handlers`` is negative, nan or infinite.
        :raises ClosedError: after ``close()`` or in a forked child.
        """
        wait_handlers = _seconds("run_maintenance()", "wait_handlers", wait_handlers)
        self._require_open("run_maintenance()")
        result = self._task.run_once()
        executor = self._handler_executor
        if wait_handlers != 0 and not executor.is_handler_thread():
            executor.wait_idle(wait_handlers)
        return result

    @property
    def drivers(self) -> DriverTracker:
        """Who drives each workflow claim this engine holds (see :mod:`.ledger.driving`)."""
        return self._drivers

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop maintenance, release every claim and close the store this object opened.

        Idempotent; a concurrent second call returns at once. Stops the timer (no reclaim
        started afterwards claims anything), waits up to ``timeout`` seconds for passes and for
        claim operations (``claim()``, ``workflows.start()``/``resume()``) in flight, joins the
        task's threads, releases every held claim (failures are logged, never raised) and
        closes the store if :meth:`open` opened it, all by that bound even under a foreign lock
        (see :mod:`weft_sync.ownership.closing`). Live ``claim()`` handles are marked lost.
        In a child that inherited this object across ``os.fork()`` it does nothing: the parent
        still owns the claims.

        :param timeout: seconds, ``>= 0``; ``None``: no bound.
        :raises TypeError: ``timeout`` is not ``None`` or a number.
        :raises ValueError: ``timeout`` is negative, nan or infinite.
        :raises RuntimeError: called from inside a maintenance pass (an ``on_lost`` callback)
            or from a workflow handler; it would wait for itself. Call it from another thread.
        """
        # Checked before anything changes: a refused timeout leaves the engine fully open.
        timeout = _seconds("close()", "timeout", timeout)
        if self._process_state() is not _State.OPEN:
            return
        if self._handler_executor.is_handler_thread():
            raise RuntimeError(
                "Ownership.close() was called from a workflow handler; close() waits for the "
                "handlers, so it would wait for itself: close it from another thread"
            )
        try:
            # Probes for re-entry from a maintenance thread before anything changes.
            self._task.wait_idle(0)
        except RuntimeError:
            raise RuntimeError(
                "Ownership.close() was called from inside a maintenance pass (an on_reclaimed "
                "or on_lost callback); it would wait for the pass it runs in: close it from "
                "another thread"
            ) from None
        with self._lock:
            if self._state is not _State.OPEN:
                return
            self._state = _State.CLOSING
            handles = list(self._handles.values())
        for handle in handles:
            handle.lost.set()
        try:
            close_engine(
                task=self._task,
                workflows=self._workflows,
                registry=self._registry,
                storage=self._storage,
                owns_storage=self._owns_storage,
                timeout=timeout,
                crash=self._crash,
                handlers=self._handler_executor,
            )
        finally:
            with self._lock:
                self._state = _State.CLOSED
                self._handles.clear()
            _fork.untrack(self)
            prefork.unwatch(self)
            _log.info("closed ownership of engine %s", self._registry.engine_id)

    def _stop_before_fork(self) -> bool:
        """This process is about to fork: stop background work here (see :mod:`.prefork`).

        Runs on the forking thread, before the fork. A fork from one of this engine's handler
        threads stops nothing. Nothing is written: the claims held are left to expire.
        """
        if self._state is not _State.OPEN or self._pid != os.getpid():
            return False
        if self._handler_executor.is_handler_thread():
            return False
        self._task.stop()
        self._crash.stop_watching(1.0)
        self._handler_executor.close(0)
        _log.warning(
            "engine %s: background maintenance stopped in process %d before a fork",
            self._registry.engine_id,
            os.getpid(),
        )
        return True

    def __enter__(self) -> Ownership:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------
    # Claims
    # ----------------------------------------------------------------------------------------

    def claim(
        self, workflow_id: str, *, wait: float | None = None
    ) -> AbstractContextManager[ClaimHandle]:
        """Hold ``workflow_id`` for the length of a ``with`` block.

        The claim is acquired, or taken over (epoch + 1) when its holder expired more than the
        takeover grace ago, so the claim of a crashed process blocks its id for at most the TTL
        plus the grace; a holder whose engine the crash probe saw crashed is taken over at once
        (a waiter wakes when the probe reports it). The block's thread is the claim's driver.
        With ``wait``, attempts repeat with jittered delays for up to ``wait``
        seconds (leader election for a cron job: ``claim("nightly", wait=60)``).

        On exit the claim is released (only at the handle's epoch, so a newer generation of the
        same id survives). If the claim was lost inside the block and the block did not raise,
        exit raises :class:`~weft_sync.errors.WorkflowClaimLostError`; an exception raised by
        the block always propagates unchanged.

        :param wait: seconds to keep trying; ``None`` (default) or ``0`` tries once.
        :raises WorkflowClaimUnavailableError: another engine holds a live claim, or a
            ``claim()`` block of this object already holds it (``held_by`` names the holder),
            and ``wait`` ran out.
        :raises TypeError: ``wait`` is not ``None`` or a number.
        :raises ValueError: ``wait`` is negative, nan or infinite.
        :raises ClosedError: after ``close()`` or in a forked child.
        """
        return _ClaimBlock(self, workflow_id, wait)

    def fenced(self, workflow_id: str, connection: object) -> AbstractContextManager[Any]:
        """Fence the host's statements on ``connection`` (:func:`~.fencing.fenced_transaction`)."""
        # Read without _lock: this is on the path of every fenced host write, and a close()
        # racing it leaves the registry without claims, so the block is refused as deposed.
        if self._state is not _State.OPEN or self._pid != os.getpid():
            self._require_open("fenced()")
        return self._fence.block(workflow_id, connection)

    def on_lost(self, callback: _Callback) -> _Callback:
        """Call ``callback(workflow_id)`` whenever this engine finds one of its claims lost.

        A loss is found by a renewal, by a fenced write of :attr:`workflows` that lost its epoch
        fence, or by a ``claim()`` block's release; each report calls every callback once. It
        runs on the thread that found the loss (usually a maintenance thread); an exception it
        raises is logged and ignored. Returns ``callback``, so it also works as a decorator.

        :raises TypeError: ``callback`` is not callable.
        :raises ClosedError: after ``close()`` or in a forked child.
        """
        if not callable(callback):
            raise TypeError(f"on_lost() needs a callable taking a workflow id, got {callback!r}")
        self._require_open("on_lost()")
        with self._lock:
            self._lost_callbacks.append(callback)
        return callback

    def _acquire(self, workflow_id: str, wait_s: float | None) -> ClaimHandle:
        wid = validate_workflow_id(workflow_id)
        if not wait_s:
            self._require_open("claim()")
            result = self._attempt_claim(wid)
        else:
            result = self._attempt_with_wait(wid, wait_s)
        if result.epoch is None:
            raise WorkflowClaimUnavailableError(
                wid, result.held_by, held_here=self._holds_here(wid, result.held_by)
            )
        handle = ClaimHandle(wid, result.epoch, self._verify_held, token=result.token)
        with self._lock:
            state = self._state
            if state is _State.OPEN:
                self._handles[wid] = handle
        if state is not _State.OPEN:
            # close() began while acquiring and may already have released everything.
            if state is not _State.FORKED:
                try:
                    self._registry.release(wid, expected_epoch=result.epoch)
                except Exception:
                    _log.warning("could not release the claim on workflow %r", wid, exc_info=True)
            raise self._closed_error("claim()", state)
        return handle

    def _attempt_with_wait(self, wid: str, wait_s: float) -> ClaimAttempt:
        crash = self._crash
        # Crashes noted when the last attempt began: one noted during it ends the next pause.
        seen = 0

        def attempt() -> ClaimAttempt:
            nonlocal seen
            seen = crash.death_count()
            return self._attempt_claim(wid)

        return claim_with_wait(
            attempt,
            wait_s,
            lambda: self._require_open("claim()"),
            sleep=lambda pause: crash.wait_for_death(pause, seen),
        )

    def _attempt_claim(self, wid: str) -> ClaimAttempt:
        with self._lock:
            busy = wid in self._handles
        if busy:
            return ClaimAttempt(None, self._registry.engine_id)
        return attempt_claim(self._registry, self._metrics, wid, self._crash.dead_engines)

    def _holds_here(self, wid: str, held_by: str | None) -> bool:
        """Whether this engine itself holds ``wid`` (a ``claim()`` block or a workflow)."""
        if held_by != self._registry.engine_id:
            return False
        # An engine id given to open() may be a crashed predecessor's: its holder is not ours.
        with self._lock:
            if wid in self._handles:
                return True
        return self._registry.current_epoch(wid) is not None

    def _finish(self, handle: ClaimHandle, *, body_failed: bool) -> None:
        wid = handle.workflow_id
        try:
            if self._process_state() is _State.OPEN:
                self._release(handle, body_failed=body_failed)
        finally:
            with self._lock:
                # Marked before it leaves _handles: assert_held() sees it either held or released.
                handle._mark_released()
                if self._handles.get(wid) is handle:
                    del self._handles[wid]
        if handle.lost.is_set() and not body_failed:
            raise WorkflowClaimLostError(wid)

    def _release(self, handle: ClaimHandle, *, body_failed: bool) -> None:
        wid = handle.workflow_id
        try:
            result = self._registry.release(wid, expected_epoch=handle.epoch)
        except Exception:
            if not body_failed:
                raise
            # The block's own exception is the one the caller needs to see.
            _log.warning("could not release the claim on workflow %r", wid, exc_info=True)
            return
        # Another writer replaced the claim; report it unless a renewal or fence already did.
        if result.status is ReleaseStatus.LOST_RACE and self._mark_lost(handle):
            self._notify_lost(wid)

    def _mark_lost(self, handle: ClaimHandle) -> bool:
        """Set ``handle.lost``; return whether this call set it."""
        with self._lock:
            if handle.lost.is_set():
                return False
            handle.lost.set()
            return True

    def _verify_held(self, handle: ClaimHandle) -> bool:
        """Whether ``handle``'s claim is still held; marks it lost when the registry dropped it.

        A handle whose block has exited is not held but not lost either: it was released.
        """
        self._ensure_process()
        with self._lock:
            active = self._handles.get(handle.workflow_id) is handle
        if not active:
            return False
        # Also gives the claim up once its local renew deadline passed without a renewal.
        if not self._registry.confirm_held(handle.workflow_id, handle.epoch):
            self._mark_lost(handle)
            return False
        return True

    # ----------------------------------------------------------------------------------------
    # Lost-claim reporting
    # ----------------------------------------------------------------------------------------

    def _on_warning(self, warning: Warning) -> None:
        """The registry's warning sink: mark the handle, run callbacks, forward the warning."""
        if isinstance(warning, WorkflowClaimLostWarning):
            wid = warning.workflow_id
            with self._lock:
                handle = self._handles.get(wid)
            if handle is not None and claim_is_gone(self._registry, handle):
                self._mark_lost(handle)
            try:
                self._notify_lost(wid)
            finally:
                self._forward_warning(warning)
            return
        self._forward_warning(warning)

    def _notify_lost(self, workflow_id: str) -> None:
        """Call every ``on_lost`` callback; an ``Exception`` is logged and ignored, and a
        ``BaseException`` (``SystemExit``, ...) is raised once every callback has run."""
        with self._lock:
            callbacks = list(self._lost_callbacks)
        interrupted: BaseException | None = None
        for callback in callbacks:
            try:
                callback(workflow_id)
            except Exception:
                _log.exception(
                    "on_lost callback %r raised for workflow %r; ignored", callback, workflow_id
                )
            except BaseException as exc:
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted

    # ----------------------------------------------------------------------------------------
    # Lifecycle checks and fork safety
    # ----------------------------------------------------------------------------------------

    def _process_state(self) -> _State:
        self._ensure_process()
        with self._lock:
            return self._state

    def _require_open(self, what: str) -> None:
        state = self._process_state()
        if state is not _State.OPEN:
            raise self._closed_error(what, state)

    def _closed_error(self, what: str, state: _State) -> ClosedError:
        if state is _State.FORKED:
            return ClosedError(
                f"Ownership.{what} was called in process {os.getpid()}, which inherited this "
                f"Ownership (engine {self._registry.engine_id}) from process {self._pid} across "
                f"os.fork(); it holds no claims here and cannot be used: open a new Ownership "
                f"in the child process"
            )
        return ClosedError(
            f"Ownership.{what} was called after close() (engine {self._registry.engine_id}); "
            f"open a new Ownership to claim workflows again"
        )

    def _ensure_process(self) -> None:
        # Covers forks that bypass os.register_at_fork handlers.
        if self._pid != os.getpid() and self._state in (_State.OPEN, _State.CLOSING):
            self._after_fork_in_child()

    def _after_fork_in_child(self) -> None:
        """Make an inherited object inert: forget claims and threads, touch nothing shared."""
        # A parent thread may have held the lock at fork time; only this thread exists now.
        self._lock = threading.Lock()
        handles = list(self._handles.values())
        self._handles.clear()
        self._lost_callbacks.clear()
        self._state = _State.FORKED
        self._task._after_fork_in_child()
        # Empties the inherited registry without storage I/O (the parent owns those claims).
        self._registry._after_fork_in_child()
        reset_ledger = getattr(self._workflows, "_after_fork_in_child", None)
        if callable(reset_ledger):
            reset_ledger()
        for handle in handles:
            handle._lose_in_child()
        _fork.untrack(self)

    def __repr__(self) -> str:
        return (
            f"Ownership(engine_id={self._registry.engine_id!r}, {self._state.value}, "
            f"claims={len(self._handles)})"
        )


class _ClaimBlock:
    """The ``with`` block of :meth:`Ownership.claim` (a class, not a generator: every claim
    enters one): acquires on entry, releases on exit."""

    __slots__ = ("_handle", "_ownership", "_wait", "_workflow_id")

    def __init__(self, ownership: Ownership, workflow_id: str, wait: float | None) -> None:
        self._ownership = ownership
        self._workflow_id = workflow_id
        self._wait = wait
        self._handle: ClaimHandle | None = None

    def __enter__(self) -> ClaimHandle:
        if self._handle is not None:
            raise RuntimeError(
                f"the claim() block of workflow {self._workflow_id!r} was entered twice; "
                f"call claim() once per with statement"
            )
        wait = _seconds("claim()", "wait", self._wait)
        handle = self._ownership._acquire(self._workflow_id, wait)
        self._handle = handle
        return handle

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        handle = self._handle
        assert handle is not None, "__exit__ without a successful __enter__"
        # An exception of the block propagates unchanged (None: not suppressed).
        self._ownership._finish(handle, body_failed=exc_type is not None)


def _seconds(method: str, name: str, value: object) -> float | None:
    """Return the argument ``name`` of ``method`` as seconds, or ``None`` for no bound.

    :raises TypeError: ``value`` is not ``None`` or a real number (a ``bool`` is refused).
    :raises ValueError: ``value`` is negative, nan or infinite.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"Ownership.{method}: {name} must be a number of seconds >= 0 or None, got "
            f"{type(value).__name__} {value!r:.80}"
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(
            f"Ownership.{method}: {name} must be a finite number of seconds >= 0 or None, got "
            f"{value!r}"
        )
    return seconds


def _warnings_warn(warning: Warning) -> None:
    # Points into the library code that found the loss rather than at this sink.
    warnings.warn(warning, stacklevel=4)
