"""The ledger's poll targets wired into a bootstrapped renewal task (the facade's wiring)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tests.claims.gated import RENEW_MS, TTL_MS, WarningSink, Worker
from tests.maintenance.helpers import ManualScheduler
from tests.support.waiting import wait_set
from tests.workflows.helpers import ReadHooks
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.ledger.records import signal_prefix
from weft_sync.maintenance.bootstrap import OwnershipBootstrap, bootstrap_workflow_lease_ownership
from weft_sync.maintenance.targets import SignalPollTarget, SubpassStatus, UpdatePollTarget
from weft_sync.storage import Storage
from weft_sync.workflows import (
    Workflows,
    WorkflowSignalPollTarget,
    WorkflowUpdate,
    WorkflowUpdatePollTarget,
)

WF = "wf-1"


@pytest.fixture
def engine(
    gated: ReadHooks, clock: ManualClock, sink: WarningSink
) -> Iterator[tuple[Workflows, OwnershipBootstrap]]:
    workflows = Workflows(gated, None, clock=clock, warn=sink)
    boot = bootstrap_workflow_lease_ownership(
        storage=gated,
        clock=clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        signal_poll_target=workflows.signal_poll_target,
        update_poll_target=workflows.update_poll_target,
        scheduler=ManualScheduler(),
        warn=sink,
        engine_id="engine-a",
    )
    workflows.bind_registry(boot.registry)
    yield workflows, boot
    assert boot.renewal_task.close(timeout=10)


def test_the_targets_implement_the_maintenance_protocols(ledger: Workflows) -> None:
    assert isinstance(ledger.signal_poll_target, SignalPollTarget)
    assert isinstance(ledger.update_poll_target, UpdatePollTarget)


def test_one_maintenance_pass_wakes_waiters_and_drains_updates(
    engine: tuple[Workflows, OwnershipBootstrap], client: Workflows, gated: ReadHooks
) -> None:
    workflows, boot = engine
    workflows.start(WF, "import")
    received: list[WorkflowUpdate] = []
    workflows.on_update(WF, received.append)
    scanned = threading.Event()
    gated.after_next_scan_of(signal_prefix(WF, "go"), scanned.set)
    waiter = Worker(lambda: workflows.wait_for_signal(WF, "go", 10), "waiter")
    wait_set(scanned, "the waiter's first look")
    client.send_signal(WF, "go", "ok")
    client.submit_update(WF, "bump", 5)
    result = boot.renewal_task.run_once()
    assert result.signal_poll is not None and result.signal_poll.status is SubpassStatus.COMPLETED
    assert result.signal_poll.result is not None and result.signal_poll.result.woken_count == 1
    assert result.update_poll is not None and result.update_poll.result is not None
    assert result.update_poll.result.drained_count == 1
    assert waiter.result() == "ok"
    assert [u.payload for u in received] == [5]
    assert result.renewed_count == 1


def test_targets_built_before_the_ledger_report_nothing_until_it_exists(
    gated: ReadHooks, clock: ManualClock, registry: ClaimRegistry
) -> None:
    box: dict[str, Workflows] = {}
    signals = WorkflowSignalPollTarget(lambda: box.get("ledger"))
    updates = WorkflowUpdatePollTarget(lambda: box.get("ledger"))
    assert signals.list_parked_signal_waits() == []
    assert not signals.has_buffered_signal(WF, "go")
    signals.wake_workflow(WF)
    assert updates.list_held_workflow_ids() == []
    assert not updates.has_pending_updates(WF)
    updates.drain_pending_updates(WF)
    box["ledger"] = ledger = Workflows(gated, registry, clock=clock)
    ledger.start(WF, "import")
    ledger.on_update(WF, lambda update: None)
    assert updates.list_held_workflow_ids() == [WF]


def test_binding_refuses_a_second_registry_or_another_store(
    ledger: Workflows,
    registry_b: ClaimRegistry,
    registry: ClaimRegistry,
    storage: Storage,
    clock: ManualClock,
) -> None:
    ledger.bind_registry(registry)
    with pytest.raises(ValueError, match="already bound"):
        ledger.bind_registry(registry_b)
    with pytest.raises(ValueError, match="different storage"):
        Workflows(storage, registry, clock=clock)


def test_a_forked_child_forgets_handlers_and_waiters(ledger: Workflows) -> None:
    ledger.start(WF, "import")
    ledger.on_update(WF, lambda update: None)
    ledger._after_fork_in_child()
    assert ledger.update_poll_target.list_held_workflow_ids() == []
    assert ledger.signal_poll_target.list_parked_signal_waits() == []
    ledger.save_checkpoint(WF, b"still usable")
