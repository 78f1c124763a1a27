"""A handler is driven only for a claim this engine holds: never for one it does not.

``HandlerTable.drive`` runs on the maintenance thread right after a reclaim; by the time it runs
the claim may be gone (lost to another engine) or may never have been this engine's. The record
alone (``running``) is no licence: the handler would then act as an owner it is not.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engines import MakeOwnership, opened_engines
from weft_sync.clock import ManualClock
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import ReclaimedWorkflow
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
    with opened_engines(storage, clock, OPTIONS) as make:
        yield make


def test_a_handler_is_not_driven_for_a_running_workflow_whose_claim_another_engine_holds(
    make_ownership: MakeOwnership,
) -> None:
    owner = make_ownership("engine-a")
    owner.workflows.start("pay-1", "payout", input={"amount": 5})
    called: list[str] = []
    bystander = make_ownership(
        "engine-b", handlers={"payout": lambda ctx: called.append(ctx.workflow_id)}
    )
    record = owner.workflows.get("pay-1")
    assert record is not None and record.status == "running"
    assert bystander.registry.current_epoch("pay-1") is None

    bystander.handlers.drive("pay-1", record)
    bystander.handlers.drive("pay-1")

    assert called == []
    assert owner.workflows.get("pay-1").status == "running"  # type: ignore[union-attr]


def test_a_handler_is_not_driven_once_the_claim_it_was_reclaimed_with_is_lost(
    make_ownership: MakeOwnership, clock: ManualClock
) -> None:
    dead = make_ownership("engine-dead")
    dead.workflows.start("pay-1", "payout", input={"amount": 5})
    clock.advance(PAST_GRACE_MS)
    seen: list[ReclaimedWorkflow] = []
    survivor = make_ownership("engine-b", handlers={"payout": seen.append})
    survivor.run_maintenance()
    assert [ctx.epoch for ctx in seen] == [2]
    record = survivor.workflows.get("pay-1")
    # A third engine takes the claim over; the survivor learns it on its renewal.
    clock.advance(PAST_GRACE_MS)
    third = make_ownership("engine-c")
    assert third.registry.takeover("pay-1").status == "acquired"
    survivor.registry.renew("pay-1")
    assert survivor.registry.current_epoch("pay-1") is None

    survivor.handlers.drive("pay-1", record)

    assert [ctx.epoch for ctx in seen] == [2]
