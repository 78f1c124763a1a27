"""Workflow handlers: which reclaimed workflows this engine can drive, and how it drives them.

A host registers one handler per workflow type (``Ownership.open(..., handlers={type: fn})`` or
``@ownership.handler(type)``). When this engine's reclaim pass takes over a running workflow whose
owner died, :meth:`HandlerTable.drive` calls the handler for the workflow's type with a
:class:`ReclaimedWorkflow`. By then the registry already holds the claim at ``epoch``, so fenced
writes through ``ctx.workflows`` succeed, and a deposed former owner's writes are refused.

Eligibility (:meth:`HandlerTable.is_eligible`, the predicate the reclaim target sees) follows one
rule: an engine reclaims a workflow record only when it can drive it, that is when

1. it has a handler for the record's type; or else
2. an explicit ``is_eligible(type, revision)`` says yes; or else
3. an ``on_reclaimed(workflow_id)`` callback was given (it drives every type).

An engine with none of the three reclaims no workflow records at all: taking over work nobody
here drives would strand it.

Threading: handlers run on the engine's handler executor
(:mod:`weft_sync.ownership.handler_executor`: ``OwnershipOptions(handler_workers=4)`` threads of
their own, never a maintenance thread), so a slow or hung handler delays no renewal, reclaim or
poll. A handler may write through ``ctx.workflows`` and call any method of ``ctx.ownership`` except
``close()``.

A handler is its workflow's driver while it runs (:mod:`weft_sync.ledger.driving`): it should
finish the workflow (``complete``/``fail``/``suspend``). A handler that raises (logged and
counted in ``weft_workflow_claim_handler_failures_total{type}``) releases the claim at once; one
that returns without finishing hands it on (host code it gave the id to may enter
``workflows.drive()``) and the claim is released when no driver came within one renew interval.
Either way the next reclaim pass drives the workflow again, after a backoff, up to
``handler_max_attempts`` unfinished drives on this engine; then the workflow is failed with the
last error. A redriven workflow starts again from its checkpoint: handlers must be idempotent
up to it, as after any takeover. A handler running past ``handler_stuck_after`` is warned about
once and counted in ``weft_workflow_claim_handler_stuck_total{type}``; it keeps its claim.

The table has one lock, guarding its handler map; handlers, storage reads and logging run
outside it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Final, TypeVar

from ..claims.registry import ClaimRegistry
from ..codec import WorkflowRecord
from ..errors import WorkflowClaimUnavailableError
from ..ledger.driving import DriverTracker
from ..ledger.records import validate_name
from ..metrics import ClaimMetrics
from ..reclaim.target import EligibilityPredicate
from .handler_executor import HandlerExecutor

if TYPE_CHECKING:
    from ..tracing import Tracing
    from ..workflows import Workflows

_log = logging.getLogger(__name__)

_KEPT_FAILURES: Final = 500


Handler = Callable[[Any], object]
"""A handler as the table keeps it: called with the engine's ``ReclaimedWorkflow``."""

ContextFactory = Callable[[str, str, int, WorkflowRecord], object]
"""``(workflow_id, type, epoch, record) -> the object a handler is called with``."""

_Handler = TypeVar("_Handler", bound=Handler)


def validate_handlers(handlers: object) -> None:
    """Check a ``handlers`` argument: ``None`` or a mapping of type names to callables.

    :raises TypeError: not a mapping, or a handler is not callable.
    :raises ValueError: a workflow type is not a valid name.
    """
    if handlers is None:
        return
    if not isinstance(handlers, Mapping):
        raise TypeError(
            f"handlers must be a mapping of workflow type to handler, got "
            f"{type(handlers).__name__} {handlers!r:.80}"
        )
    for workflow_type, handler in handlers.items():
        _check_handler(workflow_type, handler)


def _check_handler(workflow_type: object, handler: object) -> None:
    validate_name("workflow type", workflow_type)
    if not callable(handler):
        raise TypeError(
            f"the handler for workflow type {workflow_type!r} must be callable with a "
            f"ReclaimedWorkflow, got {handler!r:.80}"
        )


class HandlerTable:
    """Workflow type -> handler for one engine, with the eligibility rule and the dispatch.

    :param handlers: initial handlers by workflow type.
    :param on_reclaimed: drives reclaimed workflows of types without a handler.
    :param is_eligible: ``(type, revision) -> bool`` for types without a handler.
    :param metrics: counts each workflow reclaimed (its first drive at an epoch), each drive
        that returned, each drive again after a failure, and each handler call that raised.
    :param tracing: records a ``weft_sync.takeover`` span around each drive.
    :raises TypeError: ``handlers`` is not a mapping, or a handler is not callable.
    :raises ValueError: a workflow type is not a valid name.
    """

    def __init__(
        self,
        handlers: Mapping[str, Handler] | None,
        *,
        on_reclaimed: Callable[[str], object] | None,
        is_eligible: EligibilityPredicate | None,
        metrics: ClaimMetrics,
        tracing: Tracing | None = None,
    ) -> None:
        validate_handlers(handlers)
        self._on_reclaimed = on_reclaimed
        self._is_eligible = is_eligible
        self._metrics = metrics
        self._tracing = tracing
        # _lock guards _handlers, _bound, _drivers, _executor, _failures (what the handler calls
        # raised since take_failures() last took them) and _failed_at (the epoch of each
        # workflow whose last handler call raised: its next drive is a redrive).
        self._lock = threading.Lock()
        self._handlers: dict[str, Handler] = {}
        self._failed_at: dict[str, int] = {}
        self._failures: dict[str, Exception] = {}
        self._bound: tuple[ContextFactory, Workflows, ClaimRegistry] | None = None
        self._drivers: DriverTracker | None = None
        self._executor: HandlerExecutor | None = None
        for workflow_type, handler in (handlers or {}).items():
            self.register(workflow_type, handler)

    def bind(self, context: ContextFactory, workflows: Workflows, registry: ClaimRegistry) -> None:
        """Bind the engine the handlers act for; the facade calls it once, when it is built.

        :param context: builds what a handler is called with (the facade's ``ReclaimedWorkflow``).
        """
        with self._lock:
            self._bound = (context, workflows, registry)

    def register(self, workflow_type: str, handler: Handler) -> None:
        """Drive reclaimed workflows of ``workflow_type`` with ``handler`` from now on.

        :raises TypeError: ``handler`` is not callable, or ``workflow_type`` is not a ``str``.
        :raises ValueError: ``workflow_type`` is not a valid name, or already has a handler.
        """
        _check_handler(workflow_type, handler)
        with self._lock:
            existing = self._handlers.get(workflow_type)
            if existing is None:
                self._handlers[workflow_type] = handler
        if existing is not None:
            raise ValueError(
                f"workflow type {workflow_type!r} already has a handler ({existing!r:.80}); "
                f"one type has one handler"
            )

    def handler(self, workflow_type: str) -> Callable[[_Handler], _Handler]:
        """Decorator form of :meth:`register`; returns the function unchanged.

        :raises ValueError: TypeError: as :meth:`register` (the type is checked at once).
        """
        validate_name("workflow type", workflow_type)

        def decorate(handler: _Handler) -> _Handler:
            self.register(workflow_type, handler)
            return handler

        return decorate

    def get(self, workflow_type: str) -> Handler | None:
        """The handler registered for ``workflow_type``, or ``None``."""
        with self._lock:
            return self._handlers.get(workflow_type)

    def types(self) -> list[str]:
        """The workflow types that have a handler, sorted."""
        with self._lock:
            return sorted(self._handlers)

    def is_eligible(self, workflow_type: str, revision: str | None) -> bool:
        """Whether this engine can drive a workflow of ``workflow_type`` (the rule above)."""
        if self.get(workflow_type) is not None:
            return True
        if self._is_eligible is not None:
            return bool(self._is_eligible(workflow_type, revision))
        return self._on_reclaimed is not None

    def drive(self, workflow_id: str, record: WorkflowRecord | None = None) -> None:
        """Hand a workflow the reclaim target just claimed to its driver; return at once.

        Called on the maintenance thread that reclaimed it: the handler (else ``on_reclaimed``)
        is queued on the handler executor and runs there. Nothing is queued when the claim or
        the running record is gone by now (whoever changed it drives that generation). A type
        eligible only through ``is_eligible`` is driven by the host, in ``workflows.drive()``:
        its claim awaits that driver for one renew interval (see
        :mod:`weft_sync.ledger.driving`), as does one handed to ``on_reclaimed``.

        :param record: the record the reclaim target's re-check read after it won the claim;
            read here when not given.
        :raises ClosedError: the engine is closing (the claim is released with the others).
        """
        with self._lock:
            bound = self._bound
        if bound is None:
            raise RuntimeError("the handler table is not bound to an Ownership yet")
        _context, workflows, registry = bound
        epoch = registry.current_epoch(workflow_id)
        if record is None:
            record = workflows.get(workflow_id)
        if epoch is None or record is None or record.status != "running":
            _log.debug(
                "reclaimed workflow %r is no longer ours or running; not driven", workflow_id
            )
            return
        drivers, _ = self._runtime()
        handler = self.get(record.type)
        if handler is None and self._on_reclaimed is None:
            drivers.expect(workflow_id, epoch)
            return
        self._queue(workflow_id, epoch, record, handler, reclaimed=True)

    def offer(self, workflow_id: str) -> bool:
        """Queue the handler for a workflow this engine claimed with ``start()``/``resume()``
        and nobody drove within the grace (the driver check calls it); return at once.

        :returns: whether a handler run was queued: ``False`` when the claim or the running
            record is gone, or the workflow's type has no handler here.
        :raises ClosedError: the engine is closing.
        """
        with self._lock:
            bound = self._bound
        if bound is None:
            return False
        _context, workflows, registry = bound
        epoch = registry.current_epoch(workflow_id)
        if epoch is None:
            return False
        record = workflows.get(workflow_id)
        if record is None or record.status != "running":
            return False
        handler = self.get(record.type)
        if handler is None:
            return False
        self._queue(workflow_id, epoch, record, handler, reclaimed=False)
        return True

    def _queue(
        self,
        workflow_id: str,
        epoch: int,
        record: WorkflowRecord,
        handler: Handler | None,
        *,
        reclaimed: bool,
    ) -> None:
        """Queue one drive of the claim at ``epoch`` on the handler executor; ``reclaimed``:
        the reclaim target took it (counted as reclaimed), else this engine started it."""
        with self._lock:
            bound = self._bound
        assert bound is not None
        context, _workflows, registry = bound
        drivers, executor = self._runtime()
        drivers.expect(workflow_id, epoch, queued=True)
        if reclaimed:
            self._count_start(workflow_id, record.type, epoch)
        ctx = context(workflow_id, record.type, epoch, record)
        wtype = record.type
        executor.submit(
            workflow_id,
            wtype,
            lambda: self._run(workflow_id, wtype, epoch, registry, ctx, handler),
        )

    def bind_runtime(self, drivers: DriverTracker, executor: HandlerExecutor) -> None:
        """Bind the driver tracker and the handler executor (the engine builder calls it)."""
        with self._lock:
            self._drivers = drivers
            self._executor = executor

    def take_failures(self) -> dict[str, Exception]:
        """What handler calls raised since the last call, by workflow id (the first few hundred);
        ``maintain --once`` reports them."""
        with self._lock:
            failures, self._failures = self._failures, {}
        return failures

    def _runtime(self) -> tuple[DriverTracker, HandlerExecutor]:
        with self._lock:
            drivers, executor = self._drivers, self._executor
        if drivers is None or executor is None:
            raise RuntimeError("the handler table has no handler executor bound yet")
        return drivers, executor

    def _run(
        self,
        wid: str,
        wtype: str,
        epoch: int,
        registry: ClaimRegistry,
        reclaimed: object,
        handler: Handler | None,
    ) -> None:
        """One drive on a handler thread: the handler is the claim's driver while it runs."""
        drivers, _ = self._runtime()
        if registry.current_epoch(wid) != epoch:
            _log.debug("workflow %r changed hands before its handler ran; not driven", wid)
            return
        if handler is None:
            # on_reclaimed hands the id to the host, which drives it in workflows.drive(): the
            # claim awaits that driver as after start(); a callback that raises gives it back.
            assert self._on_reclaimed is not None
            drivers.expect(wid, epoch)  # from now on it awaits the host's drive()
            try:
                with self._span(wid, wtype, epoch):
                    self._on_reclaimed(wid)
            except Exception as exc:
                self._metrics.record_handler_failure(wtype)
                _log.exception("on_reclaimed raised on workflow %r (epoch %d)", wid, epoch)
                with contextlib.suppress(RuntimeError):  # the host's drive() has it already
                    drivers.leave(drivers.enter(wid, epoch, "on_reclaimed callback"), exc)
            return
        try:
            driving = drivers.driving(wid, epoch, "handler", hand_off=True)
            driving.__enter__()
        except WorkflowClaimUnavailableError:
            # Host code of this engine drives it already (it entered drive() meanwhile).
            _log.debug("workflow %r is driven here already; its handler is not called", wid)
            return
        try:
            with contextlib.ExitStack() as stack:
                stack.push(driving)
                stack.enter_context(self._span(wid, wtype, epoch))
                handler(reclaimed)
        except Exception as exc:
            with self._lock:
                self._failed_at[wid] = epoch
                if len(self._failures) < _KEPT_FAILURES:
                    self._failures[wid] = exc
            self._metrics.record_handler_failure(wtype)
            _log.exception(
                "handler for workflow type %r raised on workflow %r (epoch %d); its claim is "
                "released for a redrive",
                wtype,
                wid,
                epoch,
            )
            return
        with self._lock:
            self._failed_at.pop(wid, None)
        self._metrics.record_driven(wtype)

    def _count_start(self, workflow_id: str, workflow_type: str, epoch: int) -> None:
        """Count a first drive as reclaimed, a drive after a failed one as a redrive."""
        with self._lock:
            redrive = workflow_id in self._failed_at
        if not redrive:
            self._metrics.record_reclaimed(workflow_type)

    def _span(
        self, workflow_id: str, workflow_type: str, epoch: int
    ) -> AbstractContextManager[None]:
        if self._tracing is None:
            return contextlib.nullcontext()
        return self._tracing.takeover(workflow_id, workflow_type, epoch)

    def __repr__(self) -> str:
        return f"HandlerTable(types={self.types()})"
