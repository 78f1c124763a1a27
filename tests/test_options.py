"""Option parsing and validation (spec §4.10, §7.8)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weft_sync.options import OwnershipOptions, parse_duration, resolve_ownership_fields


def test_defaults() -> None:
    fields = resolve_ownership_fields()
    assert fields.ownership == "none"
    assert (fields.lease_ttl_ms, fields.lease_renew_interval_ms, fields.lease_wait_ms) == (
        30_000,
        5_000,
        60_000,
    )
    assert (fields.claim_ttl_ms, fields.claim_renew_interval_ms) == (30_000, 5_000)
    opts = OwnershipOptions()
    assert (opts.claim_ttl_ms, opts.claim_renew_interval_ms) == (30_000, 5_000)


def test_unknown_mode_lists_the_accepted_values() -> None:
    with pytest.raises(ValueError) as info:
        resolve_ownership_fields("exclusive")
    for mode in ("'none'", "'lease'", "'workflow-lease'", "'exclusive'"):
        assert mode in str(info.value)


def test_claim_timing_only_validated_under_workflow_lease() -> None:
    lease = resolve_ownership_fields("lease", claim_ttl="bogus", claim_renew_interval="0s")
    assert (lease.claim_ttl_ms, lease.claim_renew_interval_ms) == (30_000, 5_000)
    assert resolve_ownership_fields("workflow-lease").claim_ttl_ms == 30_000
    with pytest.raises(ValueError, match="invalid duration 'bogus'"):
        resolve_ownership_fields("workflow-lease", claim_ttl="bogus")


def test_durations_parse() -> None:
    fields = resolve_ownership_fields("workflow-lease", claim_ttl="45s", claim_renew_interval="7s")
    assert (fields.claim_ttl_ms, fields.claim_renew_interval_ms) == (45_000, 7_000)
    assert parse_duration("9999ms") == 9999
    assert parse_duration("10m") == 600_000
    assert parse_duration("1h") == 3_600_000
    assert parse_duration("1.5s") == 1_500
    assert parse_duration(250) == 250


def test_timedelta_durations_parse_to_whole_milliseconds() -> None:
    assert parse_duration(timedelta(seconds=30)) == 30_000
    assert parse_duration(timedelta(minutes=2, milliseconds=5)) == 120_005
    assert parse_duration(timedelta(0)) == 0
    options = OwnershipOptions(
        claim_ttl=timedelta(seconds=45), claim_renew_interval=timedelta(seconds=7)
    )
    assert (options.claim_ttl_ms, options.claim_renew_interval_ms) == (45_000, 7_000)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (timedelta(microseconds=1500), "not a whole number of milliseconds"),
        (timedelta(seconds=-1), "cannot be negative"),
    ],
)
def test_bad_timedelta_durations_are_named(bad: timedelta, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_duration(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", ["", "5", "5 sec", "-1s", "0.5ms", "1e3ms", "s"])
def test_bad_duration_strings_are_named(bad: str) -> None:
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(").replace(".", r"\.")):
        parse_duration(bad)


def test_bad_duration_types() -> None:
    with pytest.raises(TypeError, match="duration"):
        parse_duration(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse_duration(True)
    with pytest.raises(ValueError, match="negative"):
        parse_duration(-5)


@pytest.mark.parametrize(("ttl", "renew"), [("10s", "10s"), ("10s", "20s")])
def test_renew_must_be_strictly_less_than_ttl(ttl: str, renew: str) -> None:
    with pytest.raises(ValueError, match="strictly less than claim_ttl"):
        OwnershipOptions(claim_ttl=ttl, claim_renew_interval=renew)


def test_ttl_must_be_three_renewals() -> None:
    OwnershipOptions(claim_ttl="30s", claim_renew_interval="9999ms")
    OwnershipOptions(claim_ttl="30s", claim_renew_interval="10s")
    with pytest.raises(ValueError, match="at least 30000ms"):
        OwnershipOptions(claim_ttl="20s", claim_renew_interval="10s")


def test_zero_ttl_rejected_as_not_positive() -> None:
    with pytest.raises(ValueError, match="positive claim_ttl"):
        OwnershipOptions(claim_ttl="0s")


def test_second_instance_detection_rejected_with_workflow_lease() -> None:
    with pytest.raises(ValueError, match="detect_second_instance"):
        resolve_ownership_fields("workflow-lease", detect_second_instance=True)
    resolve_ownership_fields("workflow-lease", detect_second_instance=False)


def test_manual_background_allowed_only_with_workflow_lease() -> None:
    assert resolve_ownership_fields("workflow-lease", background="manual").background == "manual"
    with pytest.raises(ValueError, match="'lease' cannot run with background='manual'"):
        resolve_ownership_fields("lease", background="manual")
    with pytest.raises(ValueError, match="'daemon'"):
        resolve_ownership_fields("none", background="daemon")


@given(st.integers(0, 10**9), st.sampled_from(["ms", "s", "m", "h"]))
def test_whole_durations_scale_exactly(n: int, unit: str) -> None:
    factor = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}[unit]
    assert parse_duration(f"{n}{unit}") == n * factor
