"""Build one engine's parts from validated settings: the ledger, registry, task and handlers.

The ``Ownership`` facade calls :func:`build_engine` and keeps the parts; the order matters and is
written down once here. The renewal task needs the ledger's poll targets when the bootstrap
builds it, and the ledger needs the registry the bootstrap creates, so the ledger is bound
afterwards; the handler table is bound by the facade, which it hands to handlers.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ..claims.registry import ClaimRegistry, WarnSink
from ..claims.store_clock import resolve_store_clock
from ..ledger.driving import DriverTracker
from ..maintenance.bootstrap import bootstrap_workflow_lease_ownership
from ..maintenance.targets import PassKind, PassResult
from ..maintenance.task import RenewalTask
from ..metrics import ClaimMetrics
from ..reclaim.crash_detection import CrashDetection, build_crash_detection
from ..storage import Storage
from ..workflows import Workflows
from .handler_executor import HandlerExecutor
from .handler_table import HandlerTable
from .observability import build_instrumentation
from .opening import EngineSettings


@dataclass(frozen=True, slots=True)
class EngineParts:
    """Everything one engine runs on; built by :func:`build_engine`, started by nobody yet."""

    handlers: HandlerTable
    workflows: Workflows
    registry: ClaimRegistry
    task: RenewalTask
    metrics: ClaimMetrics
    crash: CrashDetection
    drivers: DriverTracker
    handler_executor: HandlerExecutor


def build_engine(storage: Storage, settings: EngineSettings, warn: WarnSink) -> EngineParts:
    """Run the gates on ``storage`` and build the engine; start nothing.

    :param warn: the sink every claim-lost and wake-discarded warning goes to.
    :raises StorageCapabilityError: OwnershipModeMismatchError: CorruptOwnershipMarkerError:
        the gates refused the store.
    """
    engine_id = str(uuid.uuid4()) if settings.engine_id is None else settings.engine_id
    instruments = build_instrumentation(settings.options, engine_id, settings.tracing)
    metrics = instruments.metrics
    table = HandlerTable(
        settings.handlers,
        on_reclaimed=settings.on_reclaimed,
        is_eligible=settings.is_eligible,
        metrics=metrics,
        tracing=instruments.tracing,
    )
    workflows = Workflows(
        storage,
        None,
        clock=settings.clock,
        warn=warn,
        metrics=metrics,
        fence_observers=instruments.fence_observers,
    )
    options = settings.options
    heartbeat = _Heartbeat()
    after_pass = _Heartbeat()
    boot = bootstrap_workflow_lease_ownership(
        storage=storage,
        clock=settings.clock,
        claim_ttl_ms=options.claim_ttl_ms,
        claim_renew_interval_ms=options.claim_renew_interval_ms,
        signal_poll_target=workflows.signal_poll_target,
        update_poll_target=workflows.update_poll_target,
        on_workflow_claim_reclaimed=table.drive,
        on_workflow_claim_reclaimed_record=table.drive,
        is_workflow_type_registered=table.is_eligible,
        warn=warn,
        engine_id=engine_id,
        store_clock=resolve_store_clock(storage, options.time_source, settings.clock),
        metrics=metrics,
        observers=instruments.pass_observers,
        max_claims=settings.max_claims,
        fair_share=True,
        reclaim_discovery=options.reclaim_discovery,
        heartbeat=heartbeat,
        on_pass_complete=lambda result: _after_renewal(result, after_pass),
    )
    workflows.bind_registry(boot.registry)
    drivers = DriverTracker(
        boot.registry,
        metrics,
        max_attempts=options.handler_max_attempts,
        dispose=workflows.fail,
    )
    executor = HandlerExecutor(
        options.handler_workers,
        engine_id=engine_id,
        clock=settings.clock,
        stuck_after_ms=options.handler_stuck_after_ms,
        metrics=metrics,
    )
    workflows.bind_drivers(drivers)
    table.bind_runtime(drivers, executor)
    drivers.bind_offer(table.offer)
    boot.reclaim_target.set_deferral(drivers.deferred)
    crash = build_crash_detection(
        storage,
        engine_id=engine_id,
        clock=boot.registry.clock,
        claim_ttl_ms=options.claim_ttl_ms,
        claim_renew_interval_ms=options.claim_renew_interval_ms,
        poll_ms=options.crash_poll_interval_ms,
        request_reclaim=boot.renewal_task.request_reclaim,
        held_count=lambda: len(boot.registry.list_held_workflow_ids()),
        watching=settings.background == "thread",
        undriven=drivers.undriven_claims,
    )
    heartbeat.sinks = (crash.beat,)
    after_pass.sinks = (drivers.check, executor.check_stuck)
    return EngineParts(
        table, workflows, boot.registry, boot.renewal_task, boot.metrics, crash, drivers, executor
    )


def _after_renewal(result: PassResult, checks: _Heartbeat) -> None:
    # The driver and stuck-handler checks run once per renewal (a full pass or a renewal slot).
    if result.kind in (PassKind.FULL, PassKind.RENEWAL):
        checks()


class _Heartbeat:
    """Hooks bound once their parts exist (the engine record's beat after each renewal; the
    driver and stuck-handler checks after each pass). Each runs even when one before raised."""

    def __init__(self) -> None:
        self.sinks: tuple[Callable[[], object], ...] = ()

    def __call__(self) -> None:
        failure: BaseException | None = None
        for sink in self.sinks:
            try:
                sink()
            except Exception as exc:
                failure = exc
        if failure is not None:
            raise failure
