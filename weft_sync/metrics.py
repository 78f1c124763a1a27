"""Claim metrics: attempt counters by outcome, an active-claims gauge, renewal and handler failures.

Workflow ids are never labels (their number is unbounded); the labels are the attempt outcome,
drawn from the closed set :data:`CLAIM_ATTEMPT_OUTCOMES`, and the workflow type of a failed
handler (types are named in code, so their number is bounded). :func:`serialize_prometheus`
renders a snapshot in the Prometheus text format without any dependency;
:func:`register_prometheus` exposes the same families through ``prometheus_client`` when the
``prometheus`` extra is installed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "CLAIM_ATTEMPT_OUTCOMES",
    "CLAIM_LOSS_CAUSES",
    "ClaimAttemptOutcome",
    "ClaimLossCause",
    "ClaimMetricsCollector",
    "ClaimMetrics",
    "MetricsSnapshot",
    "register_prometheus",
    "serialize_prometheus",
]

ClaimAttemptOutcome = Literal["acquired", "takeover", "lost_race", "deposed", "backoff_skipped"]

CLAIM_ATTEMPT_OUTCOMES: Final[tuple[ClaimAttemptOutcome, ...]] = (
    "acquired",
    "takeover",
    "lost_race",
    "deposed",
    "backoff_skipped",
)

ClaimLossCause = Literal["deposed", "deadline", "store_identity"]

CLAIM_LOSS_CAUSES: Final[tuple[ClaimLossCause, ...]] = ("deposed", "deadline", "store_identity")
"""Why a held claim was lost: another writer deposed it, its local renew deadline passed, or
its store was replaced under the engine."""

_MAX_SAFE_INTEGER: Final = 2**53 - 1

ATTEMPTS_FAMILY: Final = "weft_workflow_claim_attempts_total"
ACTIVE_FAMILY: Final = "weft_workflow_claims_active"
FAILURES_FAMILY: Final = "weft_workflow_claim_renewal_failures_total"
LOST_FAMILY: Final = "weft_workflow_claims_lost_total"
_ATTEMPTS_HELP: Final = "Total per-workflow ownership claim attempts, by outcome"
_ACTIVE_HELP: Final = "Workflows this engine currently holds a claim for"
_FAILURES_HELP: Final = "Total per-workflow claim renewal failures"
_LOST_HELP: Final = "Total claims this engine lost, by cause"
HANDLER_FAILURES_FAMILY: Final = "weft_workflow_claim_handler_failures_total"
_HANDLER_FAILURES_HELP: Final = "Total workflow handler calls that raised, by workflow type"


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """A point-in-time copy of a :class:`ClaimMetrics`; later recordings do not change it.

    :param attempts: count per outcome, with every outcome of :data:`CLAIM_ATTEMPT_OUTCOMES`
        present, in that order.
    :param active_claims: the last value set for the active-claims gauge.
    :param renewal_failures: how many renewals failed.
    :param lost: count of lost claims per cause, every cause of :data:`CLAIM_LOSS_CAUSES`
        present, in that order.
    :param handler_failures: how many workflow handler calls raised, per workflow type (only
        types that failed at least once are present).
    """

    attempts: dict[str, int]
    active_claims: int
    renewal_failures: int
    lost: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLAIM_LOSS_CAUSES, 0))
    handler_failures: dict[str, int] = field(default_factory=dict)


class ClaimMetrics:
    """Thread-safe in-memory claim metrics for one engine.

    Counters start at zero and only grow until :meth:`reset`; the gauge is set absolutely.
    """

    def __init__(self) -> None:
        # _lock guards _attempts, _active_claims, _renewal_failures, _lost and
        # _handler_failures.
        self._lock = threading.Lock()
        self._attempts: dict[str, int] = dict.fromkeys(CLAIM_ATTEMPT_OUTCOMES, 0)
        self._lost: dict[str, int] = dict.fromkeys(CLAIM_LOSS_CAUSES, 0)
        self._active_claims = 0
        self._renewal_failures = 0
        self._handler_failures: dict[str, int] = {}

    def record_claim_attempt(self, outcome: ClaimAttemptOutcome) -> None:
        """Count one claim attempt with ``outcome``.

        :raises ValueError: ``outcome`` is not one of :data:`CLAIM_ATTEMPT_OUTCOMES`.
        """
        if outcome not in CLAIM_ATTEMPT_OUTCOMES:
            raise ValueError(
                f"unknown claim attempt outcome {outcome!r}; valid outcomes are "
                f"{', '.join(CLAIM_ATTEMPT_OUTCOMES)}"
            )
        with self._lock:
            self._attempts[outcome] += 1

    def set_active_claims(self, count: int) -> None:
        """Set the active-claims gauge to ``count``.

        :raises ValueError: ``count`` is not an integer in ``0 .. 2**53 - 1``.
        """
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError(f"active claims must be a whole number, got {count!r}")
        if not 0 <= count <= _MAX_SAFE_INTEGER:
            raise ValueError(
                f"active claims must be between 0 and {_MAX_SAFE_INTEGER}, got {count}"
            )
        with self._lock:
            self._active_claims = count

    def record_claims_lost(self, cause: ClaimLossCause, count: int = 1) -> None:
        """Count ``count`` claims lost for ``cause``.

        :raises ValueError: ``cause`` is not one of :data:`CLAIM_LOSS_CAUSES`, or ``count`` is
            negative.
        """
        if cause not in CLAIM_LOSS_CAUSES:
            raise ValueError(
                f"unknown claim loss cause {cause!r}; valid causes are "
                f"{', '.join(CLAIM_LOSS_CAUSES)}"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"a lost-claim count must be an int >= 0, got {count!r}")
        with self._lock:
            self._lost[cause] += count

    def record_claim_renewal_failure(self) -> None:
        """Count one failed renewal."""
        with self._lock:
            self._renewal_failures += 1

    def record_handler_failure(self, workflow_type: str) -> None:
        """Count one workflow handler call for ``workflow_type`` that raised.

        :raises TypeError: ``workflow_type`` is not a ``str``.
        """
        if not isinstance(workflow_type, str):
            raise TypeError(
                f"workflow_type must be a str, got {type(workflow_type).__name__} "
                f"{workflow_type!r:.80}"
            )
        with self._lock:
            self._handler_failures[workflow_type] = self._handler_failures.get(workflow_type, 0) + 1

    def snapshot(self) -> MetricsSnapshot:
        """Return an independent copy of the current values."""
        with self._lock:
            return MetricsSnapshot(
                attempts=dict(self._attempts),
                active_claims=self._active_claims,
                renewal_failures=self._renewal_failures,
                lost=dict(self._lost),
                handler_failures=dict(sorted(self._handler_failures.items())),
            )

    def reset(self) -> None:
        """Zero every counter and the gauge."""
        with self._lock:
            self._attempts = dict.fromkeys(CLAIM_ATTEMPT_OUTCOMES, 0)
            self._active_claims = 0
            self._renewal_failures = 0
            self._lost = dict.fromkeys(CLAIM_LOSS_CAUSES, 0)
            self._handler_failures = {}

    def __repr__(self) -> str:
        snap = self.snapshot()
        return (
            f"ClaimMetrics(attempts={snap.attempts}, active_claims={snap.active_claims}, "
            f"renewal_failures={snap.renewal_failures})"
        )


def serialize_prometheus(snapshot: MetricsSnapshot) -> str:
    """Render ``snapshot`` in the Prometheus text exposition format.

    Every outcome is printed, zeros included, so a fresh engine still exposes the full schema.
    The text ends with a newline.
    """
    lines = [
        f"# HELP {ATTEMPTS_FAMILY} {_ATTEMPTS_HELP}",
        f"# TYPE {ATTEMPTS_FAMILY} counter",
    ]
    for outcome in CLAIM_ATTEMPT_OUTCOMES:
        count = snapshot.attempts.get(outcome, 0)
        lines.append(f'{ATTEMPTS_FAMILY}{{outcome="{outcome}"}} {count}')
    lines += [
        f"# HELP {ACTIVE_FAMILY} {_ACTIVE_HELP}",
        f"# TYPE {ACTIVE_FAMILY} gauge",
        f"{ACTIVE_FAMILY} {snapshot.active_claims}",
        f"# HELP {FAILURES_FAMILY} {_FAILURES_HELP}",
        f"# TYPE {FAILURES_FAMILY} counter",
        f"{FAILURES_FAMILY} {snapshot.renewal_failures}",
        f"# HELP {LOST_FAMILY} {_LOST_HELP}",
        f"# TYPE {LOST_FAMILY} counter",
    ]
    for cause in CLAIM_LOSS_CAUSES:
        lines.append(f'{LOST_FAMILY}{{cause="{cause}"}} {snapshot.lost.get(cause, 0)}')
    lines += [
        f"# HELP {HANDLER_FAILURES_FAMILY} {_HANDLER_FAILURES_HELP}",
        f"# TYPE {HANDLER_FAILURES_FAMILY} counter",
    ]
    for workflow_type, count in snapshot.handler_failures.items():
        lines.append(f'{HANDLER_FAILURES_FAMILY}{{type="{_label_value(workflow_type)}"}} {count}')
    return "\n".join(lines) + "\n"


def _label_value(value: str) -> str:
    # The text format escapes exactly these three characters inside a label value.
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ClaimMetricsCollector:
    """A ``prometheus_client`` custom collector reading a :class:`ClaimMetrics` at scrape time.

    Built by :func:`register_prometheus`; pass it to ``registry.unregister`` to stop exposing.
    """

    def __init__(self, metrics: ClaimMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self._metrics.snapshot()
        attempts = CounterMetricFamily(ATTEMPTS_FAMILY, _ATTEMPTS_HELP, labels=["outcome"])
        for outcome in CLAIM_ATTEMPT_OUTCOMES:
            attempts.add_metric([outcome], snap.attempts.get(outcome, 0))
        yield attempts
        yield GaugeMetricFamily(ACTIVE_FAMILY, _ACTIVE_HELP, value=snap.active_claims)
        yield CounterMetricFamily(FAILURES_FAMILY, _FAILURES_HELP, value=snap.renewal_failures)
        lost = CounterMetricFamily(LOST_FAMILY, _LOST_HELP, labels=["cause"])
        for cause in CLAIM_LOSS_CAUSES:
            lost.add_metric([cause], snap.lost.get(cause, 0))
        yield lost
        handler_failures = CounterMetricFamily(
            HANDLER_FAILURES_FAMILY, _HANDLER_FAILURES_HELP, labels=["type"]
        )
        for workflow_type, count in snap.handler_failures.items():
            handler_failures.add_metric([workflow_type], count)
        yield handler_failures

    def describe(self) -> Iterator[Metric]:
        # Families without samples: the registry learns the names (to refuse duplicates)
        # without reading the metrics.
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield CounterMetricFamily(ATTEMPTS_FAMILY, _ATTEMPTS_HELP, labels=["outcome"])
        yield GaugeMetricFamily(ACTIVE_FAMILY, _ACTIVE_HELP)
        yield CounterMetricFamily(FAILURES_FAMILY, _FAILURES_HELP)
        yield CounterMetricFamily(LOST_FAMILY, _LOST_HELP, labels=["cause"])
        yield CounterMetricFamily(HANDLER_FAILURES_FAMILY, _HANDLER_FAILURES_HELP, labels=["type"])


def register_prometheus(
    metrics: ClaimMetrics, registry: CollectorRegistry | None = None
) -> ClaimMetricsCollector:
    """Expose ``metrics`` through ``prometheus_client``, read afresh on every scrape.

    :param metrics: the collector to expose.
    :param registry: the ``prometheus_client`` registry to register with (default: its global
        ``REGISTRY``).
    :returns: the registered collector, which can be passed to ``registry.unregister``.
    :raises ImportError: ``prometheus_client`` is not installed (install the ``prometheus``
        extra: ``weft_sync[prometheus]``).
    :raises ValueError: the registry already has collectors for these metric names.
    """
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "register_prometheus() needs the prometheus_client package; install the "
            "'prometheus' extra (pip install 'weft_sync[prometheus]') or use "
            "serialize_prometheus() for the text format"
        ) from exc
    target = registry if registry is not None else prometheus_client.REGISTRY
    collector = ClaimMetricsCollector(metrics)
    target.register(collector)
    return collector
