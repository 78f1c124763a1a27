"""Engines sharing one store hand over stranded claims (spec §1.3, §5.10, §7.11 items 167, 179).

Each engine is a full bootstrap on its own storage instance over the same store, on one shared
:class:`ManualClock`; interval ticks come from a :class:`ManualScheduler`, so nothing waits on
real time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.claims.gated import RENEW_MS, START_MS, TTL_MS
from tests.integration.workers import DriveLog
from tests.maintenance.helpers import WAIT_S, ManualScheduler, PassRecorder
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import (
    WorkflowRecord,
    decode_epoch,
    decode_holder,
    encode_epoch,
    encode_workflow_record,
)
from weft_sync.errors import WorkflowClaimLostWarning
from weft_sync.maintenance.bootstrap import OwnershipBootstrap, bootstrap_workflow_lease_ownership
from weft_sync.maintenance.targets import PassKind
from weft_sync.maintenance.task import RenewalTask
from weft_sync.metrics import ClaimMetrics
from weft_sync.storage import Condition, Put, Storage


@dataclass(frozen=True)
class Engine:
    """One engine: its bootstrap, its own store instance, its ticks and what it drove."""

    ownership: OwnershipBootstrap
    storage: Storage
    scheduler: ManualScheduler
    passes: PassRecorder
    drives: DriveLog

    @property
    def task(self) -> RenewalTask:
        return self.ownership.renewal_task

    @property
    def registry(self) -> ClaimRegistry:
        return self.ownership.registry

    @property
    def metrics(self) -> ClaimMetrics:
        return self.ownership.metrics

    @property
    def driven(self) -> list[str]:
        return self.drives.calls


MakeEngine = Callable[..., Engine]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def make_engine(open_store: Callable[[], Storage], clock: ManualClock) -> Iterator[MakeEngine]:
    engines: list[Engine] = []

    def make(engine_id: str, **kwargs: Any) -> Engine:
        store = open_store()
        scheduler, passes, drives = ManualScheduler(), PassRecorder(), DriveLog()
        ownership = bootstrap_workflow_lease_ownership(
            storage=store,
            clock=clock,
            claim_ttl_ms=TTL_MS,
            claim_renew_interval_ms=RENEW_MS,
            on_workflow_claim_reclaimed=drives,
            scheduler=scheduler,
            on_pass_complete=passes,
            engine_id=engine_id,
            **kwargs,
        )
        engine = Engine(ownership, store, scheduler, passes, drives)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert engine.task.close(timeout=WAIT_S)


def _write_running(storage: Storage, *workflow_ids: str) -> None:
    for workflow_id in workflow_ids:
        record = WorkflowRecord(workflow_id, "import", "running")
        storage.put(keys.workflow(workflow_id), encode_workflow_record(record))
        storage.put(keys.workflow_status_index("running", workflow_id), b"")


def _holder(storage: Storage, workflow_id: str) -> tuple[str, int] | None:
    holder = decode_holder(storage.get(keys.workflow_owner_holder(workflow_id)))
    return None if holder is None else (holder.engine_id, holder.epoch)


def _fenced_write(storage: Storage, workflow_id: str, token: bytes | None) -> bool:
    record = WorkflowRecord(workflow_id, "import", "running", input={"step": 2})
    return storage.conditional_batch(
        [Condition(keys.workflow_owner_epoch(workflow_id), token)],
        [Put(keys.workflow(workflow_id), encode_workflow_record(record))],
    )


def _never_eligible(_type: str, _revision: str | None) -> bool:
    return False


def _strand_one_keep_one(
    make_engine: MakeEngine, clock: ManualClock
) -> tuple[Engine, Engine, Engine]:
    """Engine A holds ``stranded`` and stops renewing; engine C keeps ``live`` renewed.

    C can run no workflow type, so its passes renew but never reclaim. Returns (A, B, C) with the
    clock past ``stranded``'s takeover deadline.
    """
    a = make_engine("engine-a")
    b = make_engine("engine-b")
    c = make_engine("engine-c", is_workflow_type_registered=_never_eligible)
    _write_running(a.storage, "stranded", "live")
    assert a.registry.acquire("stranded").epoch == 1
    assert c.registry.acquire("live").epoch == 1
    while clock() <= START_MS + TTL_MS + 2 * RENEW_MS:
        clock.advance(RENEW_MS)
        assert c.task.run_once().renewed_count == 1
    return a, b, c


def test_abandoned_claim_is_reclaimed_and_driven_once_and_a_live_one_is_left_alone(
    make_engine: MakeEngine, clock: ManualClock
) -> None:
    a, b, c = _strand_one_keep_one(make_engine, clock)

    first = b.task.run_once().reclaim
    assert first is not None
    assert sorted((o.workflow_id, o.status) for o in first.outcomes) == [
        ("live", "not-eligible"),
        ("stranded", "reclaimed"),
    ]
    assert b.driven == ["stranded"]
    assert b.registry.current_epoch("stranded") == 2
    assert _holder(b.storage, "stranded") == ("engine-b", 2)
    assert _holder(b.storage, "live") == ("engine-c", 1)

    again = b.task.run_once()
    assert [(o.workflow_id, o.status) for o in again.outcomes] == [("stranded", "renewed")]
    assert again.reclaim is not None
    assert again.reclaim.reclaimed_count == 0
    assert b.driven == ["stranded"]
    snap_b = b.metrics.snapshot()
    assert (snap_b.attempts["takeover"], snap_b.active_claims) == (1, 1)

    # A wakes up: its next renewal finds the claim gone and says so.
    with pytest.warns(WorkflowClaimLostWarning) as caught:
        woke = a.task.run_once()
    assert [getattr(w.message, "workflow_id", None) for w in caught] == ["stranded"]
    assert [(o.workflow_id, o.status) for o in woke.outcomes] == [("stranded", "failed")]
    assert a.registry.list_held_workflow_ids() == []
    snap_a = a.metrics.snapshot()
    assert snap_a.attempts["deposed"] == 1
    assert (snap_a.renewal_failures, snap_a.active_claims) == (1, 0)
    assert a.driven == []

    # The store enforces the handover: only the new epoch can write.
    assert not _fenced_write(a.storage, "stranded", encode_epoch(1))
    assert not _fenced_write(a.storage, "stranded", encode_epoch(2))  # the number alone
    assert _fenced_write(b.storage, "stranded", b.registry.current_epoch_bytes("stranded"))
    assert c.registry.list_held_workflow_ids() == ["live"]


def test_interval_ticks_reclaim_once_across_repeated_ticks(
    make_engine: MakeEngine, clock: ManualClock
) -> None:
    _, b, _ = _strand_one_keep_one(make_engine, clock)
    b.task.start()
    for tick in range(1, 4):
        b.scheduler.fire()
        reclaims = b.passes.wait_for(PassKind.RECLAIM, tick)
        assert b.task.wait_idle(WAIT_S)
        clock.advance(RENEW_MS)
    counts = [r.reclaim.reclaimed_count for r in reclaims if r.reclaim is not None]
    assert counts == [1, 0, 0]
    assert b.driven == ["stranded"]
    # The first tick's renewal ran alongside the reclaim; later ones renew the reclaimed claim.
    assert [r.renewed_count for r in b.passes.of_kind(PassKind.RENEWAL)][1:] == [1, 1]
    assert b.metrics.snapshot().active_claims == 1


def test_stopped_engine_reclaims_nothing_while_a_running_one_does(
    make_engine: MakeEngine, clock: ManualClock
) -> None:
    a, b, _ = _strand_one_keep_one(make_engine, clock)
    b.task.start()
    b.task.stop()
    assert b.ownership.reclaim_target.disposing
    stopped = b.task.run_once().reclaim
    assert stopped is not None
    assert (stopped.status, stopped.outcomes, stopped.reclaimed_count) == ("completed", (), 0)
    assert b.driven == []
    assert _holder(a.storage, "stranded") == ("engine-a", 1)

    d = make_engine("engine-d")
    reclaimed = d.task.run_once().reclaim
    assert reclaimed is not None
    assert reclaimed.reclaimed_count == 1
    assert d.driven == ["stranded"]
    assert decode_epoch(a.storage.get(keys.workflow_owner_epoch("stranded"))) == 2
