"""Wire one engine's workflow-lease ownership: gates, registry, metrics, reclaim and renewal."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..claims.arguments import positive_int
from ..claims.mode_gates import bootstrap_ownership_gates
from ..claims.registry import ClaimRegistry, WarnSink
from ..claims.renewal_target import create_renewal_target
from ..claims.store_clock import StoreClock
from ..clock import Clock
from ..codec import WorkflowRecord
from ..metrics import ClaimMetrics
from ..reclaim.discoveries import Discovery, ScanDiscovery, expiry_judge
from ..reclaim.engine_discovery import EngineIndexDiscovery
from ..reclaim.fair_share import validate_max_claims
from ..reclaim.target import EligibilityPredicate, ReclaimTargetHandle, create_reclaim_target
from ..storage.base import Storage
from .instrumentation import MetricsPassObserver
from .instrumentation import metrics_bridge as metrics_bridge
from .observer import PassObserver
from .scheduler import IntervalScheduler
from .targets import SignalPollTarget, UpdatePollTarget
from .task import PassCallback, RenewalTask
from .task_factory import create_renewal_task

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OwnershipBootstrap:
    """What :func:`bootstrap_workflow_lease_ownership` built for one engine.

    ``renewal_task.stop()`` marks ``reclaim_target`` disposing before it stops the timer, so no
    reclaim started afterwards can claim or drive a workflow.
    """

    registry: ClaimRegistry
    renewal_task: RenewalTask
    metrics: ClaimMetrics
    reclaim_target: ReclaimTargetHandle


def bootstrap_workflow_lease_ownership(
    *,
    storage: Storage,
    clock: Clock,
    claim_ttl_ms: int,
    claim_renew_interval_ms: int,
    signal_poll_target: SignalPollTarget | None = None,
    update_poll_target: UpdatePollTarget | None = None,
    on_workflow_claim_reclaimed: Callable[[str], object] | None = None,
    on_workflow_claim_reclaimed_record: Callable[[str, WorkflowRecord], object] | None = None,
    is_workflow_type_registered: EligibilityPredicate | None = None,
    scheduler: IntervalScheduler | None = None,
    on_pass_complete: PassCallback | None = None,
    warn: WarnSink | None = None,
    engine_id: str | None = None,
    skip_live_holders: bool = False,
    store_clock: StoreClock | None = None,
    metrics: ClaimMetrics | None = None,
    max_claims: int | None = None,
    fair_share: bool = False,
    observers: tuple[PassObserver, ...] = (),
    reclaim_discovery: Literal["auto", "scan"] | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> OwnershipBootstrap:
    """Run the ownership gates, then build everything one engine needs; start nothing.

    The caller starts interval mode (``renewal_task.start()``) or drives ``run_once()`` itself.

    :param on_workflow_claim_reclaimed: drives a reclaimed workflow (see the reclaim target).
    :param on_workflow_claim_reclaimed_record: the same drive, given the record the reclaim
        target's re-check just read (used instead of the first when both are given).
    :param is_workflow_type_registered: ``(type, revision) -> bool``; other workflows are never
        reclaimed by this engine.
    :param on_pass_complete: also receives every pass result, after the metrics bridge.
    :param engine_id: this engine's id; a fresh UUID when omitted.
    :param skip_live_holders: see :class:`~.reclaim_target.ReclaimTargetHandle`.
    :param store_clock: write and judge claim expiry on the store's clock (its upper and lower
        bounds) instead of ``clock``; the renewal sub-pass refreshes its offset when due.
        ``clock`` still times the gates' marker and the passes.
    :param max_claims: fair_share: see :class:`~.reclaim_target.ReclaimTargetHandle`.
    :param metrics: the engine's metrics, when the caller shares them with other parts (a
        fresh :class:`~weft_sync.metrics.ClaimMetrics` when omitted).
    :raises ValueError: a duration is not a positive int, ``engine_id`` is empty, or
        ``max_claims`` is not ``None`` or an ``int >= 1`` (checked before the store is touched).
    :param observers: more observers of the renewal task's sub-passes (e.g. tracing).
    :param reclaim_discovery: ``None`` (the full scans of every holder and running workflow,
        every pass), ``"scan"`` (the same, plus the engine records: crashed and closed engines'
        claims are taken at once) or ``"auto"`` (engine records, dead engines' index entries and
        bounded windows; see :mod:`.engine_discovery`).
    :param heartbeat: called after each renewal sub-pass (and each reclaim sub-pass that
        reclaimed something): the engine's liveness record.
    :raises TypeError: ``clock`` or ``warn`` is not callable (checked before the store is
        touched).
    :raises StorageCapabilityError: the store has no compare-and-swap (nothing is built).
    :raises OwnershipModeMismatchError: the store belongs to another ownership mode.
    :raises CorruptOwnershipMarkerError: the store's mode marker is corrupt.
    """
    # The registry validates the arguments without touching the store, so a misconfigured
    # engine fails before the gates can stamp a fresh store.
    validate_max_claims(max_claims)
    if metrics is None:
        metrics = ClaimMetrics(
            claim_ttl_ms=positive_int("claim_ttl_ms", claim_ttl_ms),
            claim_renew_interval_ms=positive_int(
                "claim_renew_interval_ms", claim_renew_interval_ms
            ),
        )
    registry = ClaimRegistry(
        storage,
        engine_id=str(uuid.uuid4()) if engine_id is None else engine_id,
        clock=clock if store_clock is None else store_clock.upper,
        claim_ttl_ms=claim_ttl_ms,
        claim_renew_interval_ms=claim_renew_interval_ms,
        warn=warn,
        metrics=metrics,
        judge_clock=None if store_clock is None else store_clock.lower,
    )
    bootstrap_ownership_gates(storage, mode="workflow-lease", clock=clock)
    renewal_target = create_renewal_target(
        registry, metrics, None if store_clock is None else store_clock.refresh
    )
    reclaim_target = create_reclaim_target(
        registry,
        storage,
        metrics,
        on_reclaimed=on_workflow_claim_reclaimed,
        is_eligible=is_workflow_type_registered,
        skip_live_holders=skip_live_holders,
        max_claims=max_claims,
        fair_share=fair_share,
        discovery=_discovery(reclaim_discovery, storage, registry, skip_live_holders),
        drive_record=on_workflow_claim_reclaimed_record,
    )
    task = create_renewal_task(
        target=renewal_target,
        clock=clock,
        interval_ms=claim_renew_interval_ms,
        scheduler=scheduler,
        reclaim_target=reclaim_target,
        signal_poll_target=signal_poll_target,
        update_poll_target=update_poll_target,
        on_pass_complete=metrics_bridge(registry, metrics, on_pass_complete, renewal_target),
        before_stop=reclaim_target.mark_disposing,
        observers=(MetricsPassObserver(metrics), *observers),
        verify_store=getattr(storage, "verify_identity", None),
        heartbeat=heartbeat,
    )
    _log.info("bootstrapped workflow-lease ownership for engine %s", registry.engine_id)
    return OwnershipBootstrap(registry, task, metrics, reclaim_target)


def _discovery(
    kind: str | None, storage: Storage, registry: ClaimRegistry, skip_live: bool
) -> Discovery | None:
    if kind is None:
        return None  # the reclaim target's own full scan, blind to engine records
    judge = expiry_judge(registry.clock, registry.claim_renew_interval_ms)
    if kind == "scan":
        return ScanDiscovery(
            storage, judge, skip_live=skip_live, engine_id=registry.engine_id, clock=registry.clock
        )
    if kind != "auto":
        raise ValueError(f"unknown reclaim_discovery={kind!r}: use 'auto', 'scan' or None")
    return EngineIndexDiscovery(
        storage,
        engine_id=registry.engine_id,
        clock=registry.clock,
        judge=judge,
        skip_live=skip_live,
    )
