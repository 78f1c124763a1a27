"""``reclaim_discovery`` and ``crash_poll_interval``: their checks and what they switch on."""

from __future__ import annotations

import threading

import pytest

from tests.maintenance.discovery_helpers import engine_record
from weft_sync import Ownership, OwnershipOptions
from weft_sync.clock import ManualClock
from weft_sync.storage import Storage

WATCHER = "weft-liveness-watch"


def _watchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WATCHER]


def test_an_unknown_reclaim_discovery_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"reclaim_discovery='index'.*'auto', 'scan'"):
        OwnershipOptions(reclaim_discovery="index")  # type: ignore[arg-type]


@pytest.mark.parametrize("zero", [0, "0ms", "0s"])
def test_a_zero_crash_poll_interval_is_refused(zero: object) -> None:
    with pytest.raises(ValueError, match=rf"crash_poll_interval must be more than 0, got {zero!r}"):
        OwnershipOptions(crash_poll_interval=zero)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "expected"),
    [("20ms", 20), ("1s", 1_000), ("5s", 1_000), (60_000, 1_000), (None, None)],
)
def test_the_crash_poll_interval_is_clamped_to_the_renew_interval(
    given: object, expected: int | None
) -> None:
    options = OwnershipOptions(
        claim_ttl="3s",
        claim_renew_interval="1s",
        crash_poll_interval=given,  # type: ignore[arg-type]
    )
    assert options.crash_poll_interval_ms == expected


def test_defaults_probe_every_50ms_with_the_index_discovery() -> None:
    options = OwnershipOptions()
    assert (options.reclaim_discovery, options.crash_poll_interval_ms) == ("auto", 50)


def test_a_running_engine_watches_by_default(storage: Storage) -> None:
    options = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
    with Ownership.open(storage, engine_id="engine-w", options=options):
        assert len(_watchers()) == 1
        record = engine_record(storage, "engine-w")
        assert record is not None and record.watching
    assert _watchers() == []


def test_no_crash_poll_interval_runs_no_watcher(storage: Storage) -> None:
    options = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s", crash_poll_interval=None)
    with Ownership.open(storage, engine_id="engine-n", options=options) as ownership:
        assert ownership.started
        assert _watchers() == []
        record = engine_record(storage, "engine-n")
        assert record is not None and not record.watching
        assert record.lock == "engine-n"  # others still see it crash, at their next pass


def test_manual_maintenance_runs_no_watcher(storage: Storage) -> None:
    options = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
    with Ownership.open(
        storage,
        engine_id="engine-m",
        options=options,
        clock=ManualClock(1_000),
        background="manual",
    ) as ownership:
        ownership.run_maintenance()
        assert _watchers() == []
        record = engine_record(storage, "engine-m")
        assert record is not None and not record.watching


def test_manual_maintenance_started_by_hand_runs_no_watcher(storage: Storage) -> None:
    # Its record says it does not watch, so no probe runs that the others do not count on.
    options = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
    with Ownership.open(
        storage, engine_id="engine-s", options=options, background="manual"
    ) as ownership:
        ownership.start()
        assert ownership.started
        assert _watchers() == []
        record = engine_record(storage, "engine-s")
        assert record is not None and not record.watching
