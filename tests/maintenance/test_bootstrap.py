"""Bootstrap wiring over real stores (spec §5.6, §5.10, §7.11 items 154-157, 179)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.claims.gated import RENEW_MS, START_MS, TTL_MS, GatedStorage, WarningSink
from tests.maintenance.helpers import (
    FakeSignalPollTarget,
    FakeUpdatePollTarget,
    ManualScheduler,
)
from weft_sync import keys
from weft_sync.claims.renewal_target import ClaimRenewalLostError
from weft_sync.clock import ManualClock
from weft_sync.codec import (
    ModeMarker,
    WorkflowRecord,
    decode_mode_marker,
    encode_mode_marker,
    encode_workflow_record,
)
from weft_sync.errors import OwnershipModeMismatchError, StorageCapabilityError
from weft_sync.maintenance.bootstrap import OwnershipBootstrap, bootstrap_workflow_lease_ownership
from weft_sync.maintenance.targets import (
    PassKind,
    PassResult,
    ReclaimPassStatus,
    SubpassStatus,
)
from weft_sync.metrics import CLAIM_ATTEMPT_OUTCOMES
from weft_sync.storage import Storage

MakeEngine = Callable[..., OwnershipBootstrap]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def make_engine(storage: Storage, clock: ManualClock) -> Iterator[MakeEngine]:
    """Bootstrap engines on the shared store and clock; every task is closed afterwards."""
    built: list[OwnershipBootstrap] = []

    def make(**kwargs: Any) -> OwnershipBootstrap:
        kwargs.setdefault("storage", storage)
        kwargs.setdefault("clock", clock)
        kwargs.setdefault("claim_ttl_ms", TTL_MS)
        kwargs.setdefault("claim_renew_interval_ms", RENEW_MS)
        kwargs.setdefault("scheduler", ManualScheduler())
        kwargs.setdefault("warn", WarningSink())
        engine = bootstrap_workflow_lease_ownership(**kwargs)
        built.append(engine)
        return engine

    yield make
    for engine in built:
        assert engine.renewal_task.close(timeout=10)


def _write_running(storage: Storage, workflow_id: str) -> None:
    record = WorkflowRecord(workflow_id, "import", "running")
    storage.put(keys.workflow(workflow_id), encode_workflow_record(record))
    storage.put(keys.workflow_status_index("running", workflow_id), b"")


def test_bootstrap_builds_zeroed_metrics_and_stamps_the_marker(
    make_engine: MakeEngine, storage: Storage
) -> None:
    engine = make_engine()
    snap = engine.metrics.snapshot()
    assert snap.attempts == dict.fromkeys(CLAIM_ATTEMPT_OUTCOMES, 0)
    assert (snap.active_claims, snap.renewal_failures) == (0, 0)
    assert engine.registry.list_held_workflow_ids() == []
    assert decode_mode_marker(storage.get(keys.OWNERSHIP_MODE_MARKER)) == ModeMarker(
        "workflow-lease", START_MS
    )
    assert engine.renewal_task.interval_ms == RENEW_MS


def test_each_engine_gets_its_own_random_id_unless_one_is_given(make_engine: MakeEngine) -> None:
    first, second = make_engine(), make_engine()
    assert first.registry.engine_id != second.registry.engine_id
    assert len(first.registry.engine_id) == 36  # a UUID
    assert make_engine(engine_id="engine-x").registry.engine_id == "engine-x"


def test_bootstrap_starts_no_timer(make_engine: MakeEngine) -> None:
    scheduler = ManualScheduler()
    engine = make_engine(scheduler=scheduler)
    assert scheduler.set_calls == []
    assert not engine.renewal_task.started
    engine.renewal_task.start()
    assert scheduler.set_calls == [RENEW_MS]


def test_store_without_compare_and_swap_builds_nothing_and_writes_no_marker(
    make_engine: MakeEngine, storage: Storage
) -> None:
    no_cas = GatedStorage(storage, conditional_batch=False)
    with pytest.raises(StorageCapabilityError, match="workflow-lease"):
        make_engine(storage=no_cas)
    assert no_cas.calls["put"] == no_cas.calls["get"] == no_cas.transactions == 0
    assert storage.get(keys.OWNERSHIP_MODE_MARKER) is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"claim_ttl_ms": 0}, "claim_ttl_ms"),
        ({"claim_renew_interval_ms": -5}, "claim_renew_interval_ms"),
        ({"engine_id": ""}, "engine_id"),
    ],
    ids=["ttl", "renew-interval", "engine-id"],
)
def test_bad_arguments_fail_before_the_store_is_touched(
    make_engine: MakeEngine, storage: Storage, override: dict[str, object], message: str
) -> None:
    watched = GatedStorage(storage)
    with pytest.raises(ValueError, match=message):
        make_engine(storage=watched, **override)
    assert watched.total_calls == 0
    assert storage.get(keys.OWNERSHIP_MODE_MARKER) is None


def test_store_stamped_for_the_lease_mode_is_refused(
    make_engine: MakeEngine, storage: Storage
) -> None:
    marker = encode_mode_marker(ModeMarker("lease", 500))
    storage.put(keys.OWNERSHIP_MODE_MARKER, marker)
    with pytest.raises(OwnershipModeMismatchError) as caught:
        make_engine()
    error = caught.value
    assert (error.configured_mode, error.stored_mode, error.established_at) == (
        "workflow-lease",
        "lease",
        500,
    )
    assert storage.get(keys.OWNERSHIP_MODE_MARKER) == marker


def test_second_engine_accepts_the_marker_the_first_stamped(
    make_engine: MakeEngine, storage: Storage, clock: ManualClock
) -> None:
    make_engine()
    stamped = storage.get(keys.OWNERSHIP_MODE_MARKER)
    clock.advance(1_000)
    make_engine()
    assert storage.get(keys.OWNERSHIP_MODE_MARKER) == stamped


def test_poll_targets_are_threaded_through_to_the_pass(make_engine: MakeEngine) -> None:
    signals, updates = FakeSignalPollTarget(), FakeUpdatePollTarget()
    engine = make_engine(signal_poll_target=signals, update_poll_target=updates)
    result = engine.renewal_task.run_once()
    assert result.signal_poll is not None
    assert result.signal_poll.status is SubpassStatus.COMPLETED
    assert result.signal_poll.result is not None
    assert (result.signal_poll.result.outcomes, result.signal_poll.result.woken_count) == ((), 0)
    assert result.update_poll is not None
    assert result.update_poll.status is SubpassStatus.COMPLETED
    without = make_engine().renewal_task.run_once()
    assert (without.signal_poll, without.update_poll) == (None, None)
    assert without.reclaim is not None


def test_lost_renewal_counts_as_deposed_and_a_renewal_failure(
    make_engine: MakeEngine, clock: ManualClock
) -> None:
    sink = WarningSink()
    a = make_engine(engine_id="engine-a", warn=sink)
    b = make_engine(engine_id="engine-b")
    a.registry.acquire("wf-1")
    a.registry.acquire("wf-2")
    clock.advance(10 * TTL_MS)
    assert b.registry.takeover("wf-1").status == "acquired"
    result = a.renewal_task.run_once()
    by_id = {o.workflow_id: o for o in result.outcomes}
    assert by_id["wf-1"].status == "failed"
    assert isinstance(by_id["wf-1"].error, ClaimRenewalLostError)
    assert by_id["wf-2"].status == "renewed"
    assert sink.lost_ids() == ["wf-1"]
    snap = a.metrics.snapshot()
    assert (snap.renewal_failures, snap.active_claims) == (1, 1)
    assert snap.attempts["deposed"] == 1
    # The same pass's reclaim sees wf-1 but this engine was just deposed: cooldown.
    assert result.reclaim is not None
    assert [(o.workflow_id, o.status) for o in result.reclaim.outcomes] == [
        ("wf-1", "backoff-skipped")
    ]
    assert snap.attempts["backoff_skipped"] == 1


def test_reclaim_drive_and_eligibility_callbacks_are_wired(
    make_engine: MakeEngine, storage: Storage
) -> None:
    driven: list[str] = []
    asked: list[str] = []

    def eligible(wf_type: str, revision: str | None) -> bool:
        asked.append(wf_type)
        return True

    engine = make_engine(
        on_workflow_claim_reclaimed=driven.append, is_workflow_type_registered=eligible
    )
    _write_running(storage, "orphan")
    result = engine.renewal_task.run_once()
    assert result.reclaim is not None
    assert result.reclaim.reclaimed_count == 1
    assert driven == ["orphan"]
    assert asked == ["import", "import"]  # before the claim and after it
    snap = engine.metrics.snapshot()
    assert (snap.attempts["acquired"], snap.active_claims) == (1, 1)


def test_pass_sink_sees_results_after_the_metrics_bridge(make_engine: MakeEngine) -> None:
    engines: list[OwnershipBootstrap] = []
    seen: list[tuple[PassKind, int]] = []

    def sink(result: PassResult) -> None:
        seen.append((result.kind, engines[0].metrics.snapshot().active_claims))

    engine = make_engine(on_pass_complete=sink)
    engines.append(engine)
    engine.registry.acquire("wf-1")
    engine.renewal_task.run_once()
    assert seen == [(PassKind.FULL, 1)]


def test_stop_marks_the_reclaim_target_disposing_even_before_start(
    make_engine: MakeEngine, storage: Storage
) -> None:
    driven: list[str] = []
    running = make_engine(on_workflow_claim_reclaimed=driven.append)
    stopped = make_engine(on_workflow_claim_reclaimed=driven.append)
    _write_running(storage, "orphan")
    stopped.renewal_task.stop()
    assert stopped.reclaim_target.disposing
    result = stopped.renewal_task.run_once()
    assert result.reclaim is not None
    assert (result.reclaim.status, result.reclaim.outcomes, result.reclaim.reclaimed_count) == (
        ReclaimPassStatus.COMPLETED,
        (),
        0,
    )
    assert stopped.registry.list_held_workflow_ids() == []
    # The same workflow is still there for an engine that was not stopped.
    assert not running.reclaim_target.disposing
    reclaimed = running.renewal_task.run_once().reclaim
    assert reclaimed is not None
    assert reclaimed.reclaimed_count == 1
    assert driven == ["orphan"]


def test_stop_after_start_stops_the_timer_and_disposes(make_engine: MakeEngine) -> None:
    scheduler = ManualScheduler()
    engine = make_engine(scheduler=scheduler)
    engine.renewal_task.start()
    engine.renewal_task.stop()
    assert scheduler.active == 0
    assert engine.reclaim_target.disposing
    engine.renewal_task.stop()
    assert engine.reclaim_target.disposing
