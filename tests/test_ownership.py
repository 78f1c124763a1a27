"""The Ownership facade: open, background modes, close, and failed bootstraps (spec §5.10, §7.13
items 189, 195-197)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.claims.gated import WarningSink, Worker, watch_log
from tests.workflows.helpers import holder_engine
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.codec import (
    ModeMarker,
    WorkflowRecord,
    decode_holder,
    decode_mode_marker,
    encode_mode_marker,
    encode_workflow_record,
)
from weft_sync.errors import ClosedError, OwnershipModeMismatchError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Storage

TTL_MS = 3_000
RENEW_MS = 1_000
START_MS = 1_000_000
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
WAIT_S = 10.0

MakeOwnership = Callable[..., Ownership]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def make_ownership(storage_url: str, clock: ManualClock) -> Iterator[MakeOwnership]:
    """Open Ownerships on the test's store (manual maintenance by default); all closed after."""
    opened: list[Ownership] = []

    def make(target: str | Storage | None = None, **kwargs: Any) -> Ownership:
        kwargs.setdefault("options", OPTIONS)
        kwargs.setdefault("clock", clock)
        kwargs.setdefault("background", "manual")
        kwargs.setdefault("warn", WarningSink())
        ownership = Ownership.open(storage_url if target is None else target, **kwargs)
        opened.append(ownership)
        return ownership

    yield make
    for ownership in opened:
        ownership.close()


def _weft_threads() -> list[str]:
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.is_alive() and t.name.startswith(("weft-timer", "weft-maintenance"))
    )


def _write_running(storage: Storage, workflow_id: str) -> None:
    record = WorkflowRecord(workflow_id, "job", "running")
    storage.put(keys.workflow(workflow_id), encode_workflow_record(record))
    storage.put(keys.workflow_status_index("running", workflow_id), b"")


# -- open ----------------------------------------------------------------------------------------


def test_open_from_a_url_stamps_the_workflow_lease_marker(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    ownership = make_ownership()
    marker = decode_mode_marker(storage.get(keys.OWNERSHIP_MODE_MARKER))
    assert marker is not None and marker.mode == "workflow-lease"
    assert ownership.engine_id == ownership.registry.engine_id
    assert not ownership.closed


def test_open_uses_the_given_engine_id(make_ownership: MakeOwnership) -> None:
    assert make_ownership(engine_id="engine-a").engine_id == "engine-a"


def test_open_rejects_an_unknown_background_naming_the_valid_ones(storage_url: str) -> None:
    with pytest.raises(ValueError, match=r"'daemon'.*'thread', 'manual'"):
        Ownership.open(storage_url, background="daemon")  # type: ignore[arg-type]


def test_open_rejects_options_of_the_wrong_type(storage_url: str) -> None:
    with pytest.raises(TypeError, match="OwnershipOptions"):
        Ownership.open(storage_url, options={"claim_ttl": "30s"})  # type: ignore[arg-type]


def test_open_rejects_something_that_is_neither_a_url_nor_a_storage() -> None:
    with pytest.raises(TypeError, match="storage URL"):
        Ownership.open(42)  # type: ignore[arg-type]


def test_open_rejects_a_non_callable_on_reclaimed(storage_url: str) -> None:
    with pytest.raises(TypeError, match="on_reclaimed"):
        Ownership.open(storage_url, on_reclaimed="drive")  # type: ignore[arg-type]


def test_workflows_ledger_claims_through_the_engine_registry(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    ownership = make_ownership(engine_id="engine-a")
    assert ownership.workflows.registry is ownership.registry
    record = ownership.workflows.start("wf-1", "job")
    assert record.status == "running"
    assert ownership.registry.current_epoch("wf-1") == 1
    assert holder_engine(storage, "wf-1") == "engine-a"
    ownership.close()
    assert holder_engine(storage, "wf-1") is None


def test_run_maintenance_includes_the_ledger_polls(make_ownership: MakeOwnership) -> None:
    ownership = make_ownership()
    ledger = ownership.workflows
    ledger.start("wf-1", "job")
    received: list[tuple[str, object]] = []
    ledger.on_update("wf-1", lambda update: received.append((update.name, update.payload)))
    ledger.submit_update("wf-1", "bump", 3)

    result = ownership.run_maintenance()

    # The update poll ran in this pass and drained the queued update into the owner's handler.
    assert result.update_poll is not None and result.update_poll.status == "completed"
    updates = result.update_poll.result
    assert updates is not None
    assert updates.drained_count == 1
    assert [(o.workflow_id, o.status) for o in updates.outcomes] == [("wf-1", "drained")]
    assert received == [("bump", 3)]
    # The signal poll ran too; nothing was parked on a signal, so it woke nothing.
    assert result.signal_poll is not None and result.signal_poll.status == "completed"
    signals = result.signal_poll.result
    assert signals is not None
    assert signals.outcomes == ()
    assert signals.woken_count == 0


# -- background modes ----------------------------------------------------------------------------


def test_thread_background_starts_interval_maintenance_at_once(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership(background="thread")
    assert ownership.started
    assert any(name.startswith("weft-timer") for name in _weft_threads())
    ownership.close()
    assert _weft_threads() == []


def test_manual_background_creates_no_timer_and_renews_only_on_run_maintenance(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    ownership = make_ownership(background="manual")
    assert not ownership.started
    assert _weft_threads() == []
    assert ownership.registry.acquire("wf-1").status == "acquired"
    clock.advance(RENEW_MS)

    result = ownership.run_maintenance()

    assert (result.renewed_count, result.failed_count) == (1, 0)
    holder = decode_holder(storage.get(keys.workflow_owner_holder("wf-1")))
    assert holder is not None and holder.expires_at == START_MS + RENEW_MS + TTL_MS
    assert _weft_threads() == []


def test_start_switches_a_manual_ownership_to_interval_mode_idempotently(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership(background="manual")
    ownership.start()
    ownership.start()
    assert ownership.started
    assert sum(name.startswith("weft-timer") for name in _weft_threads()) == 1


# -- close ---------------------------------------------------------------------------------------


def test_close_is_idempotent_and_later_use_raises_closed_error(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership()
    ownership.close()
    ownership.close()
    assert ownership.closed
    for use in (
        lambda: ownership.claim("wf-1").__enter__(),
        ownership.start,
        ownership.run_maintenance,
        lambda: ownership.on_lost(print),
    ):
        with pytest.raises(ClosedError, match=r"after close\(\)"):
            use()


def test_context_manager_exit_closes_and_releases(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    with make_ownership() as ownership:
        assert ownership.registry.acquire("wf-1").status == "acquired"
    assert ownership.closed
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None


def test_close_releases_every_claim_so_another_engine_acquires_at_once(
    make_ownership: MakeOwnership,
) -> None:
    first = make_ownership(background="thread")
    for wid in ("wf-1", "wf-2"):
        assert first.registry.acquire(wid).status == "acquired"
    first.close()

    second = make_ownership()
    with second.claim("wf-1") as handle:
        assert handle.epoch == 2
    assert second.registry.acquire("wf-2").epoch == 2


def test_close_closes_a_store_it_opened(make_ownership: MakeOwnership) -> None:
    ownership = make_ownership()
    ownership.close()
    with pytest.raises(ClosedError):
        ownership.storage.get("anything")


def test_close_leaves_a_given_storage_open(make_ownership: MakeOwnership, storage: Storage) -> None:
    ownership = make_ownership(storage)
    assert ownership.registry.acquire("wf-1").status == "acquired"
    ownership.close()
    assert ownership.storage is storage
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert storage.get(keys.workflow_owner_epoch("wf-1")) is not None


def test_close_from_inside_a_maintenance_pass_is_refused_and_leaves_it_open(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    errors: list[BaseException] = []
    holder: list[Ownership] = []

    def on_reclaimed(workflow_id: str) -> None:
        try:
            holder[0].close()
        except BaseException as exc:
            errors.append(exc)

    ownership = make_ownership(on_reclaimed=on_reclaimed)
    holder.append(ownership)
    _write_running(storage, "wf-1")

    result = ownership.run_maintenance()

    assert result.reclaim is not None and result.reclaim.reclaimed_count == 1
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "another thread" in str(errors[0])
    assert not ownership.closed
    ownership.close()
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None


class BlockingDrive:
    """An ``on_reclaimed`` callback that blocks until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, workflow_id: str) -> None:
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the drive"


def test_close_waits_for_a_pass_in_flight_before_releasing(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    drive = BlockingDrive()
    ownership = make_ownership(on_reclaimed=drive, engine_id="engine-a")
    _write_running(storage, "wf-1")
    maintenance = Worker(ownership.run_maintenance, "maintenance")
    assert drive.entered.wait(WAIT_S)
    closed = threading.Event()

    def close() -> None:
        ownership.close()
        closed.set()

    closer = Worker(close, "closer")

    assert not closed.wait(0.2), "close() returned while a pass was still running"
    assert holder_engine(storage, "wf-1") == "engine-a"
    drive.release.set()

    closer.result()
    assert maintenance.result().reclaim is not None
    assert holder_engine(storage, "wf-1") is None


def test_close_abandons_a_stuck_on_reclaimed_callback_after_the_timeout(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    drive = BlockingDrive()
    ownership = make_ownership(on_reclaimed=drive)
    _write_running(storage, "wf-1")
    maintenance = Worker(ownership.run_maintenance, "maintenance")
    assert drive.entered.wait(WAIT_S)
    (handler_thread,) = [t for t in threading.enumerate() if t.name.startswith("weft-handler-")]

    with watch_log("weft_sync.ownership.handler_executor") as log:
        ownership.close(timeout=0.05)

    assert ownership.closed
    assert any("still running" in m for m in log.messages(logging.WARNING))
    assert holder_engine(storage, "wf-1") is None
    drive.release.set()
    maintenance.join()
    handler_thread.join(WAIT_S)
    assert not handler_thread.is_alive()


# -- failed bootstrap ----------------------------------------------------------------------------


def _stamp_lease_marker(storage: Storage) -> bytes:
    marker = encode_mode_marker(ModeMarker("lease", 5))
    storage.put(keys.OWNERSHIP_MODE_MARKER, marker)
    return marker


def test_failed_bootstrap_closes_the_store_it_opened_and_leaves_no_thread(
    storage_url: str, storage: Storage
) -> None:
    marker = _stamp_lease_marker(storage)
    before = set(threading.enumerate())

    with pytest.raises(OwnershipModeMismatchError):
        Ownership.open(storage_url, options=OPTIONS)

    started = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert started == []
    assert storage.get(keys.OWNERSHIP_MODE_MARKER) == marker


def test_failed_bootstrap_leaves_a_given_storage_open(storage: Storage) -> None:
    _stamp_lease_marker(storage)
    with pytest.raises(OwnershipModeMismatchError):
        Ownership.open(storage, options=OPTIONS, background="thread")
    assert storage.get(keys.workflow_owner_holder("wf-1")) is None
    assert _weft_threads() == []


def test_the_ledger_refuses_owner_operations_after_close_even_on_a_borrowed_store(
    storage: Storage,
) -> None:
    ownership = Ownership.open(storage, background="manual")
    ledger = ownership.workflows
    ledger.start("wf-before", "report")
    ownership.close()
    with pytest.raises(ClosedError, match="closed with its Ownership"):
        ledger.start("wf-after", "report")
    with pytest.raises(ClosedError):
        ledger.save_checkpoint("wf-before", b"late")
    # Nothing was claimed after close, and reads still work on the borrowed, open store.
    assert storage.get(keys.workflow_owner_holder("wf-after")) is None
    assert storage.get(keys.workflow_owner_holder("wf-before")) is None
    record = ledger.get("wf-before")
    assert record is not None and record.status == "running"
