"""A deposed owner's ``complete()``/``fail()`` is refused as deposed, whatever the status.

Once another engine took the workflow over, the old owner's finish is the write of an engine
that lost its claim: :class:`~weft_sync.errors.EngineDeposedError`, also when the new owner has
already finished the workflow (its status is no longer ``running``). A host tells "I lost it"
from "I called it twice" by that type.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engines import MakeOwnership, opened_engines
from weft_sync.clock import ManualClock
from weft_sync.errors import EngineDeposedError
from weft_sync.options import OwnershipOptions
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
