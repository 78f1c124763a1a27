"""Each metric moves when its cause happens, on real stores (both backends)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.claims.gated import GatedStorage
from tests.maintenance.helpers import ManualScheduler
from weft_sync import Ownership, OwnershipOptions
from weft_sync.clock import ManualClock
from weft_sync.errors import StorageError
from weft_sync.maintenance.bootstrap import bootstrap_workflow_lease_ownership
from weft_sync.metrics import SUBPASSES, serialize_prometheus
from weft_sync.storage import Storage

START_MS = 1_700_000_000_000
TTL_MS = 3_000
RENEW_MS = 1_000
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def gated(storage: Storage) -> GatedStorage:
    return GatedStorage(storage)


@pytest.fixture
def engine(gated: GatedStorage, clock: ManualClock) -> Iterator[Ownership]:
    warned: list[Warning] = []
    ownership = Ownership.open(
        gated,  # type: ignore[arg-type]
        options=OPTIONS,
        clock=clock,
        background="manual",
        warn=warned.append,
        engine_id="engine-a",
    )
    yield ownership
    ownership.close()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_a_pass_observes_every_sub_pass_once(engine: Ownership) -> None:
    engine.workflows.start("wf-1", "job")
    engine.run_maintenance()
    snap = engine.metrics.snapshot()
    assert {name: h.count for name, h in snap.pass_seconds.items()} == dict.fromkeys(SUBPASSES, 1)
    assert snap.renewal_seconds is not None and snap.renewal_seconds.count == 1


def test_a_slow_store_moves_the_renewal_histogram_and_shrinks_the_margin(
    engine: Ownership, gated: GatedStorage, clock: ManualClock
) -> None:
    engine.workflows.start("wf-1", "job")
    engine.run_maintenance()
    fast = engine.metrics.snapshot()
    # A renewal right after the start: the margin is nearly the whole TTL.
    assert fast.expiry_margin_seconds == pytest.approx(TTL_MS / 1000, abs=0.001)

    def slow_commit() -> None:
        time.sleep(0.05)  # the histogram measures real time
        clock.advance(800)  # the engine's own clock moves on while the commit hangs

    clock.advance(RENEW_MS)
    gated.before_next_cas(slow_commit)
    engine.run_maintenance()

    slow = engine.metrics.snapshot()
    assert slow.renewal_seconds is not None and fast.renewal_seconds is not None
    assert slow.renewal_seconds.count == fast.renewal_seconds.count + 1
    assert slow.renewal_seconds.total - fast.renewal_seconds.total >= 0.05
    # The claim was renewed from the clock reading before the slow commit: 0.8 s of its TTL
    # went by while the commit hung.
    assert slow.expiry_margin_seconds == pytest.approx((TTL_MS - 800) / 1000, abs=0.001)


def test_failing_renewals_drain_the_margin_until_the_deadline_gives_the_claim_up(
    engine: Ownership, gated: GatedStorage, clock: ManualClock
) -> None:
    engine.workflows.start("wf-1", "job")
    engine.run_maintenance()
    clock.advance(RENEW_MS)
    gated.raise_on_next_cas(StorageError("store unreachable"))
    engine.run_maintenance()
    # The record still expires where the last successful renewal put it.
    snap = engine.metrics.snapshot()
    assert snap.expiry_margin_seconds == pytest.approx((TTL_MS - RENEW_MS) / 1000)
    assert (snap.renewal_failures, snap.lost["deadline"]) == (1, 0)

    clock.advance(RENEW_MS)
    gated.raise_on_next_cas(StorageError("store unreachable"))
    engine.run_maintenance()
    # TTL - renew interval without a successful renewal: lost locally, so nothing is held.
    snap = engine.metrics.snapshot()
    assert snap.lost["deadline"] == 1
    assert snap.expiry_margin_seconds is None
    assert engine.registry.list_held_workflow_ids() == []


def test_the_margin_is_unknown_while_nothing_is_held(engine: Ownership) -> None:
    engine.run_maintenance()
    assert engine.metrics.snapshot().expiry_margin_seconds is None
    lines = serialize_prometheus(engine.metrics.snapshot()).splitlines()
    assert "# TYPE weft_workflow_claim_expiry_margin_seconds gauge" in lines
    assert not [line for line in lines if line.startswith("weft_workflow_claim_expiry_margin")]


def test_fenced_writes_are_observed(engine: Ownership) -> None:
    engine.workflows.start("wf-1", "job")
    before = engine.metrics.snapshot().fenced_write_seconds
    engine.workflows.save_checkpoint("wf-1", b"one")
    engine.workflows.save_checkpoint("wf-1", b"two")
    after = engine.metrics.snapshot().fenced_write_seconds
    assert before is not None and after is not None
    assert after.count == before.count + 2


class _CasOutage:
    """Delegates to a real store; every compare-and-swap raises while ``down`` is set."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner
        self.down = False

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name in ("conditional_batch", "conditional_batches", "compare_and_set_many"):

            def cas(*args: Any, **kwargs: Any) -> Any:
                if self.down:
                    raise StorageError("store unreachable")
                return attribute(*args, **kwargs)

            return cas
        return attribute


def test_a_failed_reclaim_attempt_counts_in_the_backlog(
    storage: Storage, clock: ManualClock
) -> None:
    # A dead engine's running workflow: started by "dead", never renewed again.
    with Ownership.open(
        storage, options=OPTIONS, clock=clock, background="manual", engine_id="dead"
    ) as dead:
        dead.workflows.start("wf-1", "job")
        dead.registry.forget_local_claim("wf-1")
    clock.advance(TTL_MS + 3 * RENEW_MS)
    drives: list[str] = []
    outage = _CasOutage(storage)
    survivor = Ownership.open(
        outage,  # type: ignore[arg-type]
        options=OPTIONS,
        clock=clock,
        background="manual",
        engine_id="survivor",
        on_reclaimed=drives.append,
    )
    try:
        outage.down = True  # every takeover attempt of this pass fails
        survivor.run_maintenance()
        snap = survivor.metrics.snapshot()
        assert (snap.reclaim_candidates, snap.reclaim_backlog) == (1, 1)
        outage.down = False
        clock.advance(RENEW_MS)
        survivor.run_maintenance()
        snap = survivor.metrics.snapshot()
        assert (snap.reclaim_candidates, snap.reclaim_backlog) == (1, 0)
        assert drives == ["wf-1"]
    finally:
        survivor.close()


def test_a_slot_still_running_counts_a_skipped_tick(storage: Storage, clock: ManualClock) -> None:
    gate, entered = threading.Event(), threading.Event()

    def hold_the_reclaim_slot() -> list[str]:
        entered.set()
        gate.wait(30)
        return []

    scheduler = ManualScheduler()
    renewed = threading.Event()
    boot = bootstrap_workflow_lease_ownership(
        storage=storage,
        clock=clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        scheduler=scheduler,
        on_pass_complete=lambda result: renewed.set() if result.kind == "renewal" else None,
    )
    boot.reclaim_target.list_reclaim_candidate_workflow_ids = hold_the_reclaim_slot  # type: ignore[method-assign]
    boot.renewal_task.start()
    try:
        scheduler.fire()
        assert entered.wait(30) and renewed.wait(30)
        scheduler.fire()  # the reclaim slot is still busy: this tick skips it
        assert boot.metrics.snapshot().skipped_ticks["reclaim"] == 1
    finally:
        gate.set()
        assert boot.renewal_task.close(timeout=30)


def test_the_exposition_with_every_family_parses(engine: Ownership) -> None:
    engine.workflows.start("wf-1", "job")
    engine.workflows.save_checkpoint("wf-1", b"x")
    engine.run_maintenance()
    metrics = engine.metrics
    metrics.record_reclaimed('odd "type"\nwith\\escapes')
    metrics.record_claims_lost("deadline")
    samples = _samples(serialize_prometheus(metrics.snapshot()))
    assert samples[("weft_workflow_claim_renewal_seconds_count", ())] == 1
    assert samples[("weft_workflow_claim_pass_seconds_count", (("subpass", "reclaim"),))] == 1
    assert samples[("weft_workflow_claims_lost_total", (("cause", "deadline"),))] == 1
    assert (
        samples[("weft_workflow_claims_reclaimed_total", (("type", 'odd "type"\nwith\\escapes'),))]
        == 1
    )
    assert samples[("weft_workflow_claim_expiry_margin_seconds", ())] == pytest.approx(3.0)
    buckets = [
        (labels, value)
        for (name, labels), value in samples.items()
        if name == "weft_workflow_claim_fenced_write_seconds_bucket"
    ]
    assert buckets and max(v for _, v in buckets) == 1  # cumulative, +Inf holds the one write


def test_histogram_buckets_follow_the_configured_timing(engine: Ownership) -> None:
    snap = engine.metrics.snapshot()
    assert snap.renewal_seconds is not None and snap.takeover_delay_seconds is not None
    bounds = snap.renewal_seconds.bounds
    # From a thousandth of the renew interval to the TTL, through the interval and the deadline.
    assert (bounds[0], bounds[-1]) == (RENEW_MS / 1e6, TTL_MS / 1000)
    assert RENEW_MS / 1000 in bounds and (TTL_MS - RENEW_MS) / 1000 in bounds
    # Takeovers are allowed two renew intervals after the expiry.
    assert 2 * RENEW_MS / 1000 in snap.takeover_delay_seconds.bounds


def _strand(storage: Storage, clock: ManualClock, workflow_id: str, workflow_type: str) -> int:
    """A running workflow whose owner died; returns its holder's expiry."""
    with Ownership.open(
        storage, options=OPTIONS, clock=clock, background="manual", engine_id="dead"
    ) as dead:
        dead.workflows.start(workflow_id, workflow_type)
        expires_at = dead.registry.tracked_expires_at(workflow_id)
        dead.registry.forget_local_claim(workflow_id)
    assert expires_at is not None
    return expires_at


def test_a_takeover_observes_its_delay_and_counts_the_drive_by_type(
    storage: Storage, clock: ManualClock
) -> None:
    expires_at = _strand(storage, clock, "wf-1", "payout")
    clock.advance(TTL_MS + 3 * RENEW_MS)
    driven: list[int] = []
    with Ownership.open(
        storage,
        options=OPTIONS,
        clock=clock,
        background="manual",
        engine_id="survivor",
        handlers={"payout": lambda ctx: driven.append(ctx.epoch)},
    ) as survivor:
        survivor.run_maintenance()
        snap = survivor.metrics.snapshot()
    assert driven == [2]
    assert snap.takeover_delay_seconds is not None
    assert snap.takeover_delay_seconds.count == 1
    assert snap.takeover_delay_seconds.total == pytest.approx((clock() - expires_at) / 1000)
    assert (snap.reclaimed, snap.driven) == ({"payout": 1}, {"payout": 1})
    assert (snap.handler_failures, snap.redrives) == ({}, 0)


def test_a_failed_drive_counts_a_failure_then_a_redrive(
    storage: Storage, clock: ManualClock
) -> None:
    _strand(storage, clock, "wf-1", "payout")
    clock.advance(TTL_MS + 3 * RENEW_MS)
    calls: list[int] = []

    def flaky(ctx: Any) -> None:
        calls.append(ctx.epoch)
        if len(calls) == 1:
            raise RuntimeError("payment gateway down")

    with Ownership.open(
        storage,
        options=OPTIONS,
        clock=clock,
        background="manual",
        engine_id="survivor",
        handlers={"payout": flaky},
    ) as survivor:
        survivor.run_maintenance()
        clock.advance(RENEW_MS)
        survivor.run_maintenance()
        snap = survivor.metrics.snapshot()
    assert calls == [2, 3]  # released after the failure, acquired again ownerless
    assert snap.reclaimed == {"payout": 1}  # one workflow reclaimed, driven twice
    assert (snap.handler_failures, snap.redrives, snap.driven) == ({"payout": 1}, 1, {"payout": 1})
