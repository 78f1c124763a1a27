"""Fenced writes: deposed versus conflict, no round trip without a claim, library-owned keys."""

from __future__ import annotations

import pytest

from tests.claims.gated import PAST_GRACE_MS, GatedStorage, WarningSink
from tests.token_match import minted
from tests.workflows.helpers import ReadHooks, snapshot
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.errors import (
    EngineDeposedError,
    FencedWriteConflict,
    StorageError,
    WeftError,
)
from weft_sync.storage import Condition, Delete, Put, Storage
from weft_sync.workflows import Workflows

WF = "wf-1"


def test_fenced_write_commits_while_the_claim_holds(ledger: Workflows, gated: GatedStorage) -> None:
    ledger.start(WF, "import")
    ledger.fenced_write(WF, [Put("app:wf-1:step", b"1")], [Condition("app:wf-1:step", None)])
    assert gated.get("app:wf-1:step") == b"1"


def test_a_failed_base_condition_is_a_conflict_not_a_deposition(
    ledger: Workflows, gated: GatedStorage, sink: WarningSink, registry: ClaimRegistry
) -> None:
    ledger.start(WF, "import")
    before = snapshot(gated)
    with pytest.raises(FencedWriteConflict) as caught:
        ledger.fenced_write(WF, [Put("app:x", b"2")], [Condition("app:x", b"1")])
    assert caught.value.workflow_id == WF
    assert snapshot(gated) == before
    assert sink.received == []
    assert registry.current_epoch(WF) == 1


def test_without_a_local_epoch_the_write_is_refused_without_a_round_trip(
    ledger: Workflows, gated: GatedStorage, sink: WarningSink
) -> None:
    calls = gated.total_calls
    with pytest.raises(EngineDeposedError) as caught:
        ledger.fenced_write(WF, [Put("app:x", b"1")])
    assert (caught.value.workflow_id, caught.value.cause) == (WF, "not_held")
    assert gated.total_calls == calls
    # Nothing was lost here (nothing was held): no claim-lost warning.
    assert sink.received == []


def test_a_takeover_deposes_the_old_owner_for_writes_and_renewal(
    ledger: Workflows,
    registry: ClaimRegistry,
    registry_b: ClaimRegistry,
    gated: GatedStorage,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    ledger.start(WF, "import")
    clock.advance(PAST_GRACE_MS)
    assert registry_b.takeover(WF).status == "acquired"
    with pytest.raises(EngineDeposedError):
        ledger.save_checkpoint(WF, b"stale")
    assert gated.get(f"wf:{WF}:ckpt") is None
    assert sink.lost_ids() == [WF]
    # The fenced write dropped the claim: its renewal does not report the loss a second time.
    assert registry.renew(WF).status == "not-held"
    assert sink.lost_ids() == [WF]


def test_an_absent_epoch_key_after_a_failed_write_means_deposed(
    ledger: Workflows, gated: GatedStorage, sink: WarningSink
) -> None:
    ledger.start(WF, "import")
    gated.delete(keys.workflow_owner_epoch(WF))
    with pytest.raises(EngineDeposedError):
        ledger.fenced_write(WF, [Put("app:x", b"1")])
    assert sink.lost_ids() == [WF]


def test_a_corrupt_epoch_key_after_a_failed_write_means_deposed(
    ledger: Workflows, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    gated.put(keys.workflow_owner_epoch(WF), b"\x01\x02")
    with pytest.raises(EngineDeposedError):
        ledger.fenced_write(WF, [Put("app:x", b"1")])


def test_an_unreadable_epoch_after_a_failed_write_means_deposed(
    storage: Storage, clock: ManualClock
) -> None:
    store = ReadHooks(storage)
    sink = WarningSink()
    registry = ClaimRegistry(
        store,
        engine_id="engine-a",
        clock=clock,
        claim_ttl_ms=30_000,
        claim_renew_interval_ms=5_000,
        warn=sink,
    )
    ledger = Workflows(store, registry, clock=clock, warn=sink)
    ledger.start(WF, "import")
    store.force_next_cas(False)
    store.fail_reads_of(keys.workflow_owner_epoch(WF))
    with pytest.raises(EngineDeposedError) as caught:
        ledger.fenced_write(WF, [Put("app:x", b"1")])
    assert isinstance(caught.value.__cause__, StorageError)
    assert caught.value.cause == "storage"
    # The store failed: the claim may still be ours, so it is kept (its renewals decide) and
    # not reported lost.
    assert sink.lost_ids() == []
    assert registry.current_epoch(WF) == 1


def test_an_unchanged_epoch_after_a_failed_write_means_conflict(
    ledger: Workflows, gated: GatedStorage
) -> None:
    ledger.start(WF, "import")
    gated.force_next_cas(False)
    with pytest.raises(FencedWriteConflict):
        ledger.fenced_write(WF, [Put("app:x", b"1")])
    assert gated.get(keys.workflow_owner_epoch(WF)) == minted(1)


@pytest.mark.parametrize(
    "key",
    [
        keys.workflow_owner_epoch(WF),
        keys.workflow_owner_holder(WF),
        keys.workflow_owner_holder("another"),
        keys.OWNERSHIP_MODE_MARKER,
        keys.workflow(WF),
        keys.workflow_status_index("running", WF),
    ],
)
def test_fenced_writes_refuse_library_owned_keys(
    ledger: Workflows, gated: GatedStorage, key: str
) -> None:
    ledger.start(WF, "import")
    before = snapshot(gated)
    with pytest.raises(ValueError, match="may not touch"):
        ledger.fenced_write(WF, [Put("app:x", b"1"), Delete(key)])
    assert snapshot(gated) == before


def test_fenced_writes_reject_objects_that_are_not_operations(ledger: Workflows) -> None:
    ledger.start(WF, "import")
    with pytest.raises(TypeError, match="Put or Delete"):
        ledger.fenced_write(WF, [("put", "app:x", b"1")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="Condition"):
        ledger.fenced_write(WF, [], [("app:x", None)])  # type: ignore[list-item]


def test_checkpoints_are_saved_fenced_and_read_by_anyone(
    ledger: Workflows, client: Workflows
) -> None:
    ledger.start(WF, "import")
    assert client.load_checkpoint(WF) is None
    ledger.save_checkpoint(WF, b"step-1")
    ledger.save_checkpoint(WF, b"step-2")
    assert client.load_checkpoint(WF) == b"step-2"
    with pytest.raises(TypeError, match="bytes"):
        ledger.save_checkpoint(WF, "text")  # type: ignore[arg-type]


def test_a_client_cannot_write_fenced(client: Workflows) -> None:
    with pytest.raises(WeftError, match="no claim registry") as raised:
        client.save_checkpoint(WF, b"x")
    assert raised.type is WeftError  # misuse, not a storage failure or a lost fence
