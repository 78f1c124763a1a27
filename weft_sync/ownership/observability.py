"""One engine's metrics and optional tracing, and the observers that feed them.

The ``Ownership`` facade builds an :class:`Instrumentation` and hands its parts to the ledger
(fence observers) and the bootstrap (metrics, pass observers); neither lower layer imports
tracing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ledger.fenced_writes import FenceObserver
from ..maintenance.observer import PassObserver
from ..metrics import ClaimMetrics
from ..options import OwnershipOptions
from ..tracing import Tracing, resolve_tracing


@dataclass(frozen=True, slots=True)
class Instrumentation:
    """Metrics, optional tracing, and the observers wired into the ledger and the task."""

    metrics: ClaimMetrics
    tracing: Tracing | None
    fence_observers: tuple[FenceObserver, ...]
    pass_observers: tuple[PassObserver, ...]


def build_instrumentation(
    options: OwnershipOptions, engine_id: str, tracing: object
) -> Instrumentation:
    """Metrics with buckets for ``options``' timing, and tracing as ``tracing`` asks.

    :raises TypeError: ImportError: see :func:`~weft_sync.tracing.resolve_tracing`.
    """
    metrics = ClaimMetrics(
        claim_ttl_ms=options.claim_ttl_ms,
        claim_renew_interval_ms=options.claim_renew_interval_ms,
    )
    tracer = resolve_tracing(tracing, engine_id)

    def observe_latency(
        workflow_id: str, started_ns: int, seconds: float, error: BaseException | None
    ) -> None:
        metrics.observe_fenced_write(seconds)

    fence: list[FenceObserver] = [observe_latency]
    passes: list[PassObserver] = []
    if tracer is not None:
        fence.append(tracer.fenced_write)
        passes.append(tracer)
    return Instrumentation(metrics, tracer, tuple(fence), tuple(passes))
