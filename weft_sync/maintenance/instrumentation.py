"""Turn maintenance results into claim metrics: sub-pass durations, skipped ticks, margin, backlog.

:class:`MetricsPassObserver` is the renewal task's observer for :class:`~weft_sync.metrics.
ClaimMetrics`; :func:`metrics_bridge` is the pass sink that updates the gauges after each pass.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol

from ..claims.registry import ClaimRegistry
from ..metrics import SUBPASSES, ClaimMetrics
from .targets import PassKind, PassResult, ReclaimOutcomeStatus, ReclaimPassResult, RenewalStatus
from .task import PassCallback

# Outcomes after which the candidate is no longer stranded as far as this engine can tell: taken
# over here, won by another engine, or not this engine's to drive.
_SETTLED = frozenset(
    {
        ReclaimOutcomeStatus.RECLAIMED,
        ReclaimOutcomeStatus.LOST_RACE,
        ReclaimOutcomeStatus.NOT_ELIGIBLE,
    }
)


class PassMarginSource(Protocol):
    """What tracks the smallest expiry of a renewal pass (the registry's renewal target)."""

    def finish_pass(self) -> None:
        """Publish the pass's expiry margin and start a new pass."""


class MetricsPassObserver:
    """Observes sub-pass durations and skipped ticks into ``metrics``."""

    def __init__(self, metrics: ClaimMetrics) -> None:
        self._metrics = metrics

    @contextlib.contextmanager
    def observe(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            if name in SUBPASSES:
                self._metrics.observe_pass(name, time.perf_counter() - started)

    def tick_skipped(self, subpass: str) -> None:
        if subpass in SUBPASSES:
            self._metrics.record_skipped_tick(subpass)


def reclaim_backlog(result: ReclaimPassResult) -> tuple[int, int]:
    """``(candidates, backlog)`` of one reclaim pass.

    The backlog counts candidates that ended neither reclaimed here, nor won by another engine,
    nor ineligible here: errors, cooldowns, and any the pass deferred.
    """
    candidates = len(result.outcomes)
    settled = sum(1 for outcome in result.outcomes if outcome.status in _SETTLED)
    return candidates, candidates - settled


def metrics_bridge(
    registry: ClaimRegistry,
    metrics: ClaimMetrics,
    then: PassCallback | None = None,
    margins: PassMarginSource | None = None,
) -> PassCallback:
    """Return a pass sink that updates the failure counter and the gauges after each pass.

    Counts failed renewals, sets the active-claims gauge, the expiry margin (after a renewal,
    from ``margins``) and the reclaim candidates and backlog (after a reclaim).

    :param then: another sink called afterwards with the same result.
    """

    def on_pass_complete(result: PassResult) -> None:
        for outcome in result.outcomes:
            if outcome.status is RenewalStatus.FAILED:
                metrics.record_claim_renewal_failure()
        metrics.set_active_claims(len(registry.list_held_workflow_ids()))
        if margins is not None and result.kind in (PassKind.FULL, PassKind.RENEWAL):
            margins.finish_pass()
        if result.reclaim is not None:
            metrics.set_reclaim_backlog(*reclaim_backlog(result.reclaim))
        if then is not None:
            then(result)

    return on_pass_complete
