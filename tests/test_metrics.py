"""Claim metrics: counters, the gauge, snapshots, and both Prometheus expositions."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from weft_sync.metrics import (
    CLAIM_ATTEMPT_OUTCOMES,
    CLAIM_LOSS_CAUSES,
    SUBPASSES,
    ClaimMetrics,
    register_prometheus,
    serialize_prometheus,
)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_outcomes_are_the_five_closed_values_in_order() -> None:
    assert CLAIM_ATTEMPT_OUTCOMES == (
        "acquired",
        "takeover",
        "lost_race",
        "deposed",
        "backoff_skipped",
    )


def test_fresh_collector_is_all_zero() -> None:
    snap = ClaimMetrics().snapshot()
    assert (snap.attempts, snap.active_claims, snap.renewal_failures) == (
        dict.fromkeys(CLAIM_ATTEMPT_OUTCOMES, 0),
        0,
        0,
    )
    assert list(snap.attempts) == list(CLAIM_ATTEMPT_OUTCOMES)
    histograms = [
        snap.renewal_seconds,
        snap.fenced_write_seconds,
        snap.takeover_delay_seconds,
        *snap.pass_seconds.values(),
    ]
    assert len(histograms) == 3 + len(SUBPASSES)
    assert all(h is not None and h.count == 0 and h.total == 0 for h in histograms)
    assert snap.expiry_margin_seconds is None
    assert snap.lost == dict.fromkeys(CLAIM_LOSS_CAUSES, 0)
    assert (snap.reclaimed, snap.driven, snap.handler_failures) == ({}, {}, {})
    assert (snap.redrives, snap.reclaim_candidates, snap.reclaim_backlog) == (0, 0, 0)
    assert snap.skipped_ticks == dict.fromkeys(SUBPASSES, 0)


@pytest.mark.parametrize("outcome", CLAIM_ATTEMPT_OUTCOMES)
def test_recording_an_outcome_increments_only_that_outcome(outcome: str) -> None:
    metrics = ClaimMetrics()
    metrics.record_claim_attempt(outcome)  # type: ignore[arg-type]
    snap = metrics.snapshot()
    assert snap.attempts == {o: int(o == outcome) for o in CLAIM_ATTEMPT_OUTCOMES}
    assert snap.active_claims == 0
    assert snap.renewal_failures == 0


def test_unknown_outcome_is_rejected_naming_the_valid_ones() -> None:
    metrics = ClaimMetrics()
    with pytest.raises(ValueError, match=r"'stolen'.*acquired, takeover, lost_race"):
        metrics.record_claim_attempt("stolen")  # type: ignore[arg-type]
    assert sum(metrics.snapshot().attempts.values()) == 0


def test_active_claims_gauge_is_an_absolute_set() -> None:
    metrics = ClaimMetrics()
    for value in (3, 7, 1, 0):
        metrics.set_active_claims(value)
        assert metrics.snapshot().active_claims == value


@pytest.mark.parametrize("bad", [-1, 1.5, 2**53, True, "3"])
def test_active_claims_gauge_rejects_values_outside_safe_non_negative_integers(
    bad: object,
) -> None:
    metrics = ClaimMetrics()
    metrics.set_active_claims(4)
    with pytest.raises(ValueError, match="active claims"):
        metrics.set_active_claims(bad)  # type: ignore[arg-type]
    assert metrics.snapshot().active_claims == 4


def test_largest_safe_integer_is_accepted_by_the_gauge() -> None:
    metrics = ClaimMetrics()
    metrics.set_active_claims(2**53 - 1)
    assert metrics.snapshot().active_claims == 2**53 - 1


def test_renewal_failures_count_independently_of_attempts_and_gauge() -> None:
    metrics = ClaimMetrics()
    metrics.record_claim_renewal_failure()
    metrics.record_claim_renewal_failure()
    snap = metrics.snapshot()
    assert snap.renewal_failures == 2
    assert sum(snap.attempts.values()) == 0
    assert snap.active_claims == 0


def test_reset_zeroes_everything_and_snapshots_are_independent_copies() -> None:
    metrics = ClaimMetrics()
    metrics.record_claim_attempt("takeover")
    metrics.set_active_claims(5)
    metrics.record_claim_renewal_failure()
    before = metrics.snapshot()
    before.attempts["takeover"] = 99
    metrics.record_claim_attempt("takeover")
    assert metrics.snapshot().attempts["takeover"] == 2
    kept = metrics.snapshot()
    metrics.reset()
    assert metrics.snapshot() == ClaimMetrics().snapshot()
    assert kept.attempts["takeover"] == 2
    assert kept.active_claims == 5
    assert kept.renewal_failures == 1


def test_concurrent_recording_loses_no_increments() -> None:
    metrics = ClaimMetrics()
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            for _ in range(2000):
                metrics.record_claim_attempt("acquired")
                metrics.record_claim_renewal_failure()
        except BaseException as exc:  # re-raised in the test thread below
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, name=f"metrics-worker-{i}", daemon=True) for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    if errors:
        raise errors[0]
    snap = metrics.snapshot()
    assert snap.attempts["acquired"] == 8000
    assert snap.renewal_failures == 8000


def test_prometheus_text_prints_every_line_and_ends_with_a_newline() -> None:
    metrics = ClaimMetrics()
    metrics.record_claim_attempt("acquired")
    metrics.record_claim_attempt("acquired")
    metrics.record_claim_attempt("deposed")
    metrics.set_active_claims(4)
    metrics.record_claim_renewal_failure()
    text = serialize_prometheus(metrics.snapshot())
    lines = text.split("\n")
    assert text.endswith("\n")
    assert lines[-1] == ""
    for expected in (
        "# TYPE weft_workflow_claim_attempts_total counter",
        'weft_workflow_claim_attempts_total{outcome="acquired"} 2',
        'weft_workflow_claim_attempts_total{outcome="takeover"} 0',
        'weft_workflow_claim_attempts_total{outcome="lost_race"} 0',
        'weft_workflow_claim_attempts_total{outcome="deposed"} 1',
        'weft_workflow_claim_attempts_total{outcome="backoff_skipped"} 0',
        "# TYPE weft_workflow_claims_active gauge",
        "weft_workflow_claims_active 4",
        "# TYPE weft_workflow_claim_renewal_failures_total counter",
        "weft_workflow_claim_renewal_failures_total 1",
    ):
        assert expected in lines


def test_all_zero_snapshot_still_prints_the_full_schema() -> None:
    text = serialize_prometheus(ClaimMetrics().snapshot())
    sample_lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(line.endswith((" 0", " 0.0")) for line in sample_lines)
    # Every family is announced, the ones without samples yet included.
    assert text.count("# TYPE ") == 18
    assert "weft_workflow_claims_active 0" in sample_lines
    assert 'weft_workflow_claims_lost_total{cause="deadline"} 0' in sample_lines
    assert 'weft_workflow_claim_pass_seconds_count{subpass="reclaim"} 0' in sample_lines
    # No expiry margin is known before the first renewal pass: no sample, not a made-up 0.
    assert not any(line.startswith("weft_workflow_claim_expiry_margin") for line in sample_lines)


def test_handler_failures_are_counted_per_type_and_escaped_in_the_text() -> None:
    metrics = ClaimMetrics()
    metrics.record_handler_failure("payout")
    metrics.record_handler_failure("payout")
    metrics.record_handler_failure('odd "type"\\')

    assert metrics.snapshot().handler_failures == {'odd "type"\\': 1, "payout": 2}
    samples = _samples(serialize_prometheus(metrics.snapshot()))
    family = "weft_workflow_claim_handler_failures_total"
    assert samples[(family, (("type", "payout"),))] == 2
    assert samples[(family, (("type", 'odd "type"\\'),))] == 1
    metrics.reset()
    assert metrics.snapshot().handler_failures == {}


def test_handler_failure_needs_a_type_name() -> None:
    with pytest.raises(TypeError, match="workflow_type must be a str, got int 3"):
        ClaimMetrics().record_handler_failure(3)  # type: ignore[arg-type]


def test_prometheus_text_parses_with_the_official_parser() -> None:
    metrics = ClaimMetrics()
    metrics.record_claim_attempt("lost_race")
    metrics.set_active_claims(2)
    samples = _samples(serialize_prometheus(metrics.snapshot()))
    assert samples[("weft_workflow_claim_attempts_total", (("outcome", "lost_race"),))] == 1
    assert samples[("weft_workflow_claims_active", ())] == 2
    assert samples[("weft_workflow_claim_renewal_failures_total", ())] == 0


def test_prometheus_client_collector_exposes_the_same_sample_values() -> None:
    metrics = ClaimMetrics()
    metrics.record_claim_attempt("takeover")
    metrics.record_claim_attempt("backoff_skipped")
    metrics.record_claim_attempt("backoff_skipped")
    metrics.set_active_claims(6)
    metrics.record_claim_renewal_failure()
    metrics.record_handler_failure("payout")
    registry = CollectorRegistry()
    register_prometheus(metrics, registry)

    exported = _samples(generate_latest(registry).decode())
    ours = _samples(serialize_prometheus(metrics.snapshot()))
    assert exported == ours
    assert exported[("weft_workflow_claim_attempts_total", (("outcome", "backoff_skipped"),))] == 2


def test_prometheus_client_collector_reads_values_at_scrape_time() -> None:
    metrics = ClaimMetrics()
    registry = CollectorRegistry()
    register_prometheus(metrics, registry)
    metrics.set_active_claims(9)
    exported = _samples(generate_latest(registry).decode())
    assert exported[("weft_workflow_claims_active", ())] == 9


def test_registering_twice_on_one_registry_is_refused() -> None:
    metrics = ClaimMetrics()
    registry = CollectorRegistry()
    collector = register_prometheus(metrics, registry)
    with pytest.raises(ValueError, match="weft_workflow_claims_active"):
        register_prometheus(metrics, registry)
    registry.unregister(collector)
    register_prometheus(metrics, registry)


def test_register_prometheus_without_the_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match="'prometheus' extra"):
        register_prometheus(ClaimMetrics())
