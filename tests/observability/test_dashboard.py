"""The Grafana dashboard queries only metrics the exposition really has."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from weft_sync.metrics import ClaimMetrics, serialize_prometheus

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "weft_sync.json"


def _exposed_series() -> set[str]:
    metrics = ClaimMetrics()
    # Fill the families that have no sample until something happens.
    metrics.set_expiry_margin(1.0)
    metrics.record_reclaimed("job")
    metrics.record_driven("job")
    metrics.record_handler_failure("job")
    series: set[str] = set()
    for family in text_string_to_metric_families(serialize_prometheus(metrics.snapshot())):
        series.update(sample.name for sample in family.samples)
    return series


def _queried_series() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert exprs, "the dashboard has no queries"
    return {name for expr in exprs for name in re.findall(r"\bweft_[a-z_]+\b", expr)}


def test_every_queried_series_exists_in_the_exposition() -> None:
    exposed = _exposed_series()
    missing = sorted(_queried_series() - exposed)
    assert missing == [], f"the dashboard queries series the exposition lacks: {missing}"


def test_the_dashboard_covers_the_signals_an_operator_alerts_on() -> None:
    queried = _queried_series()
    for series in (
        "weft_workflow_claim_expiry_margin_seconds",
        "weft_workflow_claim_renewal_failures_total",
        "weft_workflow_claim_skipped_ticks_total",
        "weft_workflow_claim_reclaim_backlog",
        "weft_workflow_claim_renewal_seconds_bucket",
    ):
        assert series in queried


def test_histograms_are_queried_through_their_bucket_series() -> None:
    bases = {name for name in _exposed_series() if name.endswith("_bucket")}
    for name in _queried_series():
        if name.endswith("_seconds"):
            assert name + "_bucket" not in bases, f"{name} is a histogram: query {name}_bucket"
