"""Start (folded acquire), get and list: record, index and claim change in one write."""

from __future__ import annotations

import pickle

import pytest

from tests.claims.gated import START_MS, GatedStorage, WarningSink, Worker
from tests.workflows.helpers import (
    assert_index_matches_records,
    holder_engine,
    snapshot,
    stored_epoch,
)
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import WorkflowRecord
from weft_sync.errors import (
    StorageError,
    WeftError,
    WorkflowClaimUnavailableError,
    WorkflowExistsError,
)
from weft_sync.ledger import listing
from weft_sync.ledger.records import checkpoint_key, signal_prefix
from weft_sync.metrics import ClaimMetrics
from weft_sync.workflows import Workflows


def test_start_writes_record_index_and_claim_in_one_transaction(
    ledger: Workflows, registry: ClaimRegistry, gated: GatedStorage
) -> None:
    record = ledger.start("wf-1", "import", input={"rows": 3})
    assert record == WorkflowRecord("wf-1", "import", "running", {"rows": 3}, START_MS, START_MS)
    assert gated.transactions == 1
    assert ledger.get("wf-1") == record
    assert_index_matches_records(gated)
    assert (stored_epoch(gated, "wf-1"), holder_engine(gated, "wf-1")) == (1, "engine-a")
    assert registry.current_epoch("wf-1") == 1


def test_start_of_an_existing_id_changes_nothing(
    ledger: Workflows, ledger_b: Workflows, registry_b: ClaimRegistry, gated: GatedStorage
) -> None:
    ledger.start("wf-1", "import")
    before = snapshot(gated)
    with pytest.raises(WorkflowClaimUnavailableError) as caught:
        ledger_b.start("wf-1", "import")
    assert (caught.value.workflow_id, caught.value.held_by) == ("wf-1", "engine-a")
    assert snapshot(gated) == before
    assert registry_b.current_epoch("wf-1") is None


def test_start_of_a_finished_id_reports_no_holder(ledger: Workflows) -> None:
    ledger.start("wf-1", "import")
    ledger.complete("wf-1")
    with pytest.raises(WorkflowClaimUnavailableError) as caught:
        ledger.start("wf-1", "import")
    assert caught.value.held_by is None


def test_start_of_an_existing_id_says_it_exists_and_in_which_status(
    ledger: Workflows, ledger_b: Workflows
) -> None:
    ledger.start("wf-1", "import")
    with pytest.raises(WorkflowExistsError) as running:
        ledger_b.start("wf-1", "import")
    assert (running.value.status, running.value.held_by) == ("running", "engine-a")
    assert str(running.value) == (
        "workflow 'wf-1' already exists with status 'running', claimed by 'engine-a'; start it "
        "under a new id, or purge the old one first"
    )
    ledger.complete("wf-1")
    with pytest.raises(WorkflowExistsError) as completed:
        ledger.start("wf-1", "import")
    assert "already exists with status 'completed';" in str(completed.value)
    assert "retry later" not in str(completed.value)
    # Existing callers catching the broader error still catch it, and it survives pickling.
    assert isinstance(completed.value, WorkflowClaimUnavailableError)
    copy = pickle.loads(pickle.dumps(completed.value))
    assert (copy.workflow_id, copy.status, str(copy)) == (
        "wf-1",
        "completed",
        str(completed.value),
    )


def test_start_and_resume_count_as_acquired_claim_attempts(
    gated: GatedStorage, registry: ClaimRegistry, clock: ManualClock
) -> None:
    metrics = ClaimMetrics()
    ledger = Workflows(gated, registry, clock=clock, metrics=metrics)
    ledger.start("wf-1", "import")
    ledger.suspend("wf-1")
    ledger.resume("wf-1")
    with pytest.raises(WorkflowExistsError):
        ledger.start("wf-1", "import")
    assert metrics.snapshot().attempts["acquired"] == 2


def test_start_against_a_claim_held_elsewhere_names_the_holder(
    ledger: Workflows, registry: ClaimRegistry, registry_b: ClaimRegistry, gated: GatedStorage
) -> None:
    assert registry_b.acquire("wf-1").status == "acquired"
    before = snapshot(gated)
    with pytest.raises(WorkflowClaimUnavailableError) as caught:
        ledger.start("wf-1", "import")
    assert caught.value.held_by == "engine-b"
    assert snapshot(gated) == before
    assert registry.current_epoch("wf-1") is None


def test_concurrent_starts_of_one_id_have_exactly_one_winner(
    ledger: Workflows, ledger_b: Workflows, registry: ClaimRegistry, gated: GatedStorage
) -> None:
    gate = gated.pause_next_cas()
    first = Worker(lambda: ledger.start("wf-1", "import"), "start-a")
    gate.wait_reached()
    ledger_b.start("wf-1", "import")
    gate.open()
    error = first.error()
    assert isinstance(error, WorkflowClaimUnavailableError)
    assert error.held_by == "engine-b"
    assert registry.current_epoch("wf-1") is None
    assert holder_engine(gated, "wf-1") == "engine-b"
    assert_index_matches_records(gated)


def test_a_failed_start_commit_changes_nothing(
    ledger: Workflows, registry: ClaimRegistry, gated: GatedStorage
) -> None:
    gated.raise_on_next_cas(StorageError("disk full"))
    with pytest.raises(StorageError):
        ledger.start("wf-1", "import")
    assert snapshot(gated) == {}
    assert registry.current_epoch("wf-1") is None


@pytest.mark.parametrize(
    ("workflow_id", "wf_type", "wf_input", "message"),
    [
        ("", "import", None, "non-empty"),
        ("wf-1", "", None, "workflow type"),
        ("wf-1", "import", {"when": object()}, "MessagePack"),
    ],
)
def test_start_validates_before_writing(
    ledger: Workflows,
    gated: GatedStorage,
    workflow_id: str,
    wf_type: str,
    wf_input: object,
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        ledger.start(workflow_id, wf_type, input=wf_input)
    assert gated.transactions == 0
    assert snapshot(gated) == {}


def test_start_after_purge_gets_a_larger_epoch_and_a_clean_slate(
    ledger: Workflows, gated: GatedStorage
) -> None:
    ledger.start("wf-1", "import")
    ledger.purge("wf-1")
    # A signal that outlived a purge (sent between its scan and its commit) is cleared by start.
    stray = signal_prefix("wf-1", "go") + "0"
    gated.put(stray, b"\x80")
    ledger.start("wf-1", "import")
    assert stored_epoch(gated, "wf-1") == 3
    assert gated.get(stray) is None


def test_client_without_registry_cannot_start(client: Workflows) -> None:
    with pytest.raises(WeftError, match="no claim registry") as raised:
        client.start("wf-1", "import")
    assert raised.type is WeftError  # misuse, not a storage failure or a lost race


def test_get_of_an_unknown_id_is_none(ledger: Workflows) -> None:
    assert ledger.get("nope") is None


def test_list_reads_the_index_or_every_record(
    ledger: Workflows, client: Workflows, gated: GatedStorage
) -> None:
    for n in range(4):
        ledger.start(f"wf-{n}", "import")
    ledger.save_checkpoint("wf-0", b"ckpt")
    client.cancel("wf-1")
    ledger.complete("wf-2")
    assert [r.workflow_id for r in client.list()] == ["wf-0", "wf-1", "wf-2", "wf-3"]
    assert [r.workflow_id for r in client.list(status="running")] == ["wf-0", "wf-3"]
    assert [r.workflow_id for r in client.list(status="cancelled")] == ["wf-1"]
    assert client.list(status="failed") == []
    assert [r.workflow_id for r in client.list(limit=2)] == ["wf-0", "wf-1"]
    assert client.list(status="running", limit=0) == []
    assert gated.get(checkpoint_key("wf-0")) == b"ckpt"


def test_list_pages_through_long_ranges(
    ledger: Workflows, client: Workflows, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listing, "SCAN_PAGE", 2)
    ids = [f"wf-{n}" for n in range(5)]
    for workflow_id in ids:
        ledger.start(workflow_id, "import")
        ledger.save_checkpoint(workflow_id, b"c")
    assert [r.workflow_id for r in client.list()] == ids
    assert [r.workflow_id for r in client.list(status="running")] == ids
    assert [r.workflow_id for r in client.list(status="running", limit=3)] == ids[:3]


def test_list_round_trips_ids_that_need_encoding(ledger: Workflows, client: Workflows) -> None:
    odd = "workflow:with:colons/and%percent"
    ledger.start(odd, "import")
    assert [r.workflow_id for r in client.list()] == [odd]
    assert [r.workflow_id for r in client.list(status="running")] == [odd]
    assert keys.workflow(odd) in dict(client.storage.scan("wf:"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"status": "done"}, "must be one of"), ({"limit": -1}, "limit"), ({"limit": True}, "limit")],
)
def test_list_rejects_bad_arguments(
    client: Workflows, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        client.list(**kwargs)  # type: ignore[arg-type]


def test_no_warning_is_emitted_by_a_plain_lifecycle(ledger: Workflows, sink: WarningSink) -> None:
    ledger.start("wf-1", "import")
    ledger.save_checkpoint("wf-1", b"1")
    ledger.complete("wf-1", {"ok": True})
    assert sink.received == []


def test_index_matches_records_after_every_operation(
    ledger: Workflows, ledger_b: Workflows, client: Workflows, gated: GatedStorage
) -> None:
    steps = [
        lambda: ledger.start("a", "import"),
        lambda: ledger.start("b", "import"),
        lambda: ledger_b.start("c", "report"),
        lambda: ledger.save_checkpoint("a", b"1"),
        lambda: client.send_signal("b", "go"),
        lambda: client.suspend("b"),
        lambda: ledger_b.resume("b"),
        lambda: ledger.complete("a", 1),
        lambda: ledger_b.fail("c", "no"),
        lambda: client.timeout("b"),
        lambda: client.purge("a"),
        lambda: ledger.start("a", "import"),
        lambda: client.cancel("a"),
    ]
    for step in steps:
        step()
        assert_index_matches_records(gated)
    assert {r.workflow_id: r.status for r in client.list()} == {
        "a": "cancelled",
        "b": "timed-out",
        "c": "failed",
    }
