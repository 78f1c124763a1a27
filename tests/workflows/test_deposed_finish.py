"""A deposed owner's ``complete()``/``fail()`` is refused as deposed, whatever the status.

Once another engine took the workflow over, the old owner's finish is the write of an engine
that lost its claim: :class:`~weft_sync.errors.EngineDeposedError`, also when the new owner has
already finished the workflow (its status is no longer ``running``). A host tells "I lost it"
from "I called it twice" by that type. A store restored from a copy (every key back to the
copy's value, keys written since gone) makes a finish fail the same way, with cause
``store_rollback``, and each lost claim is reported once: the finish drops it, so its renewal
does not report it again.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.claims.gated import WarningSink
from tests.engines import MakeOwnership, opened_engines
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.errors import EngineDeposedError, WorkflowClaimLostWarning
from weft_sync.options import OwnershipOptions
from weft_sync.storage import Delete, Put, Storage

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


def test_a_deposed_owners_finish_is_refused_as_deposed_while_the_workflow_still_runs(
    make_ownership: MakeOwnership, clock: ManualClock
) -> None:
    old = make_ownership("engine-old")
    old.workflows.start("wf-1", "job")
    clock.advance(PAST_GRACE_MS)
    new = make_ownership("engine-new")
    assert new.registry.takeover("wf-1").status == "acquired"
    with pytest.raises(EngineDeposedError):
        old.workflows.complete("wf-1", result="late")
    with pytest.raises(EngineDeposedError):
        old.workflows.fail("wf-1", "late")
    assert new.workflows.get("wf-1").status == "running"  # type: ignore[union-attr]


@pytest.mark.parametrize("finish", ["complete", "fail"])
def test_a_deposed_owners_finish_is_refused_as_deposed_after_the_new_owner_finished(
    make_ownership: MakeOwnership, clock: ManualClock, finish: str
) -> None:
    old = make_ownership("engine-old")
    old.workflows.start("wf-1", "job")
    clock.advance(PAST_GRACE_MS)
    new = make_ownership("engine-new")
    assert new.registry.takeover("wf-1").status == "acquired"
    new.workflows.complete("wf-1", result="by the new owner")
    try:
        getattr(old.workflows, finish)("wf-1", "late")
    except EngineDeposedError:
        pass
    except Exception as exc:
        raise AssertionError(f"{finish}() by a deposed owner raised {exc!r}") from exc
    else:
        raise AssertionError(f"{finish}() by a deposed owner succeeded")
    outcome = new.workflows.get_outcome("wf-1")
    assert outcome is not None and (outcome.status, outcome.result) == (
        "completed",
        "by the new owner",
    )


def _copy(storage: Storage) -> dict[str, bytes]:
    return dict(storage.scan(""))


def _restore(storage: Storage, copy: dict[str, bytes]) -> None:
    """Put the store back to ``copy``, as an in-place restore of a backup does."""
    gone = [Delete(key) for key, _ in storage.scan("") if key not in copy]
    storage.batch([*gone, *(Put(key, value) for key, value in copy.items())])


def _losses(sink: WarningSink) -> list[tuple[str, str]]:
    return [
        (w.workflow_id, w.cause) for w in sink.received if isinstance(w, WorkflowClaimLostWarning)
    ]


def test_a_finish_after_a_restore_brought_back_an_older_holder_fails_as_a_rollback_once(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    sink = WarningSink()
    owner = make_ownership("engine-a", warn=sink)
    owner.workflows.start("wf-1", "job")
    copy = _copy(storage)  # the holder as first written
    clock.advance(RENEW_MS)
    owner.run_maintenance()  # renewed: a newer holder of the same token
    assert (
        storage.get(keys.workflow_owner_holder("wf-1")) != copy[keys.workflow_owner_holder("wf-1")]
    )
    _restore(storage, copy)
    with pytest.raises(EngineDeposedError) as raised:
        owner.workflows.complete("wf-1", result="late")
    assert raised.value.cause == "store_rollback"
    assert owner.registry.current_epoch("wf-1") is None
    owner.run_maintenance()  # the renewal has nothing left to report
    assert _losses(sink) == [("wf-1", "store_rollback")]
    assert owner.workflows.get("wf-1").status == "running"  # type: ignore[union-attr]


def test_a_finish_after_a_restore_from_before_the_start_fails_as_a_rollback_once_per_claim(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    sink = WarningSink()
    owner = make_ownership("engine-a", warn=sink)
    owner.workflows.start("wf-0", "job")
    copy = _copy(storage)
    owner.workflows.start("wf-1", "job")
    _restore(storage, copy)  # wf-1's record, epoch and holder are gone
    assert owner.workflows.get("wf-1") is None
    with pytest.raises(EngineDeposedError) as raised:  # not WorkflowNotFoundError
        owner.workflows.complete("wf-1", result="late")
    assert raised.value.cause == "store_rollback"
    # The store went back: every claim of the engine is lost, each reported once.
    assert owner.registry.list_held_workflow_ids() == []
    clock.advance(RENEW_MS)
    owner.run_maintenance()
    assert sorted(_losses(sink)) == [("wf-0", "store_rollback"), ("wf-1", "store_rollback")]
