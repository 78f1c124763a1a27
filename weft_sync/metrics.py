"""Claim metrics: attempts, active claims and failures, latency histograms, margins and backlog.

What an operator needs before an incident is how close the engine is to losing claims, not only
that something failed: renewal batch latency and the smallest remaining expiry margin are the
early signal (see the README's "Operating a fleet"). Histogram buckets are derived from the
configured TTL and renew interval (:mod:`weft_sync.histograms`).

Workflow ids are never labels (their number is unbounded). Labels come from closed sets
(attempt outcome, sub-pass, loss cause, maintenance slot) or from workflow *types*, which the host
defines; at most :data:`MAX_TYPE_LABELS` distinct types are kept, later ones count as ``other``.
:func:`serialize_prometheus` renders a snapshot in the Prometheus text format without any
dependency; :func:`register_prometheus` exposes the same families through ``prometheus_client``
when the ``prometheus`` extra is installed (a collector read at scrape time).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from .histograms import Histogram, HistogramSnapshot, latency_bounds, takeover_delay_bounds

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "CLAIM_ATTEMPT_OUTCOMES",
    "CLAIM_LOSS_CAUSES",
    "ClaimLossCause",
    "MAX_TYPE_LABELS",
    "SUBPASSES",
    "ClaimAttemptOutcome",
    "ClaimMetrics",
    "ClaimMetricsCollector",
    "Family",
    "MetricsSnapshot",
    "Subpass",
    "metric_families",
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

Subpass = Literal["renewal", "reclaim", "signal_poll", "update_poll"]
SUBPASSES: Final[tuple[Subpass, ...]] = ("renewal", "reclaim", "signal_poll", "update_poll")
"""The maintenance sub-passes (and interval-mode slots), in pass order."""

ClaimLossCause = Literal["deposed", "deadline", "store_identity", "store_rollback"]
CLAIM_LOSS_CAUSES: Final[tuple[ClaimLossCause, ...]] = (
    "deposed",
    "deadline",
    "store_identity",
    "store_rollback",
)
"""Why a claim was lost locally: another owner took the epoch, renewals failed past the local
renew deadline, the store was replaced under the engine, or the store went back in time (it
lost writes it had acknowledged: an in-place restore, a failover to a lagging replica)."""

MAX_TYPE_LABELS: Final = 64
"""Distinct workflow types kept as label values per family; further types count as ``other``."""
_OTHER_TYPE: Final = "other"

_MAX_SAFE_INTEGER: Final = 2**53 - 1
_DEFAULT_TTL_MS: Final = 30_000
_DEFAULT_RENEW_MS: Final = 5_000

ATTEMPTS_FAMILY: Final = "weft_workflow_claim_attempts_total"
ACTIVE_FAMILY: Final = "weft_workflow_claims_active"
FAILURES_FAMILY: Final = "weft_workflow_claim_renewal_failures_total"
RENEWAL_SECONDS_FAMILY: Final = "weft_workflow_claim_renewal_seconds"
PASS_SECONDS_FAMILY: Final = "weft_workflow_claim_pass_seconds"
FENCED_WRITE_SECONDS_FAMILY: Final = "weft_workflow_claim_fenced_write_seconds"
TAKEOVER_DELAY_FAMILY: Final = "weft_workflow_claim_takeover_delay_seconds"
EXPIRY_MARGIN_FAMILY: Final = "weft_workflow_claim_expiry_margin_seconds"
LOST_FAMILY: Final = "weft_workflow_claims_lost_total"
RECLAIMED_FAMILY: Final = "weft_workflow_claims_reclaimed_total"
DRIVEN_FAMILY: Final = "weft_workflow_claims_driven_total"
HANDLER_FAILURES_FAMILY: Final = "weft_workflow_claim_handler_failures_total"
REDRIVES_FAMILY: Final = "weft_workflow_claim_redrives_total"
RECLAIM_CANDIDATES_FAMILY: Final = "weft_workflow_claim_reclaim_candidates"
RECLAIM_BACKLOG_FAMILY: Final = "weft_workflow_claim_reclaim_backlog"
SKIPPED_TICKS_FAMILY: Final = "weft_workflow_claim_skipped_ticks_total"
WITHOUT_DRIVER_FAMILY: Final = "weft_workflow_claims_without_driver"
HANDLER_STUCK_FAMILY: Final = "weft_workflow_claim_handler_stuck_total"


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """A point-in-time copy of a :class:`ClaimMetrics`; later recordings do not change it.

    :param attempts: count per outcome, with every outcome of :data:`CLAIM_ATTEMPT_OUTCOMES`
        present, in that order.
    :param active_claims: the last value set for the active-claims gauge.
    :param renewal_failures: how many renewals failed.
    :param renewal_seconds: one observation per renewal batch (``None`` in a hand-built snapshot).
    :param pass_seconds: one histogram per sub-pass of :data:`SUBPASSES`.
    :param fenced_write_seconds: one observation per fenced write of the ledger.
    :param takeover_delay_seconds: our takeover minus the dead holder's expiry; a holder taken
        before its expiry (its engine known dead) is not observed.
    :param expiry_margin_seconds: the smallest remaining expiry among held claims after the last
        renewal pass; ``None`` before the first pass or while nothing is held.
    :param lost: claims lost locally, per cause of :data:`CLAIM_LOSS_CAUSES`.
    :param reclaimed: driven: handler_failures: per workflow type.
    :param redrives: drives attempted again after a failed one.
    :param reclaim_candidates: reclaim_backlog: what the last reclaim pass found, and how many of
        those were neither taken over by this engine nor won by another one.
    :param skipped_ticks: interval ticks skipped because the slot's last run was still going.
    :param claims_without_driver: claims the last driver check found held with no live driver
        past the grace (they were released for a redrive).
    :param handler_stuck: handler runs that went past ``handler_stuck_after``, per workflow type.
    """

    attempts: dict[str, int]
    active_claims: int
    renewal_failures: int
    renewal_seconds: HistogramSnapshot | None = None
    pass_seconds: dict[str, HistogramSnapshot] = field(default_factory=dict)
    fenced_write_seconds: HistogramSnapshot | None = None
    takeover_delay_seconds: HistogramSnapshot | None = None
    expiry_margin_seconds: float | None = None
    lost: dict[str, int] = field(default_factory=dict)
    reclaimed: dict[str, int] = field(default_factory=dict)
    driven: dict[str, int] = field(default_factory=dict)
    handler_failures: dict[str, int] = field(default_factory=dict)
    redrives: int = 0
    reclaim_candidates: int = 0
    reclaim_backlog: int = 0
    skipped_ticks: dict[str, int] = field(default_factory=dict)
    claims_without_driver: int = 0
    handler_stuck: dict[str, int] = field(default_factory=dict)


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if not 0 <= value <= _MAX_SAFE_INTEGER:
        raise ValueError(f"{name} must be between 0 and {_MAX_SAFE_INTEGER}, got {value}")
    return value


def _check_choice(kind: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; valid values are {', '.join(choices)}")
    return str(value)


class ClaimMetrics:
    """Thread-safe in-memory claim metrics for one engine.

    Counters start at zero and only grow until :meth:`reset`; gauges are set absolutely.

    :param claim_ttl_ms: claim_renew_interval_ms: the engine's claim timing; the histograms'
        bucket bounds are derived from it (defaults: 30 s and 5 s).
    """

    def __init__(
        self,
        *,
        claim_ttl_ms: int = _DEFAULT_TTL_MS,
        claim_renew_interval_ms: int = _DEFAULT_RENEW_MS,
    ) -> None:
        self._latency_bounds = latency_bounds(claim_ttl_ms, claim_renew_interval_ms)
        self._delay_bounds = takeover_delay_bounds(claim_ttl_ms, claim_renew_interval_ms)
        # _lock guards every field set by _zero(): counters, gauges and histograms.
        self._lock = threading.Lock()
        self._zero()

    def _zero(self) -> None:
        self._attempts: dict[str, int] = dict.fromkeys(CLAIM_ATTEMPT_OUTCOMES, 0)
        self._active_claims = 0
        self._renewal_failures = 0
        self._renewal = Histogram(self._latency_bounds)
        self._passes = {name: Histogram(self._latency_bounds) for name in SUBPASSES}
        self._fenced = Histogram(self._latency_bounds)
        self._delay = Histogram(self._delay_bounds)
        self._margin: float | None = None
        self._lost: dict[str, int] = dict.fromkeys(CLAIM_LOSS_CAUSES, 0)
        self._by_type: dict[str, dict[str, int]] = {
            "reclaimed": {},
            "driven": {},
            "failed": {},
            "stuck": {},
        }
        self._without_driver = 0
        self._redrives = 0
        self._candidates = 0
        self._backlog = 0
        self._skipped: dict[str, int] = dict.fromkeys(SUBPASSES, 0)

    # -- counters and gauges -----------------------------------------------------------------

    def record_claim_attempt(self, outcome: ClaimAttemptOutcome) -> None:
        """Count one claim attempt with ``outcome``.

        :raises ValueError: ``outcome`` is not one of :data:`CLAIM_ATTEMPT_OUTCOMES`.
        """
        _check_choice("claim attempt outcome", outcome, CLAIM_ATTEMPT_OUTCOMES)
        with self._lock:
            self._attempts[outcome] += 1

    def set_active_claims(self, count: int) -> None:
        """Set the active-claims gauge to ``count``.

        :raises ValueError: ``count`` is not an integer in ``0 .. 2**53 - 1``.
        """
        _check_count("active claims", count)
        with self._lock:
            self._active_claims = count

    def record_claim_renewal_failure(self) -> None:
        """Count one failed renewal."""
        with self._lock:
            self._renewal_failures += 1

    def record_claims_lost(self, cause: ClaimLossCause, count: int = 1) -> None:
        """Count ``count`` claims lost locally, by ``cause`` (one of :data:`CLAIM_LOSS_CAUSES`).

        :raises ValueError: an unknown cause, or ``count`` is not a whole number.
        """
        _check_choice("loss cause", cause, CLAIM_LOSS_CAUSES)
        _check_count("lost claims", count)
        with self._lock:
            self._lost[cause] += count

    def record_reclaimed(self, workflow_type: str) -> None:
        """Count one workflow of ``workflow_type`` this engine took over or acquired ownerless."""
        self._count_type("reclaimed", workflow_type)

    def record_driven(self, workflow_type: str) -> None:
        """Count one drive of a reclaimed workflow (its handler returned)."""
        self._count_type("driven", workflow_type)

    def record_handler_failure(self, workflow_type: str) -> None:
        """Count one drive of a reclaimed workflow whose handler raised."""
        self._count_type("failed", workflow_type)

    def record_redrive(self) -> None:
        """Count one drive attempted again after a failed one."""
        with self._lock:
            self._redrives += 1

    def record_handler_stuck(self, workflow_type: str) -> None:
        """Count one handler run of ``workflow_type`` that went past ``handler_stuck_after``."""
        self._count_type("stuck", workflow_type)

    def set_claims_without_driver(self, count: int) -> None:
        """Set how many held claims the last driver check found with no live driver.

        :raises ValueError: ``count`` is not an integer in ``0 .. 2**53 - 1``.
        """
        _check_count("claims without driver", count)
        with self._lock:
            self._without_driver = count

    def set_reclaim_backlog(self, candidates: int, backlog: int) -> None:
        """Set what the last reclaim pass found and how much of it is still stranded.

        :raises ValueError: a value is not a whole number, or ``backlog`` exceeds ``candidates``.
        """
        _check_count("reclaim candidates", candidates)
        _check_count("reclaim backlog", backlog)
        if backlog > candidates:
            raise ValueError(f"reclaim backlog {backlog} exceeds the {candidates} candidates")
        with self._lock:
            self._candidates, self._backlog = candidates, backlog

    def record_skipped_tick(self, slot: Subpass) -> None:
        """Count one interval tick that skipped ``slot`` because its last run was still going."""
        _check_choice("maintenance slot", slot, SUBPASSES)
        with self._lock:
            self._skipped[slot] += 1

    def set_expiry_margin(self, seconds: float | None) -> None:
        """Set the smallest remaining expiry among held claims (``None``: nothing held).

        A negative margin is kept: it says a held claim's record already expired in the store.

        :raises ValueError: ``seconds`` is not a finite number.
        """
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
        ):
            raise ValueError(f"expiry margin must be a finite number of seconds, got {seconds!r}")
        with self._lock:
            self._margin = None if seconds is None else float(seconds)

    # -- histograms ----------------------------------------------------------------------------

    def observe_renewal_batch(self, seconds: float) -> None:
        """Observe the latency of one renewal batch (one store transaction)."""
        with self._lock:
            self._renewal.observe(seconds)

    def observe_pass(self, subpass: Subpass, seconds: float) -> None:
        """Observe how long one run of ``subpass`` took.

        :raises ValueError: ``subpass`` is not one of :data:`SUBPASSES`.
        """
        _check_choice("sub-pass", subpass, SUBPASSES)
        with self._lock:
            self._passes[subpass].observe(seconds)

    def observe_fenced_write(self, seconds: float) -> None:
        """Observe the latency of one fenced write."""
        with self._lock:
            self._fenced.observe(seconds)

    def observe_takeover_delay(self, seconds: float) -> None:
        """Observe the time from a dead holder's expiry to this engine's takeover."""
        with self._lock:
            self._delay.observe(seconds)

    # -- reading -------------------------------------------------------------------------------

    def snapshot(self) -> MetricsSnapshot:
        """Return an independent copy of the current values."""
        with self._lock:
            return MetricsSnapshot(
                attempts=dict(self._attempts),
                active_claims=self._active_claims,
                renewal_failures=self._renewal_failures,
                renewal_seconds=self._renewal.snapshot(),
                pass_seconds={name: h.snapshot() for name, h in self._passes.items()},
                fenced_write_seconds=self._fenced.snapshot(),
                takeover_delay_seconds=self._delay.snapshot(),
                expiry_margin_seconds=self._margin,
                lost=dict(self._lost),
                reclaimed=dict(self._by_type["reclaimed"]),
                driven=dict(self._by_type["driven"]),
                handler_failures=dict(self._by_type["failed"]),
                redrives=self._redrives,
                reclaim_candidates=self._candidates,
                reclaim_backlog=self._backlog,
                skipped_ticks=dict(self._skipped),
                claims_without_driver=self._without_driver,
                handler_stuck=dict(self._by_type["stuck"]),
            )

    def reset(self) -> None:
        """Zero every counter, gauge and histogram."""
        with self._lock:
            self._zero()

    def _count_type(self, family: str, workflow_type: str) -> None:
        if not isinstance(workflow_type, str):
            raise TypeError(
                f"workflow_type must be a str, got {type(workflow_type).__name__} "
                f"{workflow_type!r:.80}"
            )
        with self._lock:
            counts = self._by_type[family]
            if workflow_type not in counts and len(counts) >= MAX_TYPE_LABELS:
                workflow_type = _OTHER_TYPE
            counts[workflow_type] = counts.get(workflow_type, 0) + 1

    def __repr__(self) -> str:
        snap = self.snapshot()
        return (
            f"ClaimMetrics(attempts={snap.attempts}, active_claims={snap.active_claims}, "
            f"renewal_failures={snap.renewal_failures}, lost={snap.lost}, "
            f"expiry_margin_seconds={snap.expiry_margin_seconds})"
        )


# -- exposition ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family of a snapshot, in a form both expositions render.

    ``samples`` holds ``(labels, value)`` for counters and gauges, ``(labels, histogram)`` for
    histograms.
    """

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    label_names: tuple[str, ...]
    samples: tuple[tuple[tuple[str, ...], Any], ...]


def _unlabelled(value: object | None) -> tuple[tuple[tuple[str, ...], Any], ...]:
    return () if value is None else (((), value),)


def _labelled(values: Mapping[str, int]) -> tuple[tuple[tuple[str, ...], Any], ...]:
    return tuple(((key,), value) for key, value in values.items())


def metric_families(snapshot: MetricsSnapshot) -> list[Family]:
    """Every family of ``snapshot``, zeros included, so a fresh engine exposes the full schema.

    Histograms missing from a hand-built snapshot and an unknown expiry margin have no samples.
    """
    hist = _unlabelled(snapshot.renewal_seconds)
    fenced = _unlabelled(snapshot.fenced_write_seconds)
    delay = _unlabelled(snapshot.takeover_delay_seconds)
    margin = _unlabelled(snapshot.expiry_margin_seconds)
    return [
        Family(
            ATTEMPTS_FAMILY,
            "counter",
            "Total per-workflow ownership claim attempts, by outcome",
            ("outcome",),
            tuple(((o,), snapshot.attempts.get(o, 0)) for o in CLAIM_ATTEMPT_OUTCOMES),
        ),
        Family(
            ACTIVE_FAMILY,
            "gauge",
            "Workflows this engine currently holds a claim for",
            (),
            (((), snapshot.active_claims),),
        ),
        Family(
            FAILURES_FAMILY,
            "counter",
            "Total per-workflow claim renewal failures",
            (),
            (((), snapshot.renewal_failures),),
        ),
        Family(
            RENEWAL_SECONDS_FAMILY,
            "histogram",
            "Latency of one renewal batch (one store transaction), in seconds",
            (),
            hist,
        ),
        Family(
            PASS_SECONDS_FAMILY,
            "histogram",
            "Duration of one maintenance sub-pass, in seconds",
            ("subpass",),
            tuple(((name,), h) for name, h in snapshot.pass_seconds.items()),
        ),
        Family(
            FENCED_WRITE_SECONDS_FAMILY,
            "histogram",
            "Latency of one fenced write, in seconds",
            (),
            fenced,
        ),
        Family(
            TAKEOVER_DELAY_FAMILY,
            "histogram",
            "Time from a dead holder's expiry to this engine's takeover, in seconds",
            (),
            delay,
        ),
        Family(
            EXPIRY_MARGIN_FAMILY,
            "gauge",
            "Smallest remaining expiry among held claims after the last renewal, in seconds",
            (),
            margin,
        ),
        Family(
            LOST_FAMILY,
            "counter",
            "Claims this engine lost locally, by cause",
            ("cause",),
            tuple(((c,), snapshot.lost.get(c, 0)) for c in CLAIM_LOSS_CAUSES),
        ),
        Family(
            RECLAIMED_FAMILY,
            "counter",
            "Workflows this engine reclaimed from dead owners, by workflow type",
            ("type",),
            _labelled(snapshot.reclaimed),
        ),
        Family(
            DRIVEN_FAMILY,
            "counter",
            "Drives of reclaimed workflows whose handler returned, by workflow type",
            ("type",),
            _labelled(snapshot.driven),
        ),
        Family(
            HANDLER_FAILURES_FAMILY,
            "counter",
            "Drives of reclaimed workflows whose handler raised, by workflow type",
            ("type",),
            _labelled(snapshot.handler_failures),
        ),
        Family(
            REDRIVES_FAMILY,
            "counter",
            "Drives attempted again after a failed drive",
            (),
            (((), snapshot.redrives),),
        ),
        Family(
            RECLAIM_CANDIDATES_FAMILY,
            "gauge",
            "Reclaim candidates the last reclaim pass found",
            (),
            (((), snapshot.reclaim_candidates),),
        ),
        Family(
            RECLAIM_BACKLOG_FAMILY,
            "gauge",
            "Candidates of the last reclaim pass neither taken over here nor won elsewhere",
            (),
            (((), snapshot.reclaim_backlog),),
        ),
        Family(
            SKIPPED_TICKS_FAMILY,
            "counter",
            "Interval ticks that skipped a slot whose previous run was still going",
            ("slot",),
            tuple(((s,), snapshot.skipped_ticks.get(s, 0)) for s in SUBPASSES),
        ),
        Family(
            WITHOUT_DRIVER_FAMILY,
            "gauge",
            "Held claims the last driver check found with no live driver past the grace",
            (),
            (((), snapshot.claims_without_driver),),
        ),
        Family(
            HANDLER_STUCK_FAMILY,
            "counter",
            "Handler runs that went past handler_stuck_after, by workflow type",
            ("type",),
            _labelled(snapshot.handler_stuck),
        ),
    ]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def serialize_prometheus(snapshot: MetricsSnapshot) -> str:
    """Render ``snapshot`` in the Prometheus text exposition format.

    Every family is printed with its ``HELP`` and ``TYPE`` lines, zeros included, so a fresh
    engine still exposes the full schema. The text ends with a newline.
    """
    lines: list[str] = []
    for family in metric_families(snapshot):
        lines.append(f"# HELP {family.name} {family.help}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for values, value in family.samples:
            if family.kind != "histogram":
                labels = _label_text(family.label_names, values)
                lines.append(f"{family.name}{labels} {_number(value)}")
                continue
            for le, count in value.cumulative():
                labels = _label_text(family.label_names, values, f'le="{le}"')
                lines.append(f"{family.name}_bucket{labels} {count}")
            labels = _label_text(family.label_names, values)
            lines.append(f"{family.name}_sum{labels} {_number(value.total)}")
            lines.append(f"{family.name}_count{labels} {value.count}")
    return "\n".join(lines) + "\n"


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


def _prometheus_family(family: Family, *, with_samples: bool) -> Metric:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    labels = list(family.label_names)
    if family.kind == "counter":
        counter = CounterMetricFamily(family.name, family.help, labels=labels)
        for values, value in family.samples if with_samples else ():
            counter.add_metric(list(values), value)
        return counter
    if family.kind == "gauge":
        gauge = GaugeMetricFamily(family.name, family.help, labels=labels)
        for values, value in family.samples if with_samples else ():
            gauge.add_metric(list(values), value)
        return gauge
    histogram = HistogramMetricFamily(family.name, family.help, labels=labels)
    for values, snap in family.samples if with_samples else ():
        histogram.add_metric(list(values), buckets=snap.cumulative(), sum_value=snap.total)
    return histogram


class ClaimMetricsCollector:
    """A ``prometheus_client`` custom collector reading a :class:`ClaimMetrics` at scrape time.

    Pass it to ``registry.unregister`` to stop exposing.
    """

    def __init__(self, metrics: ClaimMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for family in metric_families(self._metrics.snapshot()):
            yield _prometheus_family(family, with_samples=True)

    def describe(self) -> Iterator[Metric]:
        # Families without samples: the registry learns the names (to refuse duplicates)
        # without reading the metrics.
        empty = MetricsSnapshot(attempts={}, active_claims=0, renewal_failures=0)
        for family in metric_families(empty):
            yield _prometheus_family(family, with_samples=False)
