"""Every claim that leaves the registry as lost is reported, even when host code behind one
report raises a ``BaseException`` (``SystemExit`` from an ``on_lost`` callback, a framework's
cancellation): the loss reports of the other claims of the same renewal run first, then the
exception goes on to the caller.

Real SQLite, real ``Ownership`` objects, a real takeover by another engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.errors import WorkflowClaimLostWarning
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import SqliteStorage

TTL_MS = 3_000
RENEW_MS = 1_000
PAST_GRACE_MS = TTL_MS + 2 * RENEW_MS + 1
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)


class HostAbort(BaseException):
    """What host code may raise from a callback (like SystemExit)."""


class Sink:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lost: list[str] = []

    def __call__(self, warning: Warning) -> None:
        if isinstance(warning, WorkflowClaimLostWarning):
            with self._lock:
                self.lost.append(warning.workflow_id)


def _abort_at_the_first_loss(owner: Ownership) -> list[str]:
    """Give ``owner`` an ``on_lost`` callback that raises :class:`HostAbort` the first time;
    return the ids it is called with, as they come."""
    called: list[str] = []

    @owner.on_lost
    def on_lost(workflow_id: str) -> None:
        called.append(workflow_id)
        if len(called) == 1:
            raise HostAbort(f"host aborts while handling the loss of {workflow_id}")

    return called


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStorage]:
    s = SqliteStorage(tmp_path / "s.db", table="kv")
    yield s
    s.close()


def test_a_baseexception_from_on_lost_still_lets_the_other_lost_claims_be_reported(
    store: SqliteStorage,
) -> None:
    clock = ManualClock(1_000_000)
    sink = Sink()
    owner = Ownership.open(
        store, engine_id="engine-a", options=OPTIONS, clock=clock, background="manual", warn=sink
    )
    thief = Ownership.open(
        store, engine_id="engine-b", options=OPTIONS, clock=clock, background="manual"
    )
    try:
        called = _abort_at_the_first_loss(owner)

        for wid in ("wf-1", "wf-2"):
            assert owner.registry.acquire(wid).status == "acquired"
        clock.advance(PAST_GRACE_MS)
        for wid in ("wf-1", "wf-2"):
            assert thief.registry.takeover(wid).status == "acquired"

        with pytest.raises(HostAbort):
            owner.run_maintenance(wait_handlers=0)
        # Whatever happened to the pass, every claim the registry dropped must be reported.
        owner.run_maintenance(wait_handlers=0)

        assert owner.registry.list_held_workflow_ids() == []  # both dropped locally
        for wid in ("wf-1", "wf-2"):
            assert store.get(keys.workflow_owner_holder(wid)) is not None  # held by engine-b
        assert sorted(called) == ["wf-1", "wf-2"], (
            f"on_lost was called for {called}; the other lost claim was dropped from the "
            f"registry without any report"
        )
        assert "wf-2" in sink.lost or "wf-1" in sink.lost
        assert sorted(set(sink.lost) | {called[0]}) == ["wf-1", "wf-2"], (
            f"warnings forwarded: {sink.lost}"
        )
    finally:
        thief.close()
        owner.close()


def test_a_baseexception_from_on_lost_at_the_deadline_lets_the_others_be_reported(
    store: SqliteStorage,
) -> None:
    """The same for claims given up at the local renew deadline, which all leave the table
    before they are reported one by one."""
    from tests.claims.gated import GatedStorage
    from weft_sync.errors import StorageError

    clock = ManualClock(1_000_000)
    sink = Sink()
    gated = GatedStorage(store)
    owner = Ownership.open(
        gated, engine_id="engine-a", options=OPTIONS, clock=clock, background="manual", warn=sink
    )
    try:
        called = _abort_at_the_first_loss(owner)

        for wid in ("wf-1", "wf-2"):
            assert owner.registry.acquire(wid).status == "acquired"
        clock.advance(TTL_MS - RENEW_MS)  # at the local renew deadline
        gated.raise_on_next_cas(StorageError("the store is unreachable"))  # the renewal fails
        with pytest.raises(HostAbort):
            owner.run_maintenance(wait_handlers=0)
        owner.run_maintenance(wait_handlers=0)

        assert owner.registry.list_held_workflow_ids() == []
        assert sorted(called) == ["wf-1", "wf-2"], (
            f"on_lost was called for {called}; the other claim given up at its deadline was "
            f"dropped without any report"
        )
    finally:
        owner.close()
