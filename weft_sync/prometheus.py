"""The ``prometheus_client`` collector over a :class:`~weft_sync.metrics.ClaimMetrics`.

Importing this module does not import ``prometheus_client``; collecting does. Build it with
:func:`weft_sync.metrics.register_prometheus`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .metrics import ClaimMetrics, Family, MetricsSnapshot, metric_families

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["ClaimMetricsCollector"]


def _family(family: Family, *, with_samples: bool) -> Metric:
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
            yield _family(family, with_samples=True)

    def describe(self) -> Iterator[Metric]:
        # Families without samples: the registry learns the names (to refuse duplicates)
        # without reading the metrics.
        empty = MetricsSnapshot(attempts={}, active_claims=0, renewal_failures=0)
        for family in metric_families(empty):
            yield _family(family, with_samples=False)
