"""The renewal target adapter over a real registry (spec §5.2, §7.11)."""

from __future__ import annotations

import warnings

import pytest

from tests.claims.gated import START_MS, GatedStorage, WarningSink, new_registry, touches
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.claims.renewal_target import ClaimRenewalLostError, create_renewal_target
from weft_sync.clock import ManualClock
from weft_sync.errors import StorageError, WorkflowClaimLostError, WorkflowClaimLostWarning
from weft_sync.metrics import ClaimMetrics
from weft_sync.storage import Storage


@pytest.fixture
def metrics() -> ClaimMetrics:
    return ClaimMetrics()


def _lose(storage: Storage, wid: str) -> None:
    storage.delete(keys.workflow_owner_holder(wid))


def test_renewed_claim_is_a_success(reg: ClaimRegistry, metrics: ClaimMetrics) -> None:
    reg.acquire("wf-1")
    create_renewal_target(reg, metrics).renew_workflow_claim("wf-1")
    assert metrics.snapshot() == ClaimMetrics().snapshot()


def test_not_held_is_a_success_not_a_failure(reg: ClaimRegistry, metrics: ClaimMetrics) -> None:
    create_renewal_target(reg, metrics).renew_workflow_claim("released-meanwhile")
    assert metrics.snapshot().attempts["deposed"] == 0


def test_lost_claim_raises_counts_deposed_and_does_not_warn_again(
    reg: ClaimRegistry, storage: Storage, metrics: ClaimMetrics, sink: WarningSink
) -> None:
    reg.acquire("wf-1")
    _lose(storage, "wf-1")
    target = create_renewal_target(reg, metrics)
    with pytest.raises(ClaimRenewalLostError, match='workflow "wf-1" lost its ownership claim'):
        target.renew_workflow_claim("wf-1")
    assert metrics.snapshot().attempts["deposed"] == 1
    assert sink.lost_ids() == ["wf-1"]


def test_lost_claim_error_is_a_workflow_claim_lost_error(
    reg: ClaimRegistry, storage: Storage
) -> None:
    reg.acquire("wf-1")
    _lose(storage, "wf-1")
    with pytest.raises(WorkflowClaimLostError) as caught:
        create_renewal_target(reg).renew_workflow_claim("wf-1")
    assert caught.value.workflow_id == "wf-1"


def test_storage_errors_propagate(
    reg: ClaimRegistry, gated: GatedStorage, metrics: ClaimMetrics
) -> None:
    reg.acquire("wf-1")
    gated.raise_on_next_cas(StorageError("down"))
    with pytest.raises(StorageError, match="down"):
        create_renewal_target(reg, metrics).renew_workflow_claim("wf-1")
    assert metrics.snapshot().attempts["deposed"] == 0


def test_listing_delegates_to_the_registry(reg: ClaimRegistry) -> None:
    target = create_renewal_target(reg)
    assert target.list_held_workflow_ids() == []
    reg.acquire("b")
    reg.acquire("a")
    assert sorted(target.list_held_workflow_ids()) == ["a", "b"]


def test_batched_renewal_reports_each_ids_error_in_place(
    reg: ClaimRegistry, gated: GatedStorage, storage: Storage, metrics: ClaimMetrics
) -> None:
    for wid in ("ok", "lost", "broken", "also-ok"):
        reg.acquire(wid)
    _lose(storage, "lost")
    failure = StorageError("chunk failed")
    gated.raise_on_next_cas(failure, match=touches("broken"))
    errors = create_renewal_target(reg, metrics).renew_workflow_claims(
        ["ok", "lost", "broken", "also-ok", "never", "lost"], chunk_size=2
    )
    assert errors[0] is None
    assert isinstance(errors[1], ClaimRenewalLostError)
    assert errors[5] is errors[1]
    assert errors[2] is failure
    assert errors[3] is failure  # same chunk as "broken"
    assert errors[4] is None
    assert metrics.snapshot().attempts["deposed"] == 1


def test_lost_claim_is_still_reported_when_warnings_are_errors(
    storage: Storage, metrics: ClaimMetrics
) -> None:
    reg = new_registry(storage, ManualClock(START_MS))
    for wid in ("wf-1", "wf-2", "wf-3"):
        reg.acquire(wid)
    _lose(storage, "wf-1")
    _lose(storage, "wf-2")
    target = create_renewal_target(reg, metrics)
    with warnings.catch_warnings():
        warnings.simplefilter("error", WorkflowClaimLostWarning)
        with pytest.raises(ClaimRenewalLostError) as caught:
            target.renew_workflow_claim("wf-1")
        assert isinstance(caught.value.__cause__, WorkflowClaimLostWarning)
        errors = target.renew_workflow_claims(["wf-2", "wf-3"])
    assert isinstance(errors[0], ClaimRenewalLostError)
    assert isinstance(errors[0].__cause__, WorkflowClaimLostWarning)
    assert errors[1] is None
    assert metrics.snapshot().attempts["deposed"] == 2
    assert reg.list_held_workflow_ids() == ["wf-3"]
