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

from .claims.registry import ClaimRegistry, WarnSink
from .claims.store_clock import resolve_store_clock
from .crash_detection import CrashDetection, build_crash_detection
from .handlers import HandlerTable
from .maintenance.bootstrap import bootstrap_workflow_lease_ownership
from .maintenance.task import RenewalTask
from .metrics import ClaimMetrics
from .observability import build_instrumentation
from .opening import EngineSettings
from .storage import Storage
from .workflows import Workflows

__all__ = ["EngineParts", "build_engine"]


@dataclass(frozen=True, slots=True)
class EngineParts:
    """Everything one engine runs on; built by :func:`build_engine`, started by nobody yet."""

    handlers: HandlerTable
    workflows: Workflows
    registry: ClaimRegistry
    task: RenewalTask
    metrics: ClaimMetrics
    crash: CrashDetection


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
    )
    workflows.bind_registry(boot.registry)
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
    )
    heartbeat.sink = crash.beat
    return EngineParts(table, workflows, boot.registry, boot.renewal_task, boot.metrics, crash)


class _Heartbeat:
    """The renewal task's after-renewal hook, bound to the engine record once it exists."""

    def __init__(self) -> None:
        self.sink: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.sink is not None:
            self.sink()
