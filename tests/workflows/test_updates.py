"""Durable updates: queued by anyone, handed to the owner's handler once, in order."""

from __future__ import annotations

import pytest

from tests.claims.gated import PAST_GRACE_MS, WarningSink
from tests.workflows.helpers import ReadHooks
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.errors import WorkflowWakeDiscardedWarning
from weft_sync.ledger.records import update_prefix
from weft_sync.maintenance.polls import run_owner_side_update_poll
from weft_sync.maintenance.targets import UpdatePollStatus
from weft_sync.workflows import (
    WorkflowNotFoundError,
    Workflows,
    WorkflowStateError,
    WorkflowUpdate,
)

WF = "wf-1"


class Handler:
    """Records the updates it receives; raises for the first ``failures`` calls."""

    def __init__(self, failures: int = 0) -> None:
        self.calls: list[WorkflowUpdate] = []
        self.failures = failures

    def __call__(self, update: WorkflowUpdate) -> None:
        self.calls.append(update)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("handler not ready")

    def payloads(self) -> list[object]:
        return [u.payload for u in self.calls]


def _pending(store: ReadHooks) -> int:
    return len(store.scan(update_prefix(WF)))


def _statuses(ledger: Workflows, clock: ManualClock) -> list[tuple[str, UpdatePollStatus]]:
    result = run_owner_side_update_poll(ledger.update_poll_target, clock)
    return [(o.workflow_id, o.status) for o in result.outcomes]


def test_the_update_poll_delivers_each_update_once_in_order(
    ledger: Workflows, client: Workflows, gated: ReadHooks, clock: ManualClock
) -> None:
    ledger.start(WF, "import")
    handler = Handler()
    ledger.on_update(WF, handler)
    ids = [client.submit_update(WF, "bump", n) for n in range(3)]
    assert _statuses(ledger, clock) == [(WF, UpdatePollStatus.DRAINED)]
    assert handler.payloads() == [0, 1, 2]
    assert [u.update_id for u in handler.calls] == ids
    assert {(u.workflow_id, u.name, u.submitted_at) for u in handler.calls} == {
        (WF, "bump", clock())
    }
    assert _pending(gated) == 0
    assert _statuses(ledger, clock) == [(WF, UpdatePollStatus.NO_PENDING_UPDATES)]
    assert len(handler.calls) == 3


def test_a_raising_handler_leaves_the_update_for_the_next_poll(
    ledger: Workflows, client: Workflows, gated: ReadHooks, clock: ManualClock
) -> None:
    ledger.start(WF, "import")
    handler = Handler(failures=1)
    ledger.on_update(WF, handler)
    client.submit_update(WF, "first", 1)
    client.submit_update(WF, "second", 2)
    assert _statuses(ledger, clock) == [(WF, UpdatePollStatus.DRAIN_FAILED)]
    assert handler.payloads() == [1]
    assert _pending(gated) == 2
    assert _statuses(ledger, clock) == [(WF, UpdatePollStatus.DRAINED)]
    assert handler.payloads() == [1, 1, 2]
    assert _pending(gated) == 0


def test_only_held_workflows_with_a_handler_are_polled(
    ledger: Workflows, client: Workflows, clock: ManualClock
) -> None:
    ledger.start(WF, "import")
    ledger.start("no-handler", "import")
    client.submit_update("no-handler", "bump")
    handler = Handler()
    ledger.on_update(WF, handler)
    ledger.on_update("not-held", Handler())
    assert ledger.update_poll_target.list_held_workflow_ids() == [WF]
    ledger.on_update(WF, None)
    assert ledger.update_poll_target.list_held_workflow_ids() == []
    assert _statuses(ledger, clock) == []


def test_a_deposed_owner_does_not_run_its_handler(
    ledger: Workflows,
    ledger_b: Workflows,
    registry_b: ClaimRegistry,
    client: Workflows,
    gated: ReadHooks,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    ledger.start(WF, "import")
    stale = Handler()
    ledger.on_update(WF, stale)
    clock.advance(PAST_GRACE_MS)
    assert registry_b.takeover(WF).status == "acquired"
    client.submit_update(WF, "bump", 1)
    ledger.update_poll_target.drain_pending_updates(WF)
    assert stale.calls == []
    assert [(type(w), getattr(w, "wake_kind", None)) for w in sink.received] == [
        (WorkflowWakeDiscardedWarning, "update")
    ]
    assert _pending(gated) == 1
    fresh = Handler()
    ledger_b.on_update(WF, fresh)
    assert _statuses(ledger_b, clock) == [(WF, UpdatePollStatus.DRAINED)]
    assert fresh.payloads() == [1]


def test_updates_need_an_active_workflow(
    ledger: Workflows, client: Workflows, gated: ReadHooks
) -> None:
    with pytest.raises(WorkflowNotFoundError):
        client.submit_update("ghost", "bump")
    ledger.start(WF, "import")
    client.cancel(WF)
    with pytest.raises(WorkflowStateError, match="'cancelled'"):
        client.submit_update(WF, "bump")
    assert _pending(gated) == 0


def test_a_handler_must_be_callable(ledger: Workflows) -> None:
    with pytest.raises(TypeError, match="callable"):
        ledger.on_update(WF, "not a function")  # type: ignore[arg-type]


def test_completing_drops_the_handler(
    ledger: Workflows, client: Workflows, clock: ManualClock
) -> None:
    ledger.start(WF, "import")
    ledger.on_update(WF, Handler())
    ledger.complete(WF)
    ledger.start("next", "import")
    assert ledger.update_poll_target.list_held_workflow_ids() == []
