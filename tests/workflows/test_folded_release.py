"""complete/fail commit the final state and the claim's release in one compare-and-swap."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest

from tests.claims.gated import (
    PAST_GRACE_MS,
    RENEW_MS,
    TTL_MS,
    WAITS_FOR_RENEWAL,
    WarningSink,
    pause_in_cas,
    start_until_logged,
    touches,
)
from tests.workflows.helpers import ReadHooks, holder_engine, stored_epoch
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import decode_holder, encode_workflow_record
from weft_sync.errors import EngineDeposedError, StorageError
from weft_sync.storage import Delete, Put
from weft_sync.storage.base import Batch
from weft_sync.workflows import Workflows

WF = "wf-1"
HOLDER = keys.workflow_owner_holder(WF)
RECORD = keys.workflow(WF)
Finish = Callable[[Workflows], object]
FINISHES: dict[str, Finish] = {
    "complete": lambda ledger: ledger.complete(WF, {"rows": 3}),
    "fail": lambda ledger: ledger.fail(WF, RuntimeError("bank said no")),
}
STATUS = {"complete": "completed", "fail": "failed"}


@pytest.mark.parametrize("operation", sorted(FINISHES))
def test_final_state_and_release_commit_in_one_transaction(
    ledger: Workflows,
    registry: ClaimRegistry,
    gated: ReadHooks,
    sink: WarningSink,
    operation: str,
) -> None:
    ledger.start(WF, "import")
    seen: list[Sequence[Batch]] = []

    def record(batches: Sequence[Batch]) -> bool:
        seen.append(batches)
        return True

    gated.intercept_next_cas(match=record)  # observes the next CAS and lets it commit
    before = gated.transactions
    FINISHES[operation](ledger)
    assert gated.transactions == before + 1
    ((conditions, operations),) = seen[0]
    assert {c.key for c in conditions} == {RECORD, keys.workflow_owner_epoch(WF), HOLDER}
    assert Delete(HOLDER) in operations
    assert any(isinstance(op, Put) and op.key == RECORD for op in operations)
    assert gated.get(HOLDER) is None
    assert stored_epoch(gated, WF) == 1
    found = ledger.get(WF)
    assert found is not None and found.status == STATUS[operation]
    assert registry.list_held_workflow_ids() == []
    assert registry.renew(WF).status == "not-held"
    assert sink.received == []


def test_a_renewal_started_while_complete_commits_is_not_held_and_warns_nothing(
    ledger: Workflows, registry: ClaimRegistry, gated: ReadHooks, sink: WarningSink
) -> None:
    ledger.start(WF, "import")
    gate, completing = pause_in_cas(gated, WF, lambda: ledger.complete(WF), "complete")
    before = gated.transactions
    assert registry.renew(WF).status == "not-held"
    assert registry.renew_many([WF])[0].status == "not-held"
    assert gated.transactions == before
    gate.open()
    assert completing.result().status == "completed"
    assert gated.get(HOLDER) is None
    assert registry.renew(WF).status == "not-held"
    assert sink.received == []


def test_complete_waits_for_a_renewal_in_flight_and_releases_what_it_wrote(
    ledger: Workflows,
    registry: ClaimRegistry,
    gated: ReadHooks,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    ledger.start(WF, "import")
    clock.advance(RENEW_MS)
    gate, renewal = pause_in_cas(gated, WF, lambda: registry.renew(WF), "renew")
    completing = start_until_logged(lambda: ledger.complete(WF), "complete", WAITS_FOR_RENEWAL)
    gate.open()
    assert renewal.result().status == "renewed"
    assert completing.result().status == "completed"
    assert gated.get(HOLDER) is None
    assert registry.list_held_workflow_ids() == []
    assert sink.received == []


def test_complete_after_an_ambiguous_renewal_commit_still_releases_in_one_write(
    ledger: Workflows,
    registry: ClaimRegistry,
    gated: ReadHooks,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    ledger.start(WF, "import")
    clock.advance(RENEW_MS)
    gated.raise_on_next_cas(StorageError("lost the reply"), after_commit=True, match=touches(WF))
    with pytest.raises(StorageError):
        registry.renew(WF)
    holder = decode_holder(gated.get(HOLDER))
    assert holder is not None and holder.expires_at == clock() + TTL_MS
    before = gated.transactions
    assert ledger.complete(WF).status == "completed"
    assert gated.transactions == before + 1
    assert gated.get(HOLDER) is None
    assert sink.received == []


def test_a_takeover_just_before_the_commit_makes_complete_raise_deposed(
    ledger: Workflows,
    registry: ClaimRegistry,
    registry_b: ClaimRegistry,
    gated: ReadHooks,
    clock: ManualClock,
    sink: WarningSink,
    sink_b: WarningSink,
) -> None:
    ledger.start(WF, "import")
    clock.advance(PAST_GRACE_MS)
    taken: list[str] = []
    gated.before_next_cas(
        lambda: taken.append(str(registry_b.takeover(WF).status)), match=touches(WF)
    )
    with pytest.raises(EngineDeposedError):
        ledger.complete(WF)
    assert taken == ["acquired"]
    found = ledger.get(WF)
    assert found is not None and found.status == "running"
    assert ledger.get_outcome(WF) is None
    assert (holder_engine(gated, WF), stored_epoch(gated, WF)) == ("engine-b", 2)
    assert sink.lost_ids() == [WF]
    assert sink_b.received == []


def test_a_holder_deleted_under_complete_makes_it_raise_deposed(
    ledger: Workflows, gated: ReadHooks, sink: WarningSink
) -> None:
    ledger.start(WF, "import")
    gated.before_next_cas(lambda: gated.inner.delete(HOLDER), match=touches(WF))
    with pytest.raises(EngineDeposedError):
        ledger.complete(WF)
    found = ledger.get(WF)
    assert found is not None and found.status == "running"
    assert sink.lost_ids() == [WF]


def test_complete_retries_when_only_the_record_changed(
    ledger: Workflows, registry: ClaimRegistry, gated: ReadHooks, sink: WarningSink
) -> None:
    record = ledger.start(WF, "import")
    touched = replace(record, updated_at=record.updated_at + 1)
    gated.before_next_cas(
        lambda: gated.inner.put(RECORD, encode_workflow_record(touched)), match=touches(WF)
    )
    before = gated.transactions
    assert ledger.complete(WF).status == "completed"
    assert gated.transactions == before + 2
    assert gated.get(HOLDER) is None
    assert registry.list_held_workflow_ids() == []
    assert sink.received == []


def test_complete_whose_commit_landed_but_raised_returns_the_completed_record(
    ledger: Workflows, registry: ClaimRegistry, gated: ReadHooks, sink: WarningSink
) -> None:
    ledger.start(WF, "import")
    gated.raise_on_next_cas(StorageError("lost the reply"), after_commit=True, match=touches(WF))
    assert ledger.complete(WF, {"rows": 3}).status == "completed"
    assert gated.get(HOLDER) is None
    assert registry.list_held_workflow_ids() == []
    assert registry.renew(WF).status == "not-held"
    assert sink.received == []


def test_complete_whose_commit_raised_and_cannot_be_read_back_keeps_the_claim(
    ledger: Workflows, registry: ClaimRegistry, gated: ReadHooks, sink: WarningSink
) -> None:
    ledger.start(WF, "import")

    def fail_read() -> None:
        raise StorageError("still down")

    # The commit raises before reaching the store, and the read-back of the record fails too.
    gated.intercept_next_cas(
        error=StorageError("lost the reply"),
        before=lambda: gated.before_next_read_of(RECORD, fail_read),
        match=touches(WF),
    )
    with pytest.raises(StorageError, match="lost the reply"):
        ledger.complete(WF)
    assert registry.current_epoch(WF) == 1
    assert registry.renew(WF).status == "renewed"
    assert ledger.complete(WF).status == "completed"
    assert sink.received == []
