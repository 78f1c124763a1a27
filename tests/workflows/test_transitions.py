"""Self transitions (complete/fail), external ones (cancel/timeout/suspend/purge) and resume."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.claims.gated import PAST_GRACE_MS, RENEW_MS, TTL_MS, GatedStorage, WarningSink
from tests.workflows.helpers import (
    ReadHooks,
    assert_index_matches_records,
    holder_engine,
    snapshot,
    stored_epoch,
)
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.errors import (
    EngineDeposedError,
    StorageError,
    WorkflowClaimUnavailableError,
    WorkflowWakeDiscardedWarning,
)
from weft_sync.ledger.external import EXTERNAL_MAX_ATTEMPTS
from weft_sync.ledger.records import checkpoint_key
from weft_sync.storage import Storage
from weft_sync.workflows import (
    ExternalCommitConflictError,
    WorkflowNotFoundError,
    WorkflowOutcome,
    Workflows,
    WorkflowStateError,
)

WF = "wf-1"


# -- self transitions ---------------------------------------------------------------------------


def test_complete_commits_state_and_releases_the_claim(
    ledger: Workflows, registry: ClaimRegistry, gated: GatedStorage, clock: ManualClock
) -> None:
    ledger.start(WF, "import")
    clock.advance(10)
    record = ledger.complete(WF, {"rows": 3})
    assert (record.status, record.updated_at) == ("completed", clock())
    assert ledger.get(WF) == record
    assert ledger.get_outcome(WF) == WorkflowOutcome(WF, "completed", {"rows": 3}, None, clock())
    assert_index_matches_records(gated)
    assert gated.get(keys.workflow_owner_holder(WF)) is None
    assert stored_epoch(gated, WF) == 1
    assert registry.current_epoch(WF) is None
    assert registry.renew(WF).status == "not-held"


def test_fail_stores_an_exception_as_type_and_message(
    ledger: Workflows, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    ledger.fail(WF, RuntimeError("bank said no"))
    outcome = ledger.get_outcome(WF)
    assert outcome is not None
    assert (outcome.status, outcome.error) == (
        "failed",
        {"type": "RuntimeError", "message": "bank said no"},
    )
    assert_index_matches_records(gated)


def test_complete_with_an_unencodable_result_writes_nothing(
    ledger: Workflows, gated: GatedStorage, registry: ClaimRegistry
) -> None:
    ledger.start(WF, "import")
    before = snapshot(gated)
    with pytest.raises(ValueError, match="MessagePack"):
        ledger.complete(WF, object())
    assert snapshot(gated) == before
    assert registry.current_epoch(WF) == 1


def test_complete_by_a_deposed_owner_is_refused(
    ledger: Workflows,
    registry_b: ClaimRegistry,
    gated: GatedStorage,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    ledger.start(WF, "import")
    clock.advance(PAST_GRACE_MS)
    assert registry_b.takeover(WF).status == "acquired"
    with pytest.raises(EngineDeposedError):
        ledger.complete(WF)
    assert ledger.get(WF) is not None and ledger.get(WF).status == "running"  # type: ignore[union-attr]
    assert holder_engine(gated, WF) == "engine-b"
    assert sink.lost_ids() == [WF]


# -- external transitions -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "status"),
    [("cancel", "cancelled"), ("timeout", "timed-out"), ("suspend", "suspended")],
)
def test_external_transition_deposes_a_live_owner(
    ledger: Workflows,
    registry: ClaimRegistry,
    client: Workflows,
    gated: GatedStorage,
    sink: WarningSink,
    operation: str,
    status: str,
) -> None:
    ledger.start(WF, "import")
    record = getattr(client, operation)(WF)
    assert record.status == status
    assert_index_matches_records(gated)
    assert gated.get(keys.workflow_owner_holder(WF)) is None
    assert stored_epoch(gated, WF) == 2
    with pytest.raises(EngineDeposedError):
        ledger.save_checkpoint(WF, b"late")
    assert gated.get(checkpoint_key(WF)) is None
    # One lost claim, one warning: the fenced write dropped it, so the renewal finds nothing.
    assert registry.renew(WF).status == "not-held"
    assert sink.lost_ids() == [WF]


def test_terminal_states_are_final(
    ledger: Workflows, client: Workflows, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    ledger.complete(WF)
    before = snapshot(gated)
    for operation in ("cancel", "timeout", "suspend"):
        with pytest.raises(WorkflowStateError, match="'completed'") as caught:
            getattr(client, operation)(WF)
        assert (caught.value.status, caught.value.operation) == ("completed", operation)
    assert snapshot(gated) == before


def test_suspending_a_suspended_workflow_is_refused(ledger: Workflows, client: Workflows) -> None:
    ledger.start(WF, "import")
    client.suspend(WF)
    with pytest.raises(WorkflowStateError, match="'suspended'"):
        client.suspend(WF)


@pytest.mark.parametrize("operation", ["cancel", "timeout", "suspend", "purge"])
def test_external_transition_of_an_unknown_workflow_is_not_found(
    client: Workflows, operation: str
) -> None:
    with pytest.raises(WorkflowNotFoundError, match="does not exist"):
        getattr(client, operation)("ghost")


def test_own_suspend_forgets_the_local_claim_without_a_warning(
    ledger: Workflows, registry: ClaimRegistry, sink: WarningSink
) -> None:
    ledger.start(WF, "import")
    ledger.suspend(WF)
    assert registry.current_epoch(WF) is None
    assert registry.renew(WF).status == "not-held"
    assert sink.received == []


def test_an_external_commit_retries_a_lost_precondition_up_to_the_bound(
    ledger: Workflows, client: Workflows, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    for _ in range(EXTERNAL_MAX_ATTEMPTS - 1):
        gated.force_next_cas(False)
    assert client.cancel(WF).status == "cancelled"


def test_an_external_commit_gives_up_after_the_bound_and_changes_nothing(
    ledger: Workflows, client: Workflows, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    before = snapshot(gated)
    for _ in range(EXTERNAL_MAX_ATTEMPTS):
        gated.force_next_cas(False)
    with pytest.raises(ExternalCommitConflictError, match="lost its precondition"):
        client.cancel(WF)
    assert snapshot(gated) == before


def test_purge_removes_everything_but_the_epoch(
    ledger: Workflows, client: Workflows, registry: ClaimRegistry, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    ledger.start("keep", "import")
    ledger.save_checkpoint(WF, b"c")
    client.send_signal(WF, "go", 1)
    client.submit_update(WF, "bump", 2)
    client.purge(WF)
    assert client.get(WF) is None
    assert_index_matches_records(gated)
    assert [k for k in snapshot(gated) if WF in k] == [keys.workflow_owner_epoch(WF)]
    assert stored_epoch(gated, WF) == 2
    assert registry.current_epoch(WF) == 1  # another process purged: only renewal notices
    assert registry.renew(WF).status == "lost"


def test_purge_of_a_corrupt_record_removes_every_index_entry(
    client: Workflows, gated: GatedStorage
) -> None:
    gated.put(keys.workflow(WF), b"garbage")
    gated.put(keys.workflow_status_index("running", WF), b"")
    client.purge(WF)
    assert snapshot(gated) == {
        keys.workflow_owner_epoch(WF): gated.get(keys.workflow_owner_epoch(WF))
    }


OPERATIONS: dict[str, Callable[[Workflows, Workflows], object]] = {
    "complete": lambda owner, _client: owner.complete(WF),
    "fail": lambda owner, _client: owner.fail(WF, "boom"),
    "cancel": lambda _owner, client: client.cancel(WF),
    "suspend": lambda _owner, client: client.suspend(WF),
    "purge": lambda _owner, client: client.purge(WF),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_failed_transition_commit_changes_nothing(
    ledger: Workflows,
    client: Workflows,
    registry: ClaimRegistry,
    gated: GatedStorage,
    operation: str,
) -> None:
    ledger.start(WF, "import")
    ledger.save_checkpoint(WF, b"c")
    before = snapshot(gated)
    gated.raise_on_next_cas(StorageError("connection reset"))
    with pytest.raises(StorageError):
        OPERATIONS[operation](ledger, client)
    assert snapshot(gated) == before
    assert registry.current_epoch(WF) == 1
    assert registry.renew(WF).status == "renewed"


# -- resume -------------------------------------------------------------------------------------


def test_resume_of_a_held_workflow_keeps_the_claim(
    ledger: Workflows, registry: ClaimRegistry, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    transactions = gated.transactions
    assert ledger.resume(WF).status == "running"
    assert gated.transactions == transactions
    assert registry.current_epoch(WF) == 1


def test_resume_after_own_suspend_runs_again_at_a_new_epoch(
    ledger: Workflows, registry: ClaimRegistry, gated: GatedStorage, sink: WarningSink
) -> None:
    ledger.start(WF, "import")
    ledger.suspend(WF)
    record = ledger.resume(WF)
    assert record.status == "running"
    assert registry.current_epoch(WF) == 3
    assert_index_matches_records(gated)
    assert sink.received == []
    ledger.save_checkpoint(WF, b"after-resume")


def test_resume_after_a_foreign_suspend_acquires_afresh(
    ledger: Workflows, client: Workflows, registry: ClaimRegistry, sink: WarningSink
) -> None:
    ledger.start(WF, "import")
    client.suspend(WF)
    # This engine still caches epoch 1; the holder is gone, so resume acquires anew.
    assert ledger.resume(WF).status == "running"
    assert registry.current_epoch(WF) == 3
    assert [type(w) for w in sink.received] == [WorkflowWakeDiscardedWarning]


def test_resume_against_a_live_foreign_claim_is_unavailable(
    ledger: Workflows, ledger_b: Workflows, registry_b: ClaimRegistry
) -> None:
    ledger.start(WF, "import")
    with pytest.raises(WorkflowClaimUnavailableError) as caught:
        ledger_b.resume(WF)
    assert caught.value.held_by == "engine-a"
    assert registry_b.current_epoch(WF) is None


def test_resume_after_being_taken_over_is_unavailable(
    ledger: Workflows,
    registry: ClaimRegistry,
    registry_b: ClaimRegistry,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    ledger.start(WF, "import")
    clock.advance(PAST_GRACE_MS)
    assert registry_b.takeover(WF).status == "acquired"
    with pytest.raises(WorkflowClaimUnavailableError) as caught:
        ledger.resume(WF)
    assert caught.value.held_by == "engine-b"
    assert [type(w) for w in sink.received] == [WorkflowWakeDiscardedWarning]


def test_resume_with_a_corrupt_holder_is_unavailable(
    ledger: Workflows, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    gated.put(keys.workflow_owner_holder(WF), b"\xc1")
    with pytest.raises(WorkflowClaimUnavailableError) as caught:
        ledger.resume(WF)
    assert caught.value.held_by is None


def test_resume_of_an_ownerless_running_workflow_acquires_it(
    ledger: Workflows, ledger_b: Workflows, registry: ClaimRegistry, registry_b: ClaimRegistry
) -> None:
    ledger.start(WF, "import")
    registry.release(WF)
    assert ledger_b.resume(WF).status == "running"
    assert registry_b.current_epoch(WF) == 2


def test_resume_of_a_finished_workflow_is_refused(ledger: Workflows) -> None:
    ledger.start(WF, "import")
    ledger.complete(WF)
    with pytest.raises(WorkflowStateError, match="resume"):
        ledger.resume(WF)


def test_resume_releases_the_claim_if_the_workflow_finished_meanwhile(
    storage: Storage, clock: ManualClock
) -> None:
    store = ReadHooks(storage)
    registry = ClaimRegistry(
        store,
        engine_id="engine-a",
        clock=clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        warn=WarningSink(),
    )
    ledger = Workflows(store, registry, clock=clock)
    client = Workflows(store, None, clock=clock)
    ledger.start(WF, "import")
    ledger.suspend(WF)
    # The cancel lands between resume's status check and its acquire.
    store.before_next_read_of(keys.workflow_owner_holder(WF), lambda: client.cancel(WF))
    with pytest.raises(WorkflowStateError, match="'cancelled'"):
        ledger.resume(WF)
    assert registry.current_epoch(WF) is None
    assert store.get(keys.workflow_owner_holder(WF)) is None
    assert stored_epoch(store, WF) == 4


def test_a_finish_of_a_claim_never_held_warns_of_no_loss(
    sink: WarningSink, ledger: Workflows
) -> None:
    """As a fenced write does: a claim this engine does not hold is refused (``not_held``), and
    no claim-lost warning is given for it (a loss is reported when it happens, once)."""
    with pytest.raises(EngineDeposedError) as raised:
        ledger.complete(WF)
    assert raised.value.cause == "not_held"
    with pytest.raises(EngineDeposedError):
        ledger.save_checkpoint(WF, b"x")
    assert sink.received == []
