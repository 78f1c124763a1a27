"""Workflow handlers: reclaimed workflows are driven by the handler for their type, as the owner.

A dead engine is an ``Ownership`` on a ``ManualClock`` that stops running maintenance; moving the
clock past the TTL and grace makes its claims takeover-eligible for the survivor sharing the
clock. Both engines write to one real store (SQLite and PostgreSQL).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import weft_sync
from tests.claims.gated import WarningSink
from tests.engines import MakeOwnership, opened_engines
from tests.maintenance.discovery_helpers import ReadCounting
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync.clock import ManualClock
from weft_sync.errors import EngineDeposedError, WorkflowClaimLostWarning
from weft_sync.metrics import ClaimMetrics
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership, ReclaimedWorkflow
from weft_sync.ownership.handler_table import HandlerTable
from weft_sync.storage import Storage

TTL_MS = 3_000
RENEW_MS = 1_000
PAST_GRACE_MS = TTL_MS + 2 * RENEW_MS + 1
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000)


@pytest.fixture
def make_ownership(storage: Storage, clock: ManualClock) -> Iterator[MakeOwnership]:
    """Open manual-maintenance engines on the test's store; all closed afterwards."""
    with opened_engines(storage, clock, OPTIONS) as make:
        yield make


class Calls:
    """A handler recording the contexts it was called with (thread-safe)."""

    def __init__(self, body: Callable[[ReclaimedWorkflow], object] | None = None) -> None:
        # _lock guards contexts.
        self._lock = threading.Lock()
        self.contexts: list[ReclaimedWorkflow] = []
        self._body = body

    def __call__(self, ctx: ReclaimedWorkflow) -> None:
        with self._lock:
            self.contexts.append(ctx)
        if self._body is not None:
            self._body(ctx)


def _strand(dead: Ownership, clock: ManualClock, *items: tuple[str, str]) -> None:
    """Start ``(id, type)`` workflows on ``dead``, then let its claims expire past the grace."""
    for workflow_id, workflow_type in items:
        dead.workflows.start(workflow_id, workflow_type, input={"amount": 5})
    clock.advance(PAST_GRACE_MS)


def _statuses(result: Any) -> dict[str, str]:
    assert result.reclaim is not None and result.reclaim.status == "completed"
    return {o.workflow_id: o.status.value for o in result.reclaim.outcomes}


# -- driving as the new owner ----------------------------------------------------------------


def test_handler_drives_the_reclaimed_workflow_as_its_new_owner_and_the_old_owner_is_refused(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    dead_warnings = WarningSink()
    dead = make_ownership("engine-dead", warn=dead_warnings)
    _strand(dead, clock, ("pay-1", "payout"))

    def resume(ctx: ReclaimedWorkflow) -> None:
        ctx.workflows.save_checkpoint(ctx.workflow_id, b"resumed")
        ctx.workflows.complete(ctx.workflow_id, result={"paid": ctx.record.input["amount"]})

    handler = Calls(resume)
    survivor = make_ownership("engine-b", handlers={"payout": handler})

    assert _statuses(survivor.run_maintenance()) == {"pay-1": "reclaimed"}

    (ctx,) = handler.contexts
    assert (ctx.workflow_id, ctx.type, ctx.epoch) == ("pay-1", "payout", 2)
    assert ctx.record.status == "running" and ctx.record.input == {"amount": 5}
    assert ctx.ownership is survivor and ctx.workflows is survivor.workflows
    outcome = survivor.workflows.get_outcome("pay-1")
    assert outcome is not None and (outcome.status, outcome.result) == ("completed", {"paid": 5})
    assert survivor.workflows.load_checkpoint("pay-1") == b"resumed"
    # The deposed engine still believes it holds epoch 1: the store refuses its write.
    assert dead.registry.current_epoch("pay-1") == 1
    with pytest.raises(EngineDeposedError):
        dead.workflows.save_checkpoint("pay-1", b"late write")
    assert survivor.workflows.load_checkpoint("pay-1") == b"resumed"
    assert [type(w) for w in dead_warnings.received] == [WorkflowClaimLostWarning]
    assert stored_epoch(storage, "pay-1") == 2


def test_handler_registered_with_the_decorator_after_open_drives_the_next_pass(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    dead = make_ownership("engine-dead")
    _strand(dead, clock, ("pay-1", "payout"))
    survivor = make_ownership("engine-b")
    assert _statuses(survivor.run_maintenance()) == {"pay-1": "not-eligible"}
    seen: list[int] = []

    @survivor.handler("payout")
    def resume_payout(ctx: ReclaimedWorkflow) -> None:
        seen.append(ctx.epoch)
        ctx.workflows.complete(ctx.workflow_id)

    assert callable(resume_payout)  # the decorator returns the function
    assert survivor.handlers.get("payout") is resume_payout
    assert _statuses(survivor.run_maintenance()) == {"pay-1": "reclaimed"}
    assert seen == [2]
    assert survivor.workflows.get("pay-1").status == "completed"  # type: ignore[union-attr]


def test_each_type_goes_to_its_own_handler_and_unhandled_types_are_left_alone(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    dead = make_ownership("engine-dead")
    _strand(dead, clock, ("pay-1", "payout"), ("rep-1", "report"), ("mail-1", "mailing"))
    payouts, reports = Calls(), Calls()
    survivor = make_ownership("engine-b", handlers={"payout": payouts, "report": reports})

    statuses = _statuses(survivor.run_maintenance())

    assert statuses == {"pay-1": "reclaimed", "rep-1": "reclaimed", "mail-1": "not-eligible"}
    assert [c.workflow_id for c in payouts.contexts] == ["pay-1"]
    assert [c.workflow_id for c in reports.contexts] == ["rep-1"]
    assert (holder_engine(storage, "mail-1"), stored_epoch(storage, "mail-1")) == (
        "engine-dead",
        1,
    )


# -- eligibility -----------------------------------------------------------------------------


def test_an_engine_without_handlers_is_eligible_or_on_reclaimed_reclaims_nothing(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    dead = make_ownership("engine-dead")
    _strand(dead, clock, ("pay-1", "payout"), ("rep-1", "report"))
    bystander = make_ownership("engine-b")

    statuses = _statuses(bystander.run_maintenance())

    assert statuses == {"pay-1": "not-eligible", "rep-1": "not-eligible"}
    assert bystander.registry.list_held_workflow_ids() == []
    for workflow_id in ("pay-1", "rep-1"):
        assert (holder_engine(storage, workflow_id), stored_epoch(storage, workflow_id)) == (
            "engine-dead",
            1,
        )
    assert bystander.metrics.snapshot().attempts["takeover"] == 0


def test_on_reclaimed_drives_types_without_a_handler_and_is_eligible_narrows_them(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    dead = make_ownership("engine-dead")
    _strand(dead, clock, ("pay-1", "payout"), ("rep-1", "report"), ("mail-1", "mailing"))
    driven: list[str] = []
    payouts = Calls()
    survivor = make_ownership(
        "engine-b",
        handlers={"payout": payouts},
        on_reclaimed=driven.append,
        is_eligible=lambda workflow_type, revision: workflow_type == "report",
    )

    statuses = _statuses(survivor.run_maintenance())

    assert statuses == {"pay-1": "reclaimed", "rep-1": "reclaimed", "mail-1": "not-eligible"}
    assert [c.workflow_id for c in payouts.contexts] == ["pay-1"]
    assert driven == ["rep-1"]  # the handler's type never reaches on_reclaimed


def test_is_eligible_alone_claims_the_workflow_for_the_host_to_drive(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    dead = make_ownership("engine-dead")
    _strand(dead, clock, ("rep-1", "report"))
    host = make_ownership("engine-b", is_eligible=lambda workflow_type, revision: True)

    assert _statuses(host.run_maintenance()) == {"rep-1": "reclaimed"}

    # Nothing here drives it, but the host holds it (and renews it) at the new epoch.
    assert host.registry.current_epoch("rep-1") == 2
    assert holder_engine(storage, "rep-1") == "engine-b"
    host.workflows.complete("rep-1")
    assert host.workflows.get("rep-1").status == "completed"  # type: ignore[union-attr]


def test_eligibility_rule_handler_then_is_eligible_then_on_reclaimed() -> None:
    def table(**kwargs: Any) -> HandlerTable:
        kwargs.setdefault("on_reclaimed", None)
        kwargs.setdefault("is_eligible", None)
        return HandlerTable(kwargs.pop("handlers", None), metrics=ClaimMetrics(), **kwargs)

    def noop(ctx: ReclaimedWorkflow) -> None:
        return None

    assert not table().is_eligible("payout", None)
    assert table(handlers={"payout": noop}).is_eligible("payout", None)
    assert not table(handlers={"payout": noop}).is_eligible("report", None)
    assert table(on_reclaimed=print).is_eligible("anything", "r1")
    only_v2 = table(on_reclaimed=print, is_eligible=lambda t, r: r == "v2")
    assert only_v2.is_eligible("report", "v2") and not only_v2.is_eligible("report", "v1")
    # A handler makes its type eligible whatever the predicate says.
    never = table(handlers={"payout": noop}, is_eligible=lambda t, r: False)
    assert never.is_eligible("payout", None) and not never.is_eligible("report", None)


# -- failures --------------------------------------------------------------------------------


def test_a_handler_that_raises_is_logged_counted_released_and_driven_again(
    make_ownership: MakeOwnership,
    clock: ManualClock,
    storage: Storage,
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = make_ownership("engine-dead")
    _strand(dead, clock, ("pay-1", "payout"))
    attempts: list[int] = []

    def flaky(ctx: ReclaimedWorkflow) -> None:
        attempts.append(ctx.epoch)
        if len(attempts) == 1:
            raise RuntimeError("payment gateway down")
        ctx.workflows.complete(ctx.workflow_id)

    survivor = make_ownership("engine-b", handlers={"payout": flaky})

    with caplog.at_level(logging.WARNING):
        first = survivor.run_maintenance()
    assert _statuses(first) == {"pay-1": "reclaimed"}
    (logged,) = [r for r in caplog.records if r.name == "weft_sync.ownership.handler_table"]
    assert "'payout'" in logged.getMessage() and "'pay-1'" in logged.getMessage()
    assert logged.exc_info is not None
    assert survivor.metrics.snapshot().handler_failures == {"payout": 1}
    assert 'weft_workflow_claim_handler_failures_total{type="payout"} 1' in (
        weft_sync.metrics.serialize_prometheus(survivor.metrics.snapshot()).splitlines()
    )
    # Released for a redrive: nobody holds it, it is still running, the epoch is kept.
    assert (holder_engine(storage, "pay-1"), stored_epoch(storage, "pay-1")) == (None, 2)
    assert survivor.workflows.get("pay-1").status == "running"  # type: ignore[union-attr]
    assert survivor.drivers.attempts("pay-1") == 1

    assert _statuses(survivor.run_maintenance()) == {"pay-1": "reclaimed"}
    assert attempts == [2, 3]
    assert survivor.workflows.get("pay-1").status == "completed"  # type: ignore[union-attr]
    assert survivor.metrics.snapshot().handler_failures == {"payout": 1}
    assert survivor.drivers.attempts("pay-1") == 0


def test_closing_the_ownership_from_inside_a_handler_is_refused(
    make_ownership: MakeOwnership, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    dead = make_ownership("engine-dead")
    _strand(dead, clock, ("pay-1", "payout"))
    survivor = make_ownership("engine-b")
    refused: list[BaseException] = []

    @survivor.handler("payout")
    def close_from_inside(ctx: ReclaimedWorkflow) -> None:
        try:
            ctx.ownership.close()
        except RuntimeError as exc:
            refused.append(exc)
            raise

    with caplog.at_level(logging.WARNING):
        survivor.run_maintenance()
    (error,) = refused
    assert "close it from another thread" in str(error)
    assert not survivor.closed


# -- registration ----------------------------------------------------------------------------


def test_registering_a_second_handler_for_a_type_is_refused(make_ownership: MakeOwnership) -> None:
    def first(ctx: ReclaimedWorkflow) -> None:
        return None

    ownership = make_ownership("engine-a", handlers={"payout": first})
    with pytest.raises(ValueError, match="'payout' already has a handler"):
        ownership.handler("payout")(first)
    assert ownership.handlers.types() == ["payout"]


@pytest.mark.parametrize(
    ("handlers", "error", "match"),
    [
        ([("payout", print)], TypeError, "handlers must be a mapping .* got list"),
        ({"payout": "resume"}, TypeError, "handler for workflow type 'payout' must be callable"),
        ({"": print}, ValueError, "workflow type must be a non-empty string"),
        ({3: print}, TypeError, "workflow type must be a str, got int 3"),
    ],
)
def test_open_rejects_bad_handlers(
    storage: Storage, handlers: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Ownership.open(storage, handlers=handlers, background="manual")


def test_handler_decorator_checks_the_type_before_decorating(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership("engine-a")
    with pytest.raises(ValueError, match="non-empty"):
        ownership.handler("")
    with pytest.raises(TypeError, match="must be callable"):
        ownership.handler("payout")(42)  # type: ignore[type-var]


def test_reclaimed_workflow_is_exported_from_the_package_and_the_facade_module() -> None:
    assert weft_sync.ReclaimedWorkflow is ReclaimedWorkflow
    assert weft_sync.WorkflowHandler is weft_sync.ownership.facade.WorkflowHandler
    assert "ReclaimedWorkflow" in weft_sync.__all__


def test_a_reclaimed_workflows_record_is_read_once_between_its_takeover_and_its_handler(
    storage: Storage, clock: ManualClock
) -> None:
    counting = ReadCounting(storage)
    with opened_engines(counting, clock, OPTIONS) as make:  # type: ignore[arg-type]
        dead = make("engine-dead")
        _strand(dead, clock, ("pay-1", "payout"), ("pay-2", "payout"))
        handler = Calls()
        survivor = make("engine-b", handlers={"payout": handler})
        counting.reset()

        assert _statuses(survivor.run_maintenance()) == {"pay-1": "reclaimed", "pay-2": "reclaimed"}

        assert sorted(ctx.workflow_id for ctx in handler.contexts) == ["pay-1", "pay-2"]
        assert all(ctx.record.status == "running" for ctx in handler.contexts)
        record_reads = [key for key in counting.got if key in ("wf:pay-1", "wf:pay-2")]
        # Per workflow: the eligibility read before the takeover and the confirming read after
        # it; the handler is given that record instead of reading it a third time.
        assert sorted(record_reads) == ["wf:pay-1", "wf:pay-1", "wf:pay-2", "wf:pay-2"]
