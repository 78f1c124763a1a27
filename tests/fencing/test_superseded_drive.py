"""A drive whose claim its engine lost, and then took again for another driver, writes nothing.

The engine's renewals fail past the local renew deadline while a ``drive()`` block is under way
(the store was failing); the claim is dropped locally, and once the store answers again the
engine's own reclaim pass takes the workflow again, at the next epoch, for its handler. The old
block's thread is still alive: its checkpoint, fenced write, host transaction and ``complete()``
are refused (``EngineDeposedError``, cause ``"superseded"``), so it cannot overwrite what the new
driver wrote. Both backends, through the plain driver of each (sqlite3, psycopg).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from tests.claims.gated import GatedStorage
from tests.fencing.hosts import RENEW_MS, HostEnv
from weft_sync import Ownership, ReclaimedWorkflow
from weft_sync.codec import decode_epoch
from weft_sync.errors import EngineDeposedError, StorageError, WorkflowClaimLostWarning
from weft_sync.ledger.records import checkpoint_key
from weft_sync.storage import Put, open_storage

WAIT_S = 10.0


class _FencedGated(GatedStorage):
    """A :class:`GatedStorage` that host transactions can be fenced against (the real store's
    location is the gated one's)."""

    def fence_target(self) -> Any:
        return self.inner.fence_target()  # type: ignore[attr-defined]


@pytest.fixture
def gated(raw_env: HostEnv) -> Iterator[_FencedGated]:
    with closing(open_storage(raw_env.storage_url)) as storage:
        yield _FencedGated(storage)


def test_a_superseded_drive_writes_nothing_and_the_new_driver_finishes(
    raw_env: HostEnv, gated: _FencedGated
) -> None:
    clock = raw_env.clock
    handler_started, old_done = threading.Event(), threading.Event()
    handler_epochs: list[int] = []

    def handler(ctx: ReclaimedWorkflow) -> None:
        handler_epochs.append(ctx.epoch)
        handler_started.set()
        assert old_done.wait(WAIT_S), "the old drive did not finish its attempts"
        ctx.workflows.save_checkpoint(ctx.workflow_id, b"pages 1-2, by the new driver")
        ctx.workflows.complete(ctx.workflow_id, {"by": "new driver"})

    own = raw_env.ownership(storage=gated, engine_id="engine-a", handlers={"report": handler})
    own.workflows.start("job-1", "report")
    refusals: dict[str, BaseException | None] = {}
    entered = threading.Event()

    def attempt(name: str, write: Callable[[], object]) -> None:
        try:
            write()
            refusals[name] = None
        except BaseException as exc:
            refusals[name] = exc

    def old_drive() -> None:
        with own.workflows.drive("job-1") as ctx:
            ctx.checkpoint(b"page 1, by the old driver")
            entered.set()
            if not handler_started.wait(WAIT_S):
                return
            attempt("checkpoint", lambda: ctx.checkpoint(b"page 2, by the old driver"))
            attempt(
                "fenced_write",
                lambda: own.workflows.fenced_write("job-1", [Put(_host_key("job-1"), b"x")]),
            )
            attempt("host", lambda: _host_write(raw_env, own))
            attempt("complete", lambda: ctx.complete({"by": "old driver"}))
            attempt("fail", lambda: ctx.fail("the old driver gave up"))
            attempt("suspend", ctx.suspend)
            old_done.set()

    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: _capture(old_drive, errors), name="old-drive")
    worker.start()
    try:
        assert entered.wait(WAIT_S)
        for _ in range(3):  # renewals fail past the local deadline: the claim is dropped here
            gated.raise_on_next_cas(StorageError("the store is failing"))
            clock.advance(RENEW_MS)
            own.run_maintenance()
        assert own.registry.current_epoch("job-1") is None
        for _ in range(6):  # the store answers again; the holder expires; this engine retakes it
            clock.advance(RENEW_MS)
            own.run_maintenance()
            if handler_started.is_set():
                break
        assert handler_started.is_set(), "the engine did not take the workflow again"
    finally:
        old_done.set()
        handler_started.set()
        worker.join(WAIT_S)
    assert errors == [] and not worker.is_alive()

    assert handler_epochs == [2]
    assert set(refusals) == {
        "checkpoint",
        "fenced_write",
        "host",
        "complete",
        "fail",
        "suspend",
    }, refusals
    for name, exc in refusals.items():
        assert isinstance(exc, EngineDeposedError), (name, exc)
        assert exc.cause == "superseded", (name, exc)
        assert "later epoch" in str(exc), (name, exc)
    # What the new driver wrote stands; nothing of the old drive's after the loss does.
    own.run_maintenance()
    assert own.workflows.load_checkpoint("job-1") == b"pages 1-2, by the new driver"
    outcome = own.workflows.get_outcome("job-1")
    assert outcome is not None and outcome.result == {"by": "new driver"}
    assert gated.inner.get(_host_key("job-1")) is None
    assert raw_env.rows() == {}
    assert gated.inner.get(checkpoint_key("job-1")) == b"pages 1-2, by the new driver"


def _host_key(wid: str) -> str:
    return f"host/{wid}"


def _host_write(env: HostEnv, own: Ownership) -> None:
    conn = env.connect()
    with own.fenced("job-1", conn) as handle:
        env.write(handle, "report-1", "page 2, by the old driver")


def _capture(body: Callable[[], object], errors: list[BaseException]) -> None:
    try:
        body()
    except BaseException as exc:
        errors.append(exc)


def _put_back(snapshot: str, db_path: str) -> None:
    """Restore ``snapshot`` over the live database in place (SQLite's backup API)."""
    with closing(sqlite3.connect(snapshot)) as src, closing(sqlite3.connect(db_path)) as dst:
        src.backup(dst)


def test_a_drive_of_a_claim_a_rolled_back_store_forgot_writes_nothing_under_its_new_claim(
    sqlite3_env: HostEnv, tmp_path: Path
) -> None:
    """The store goes back to before the workflow was started while a drive of it is under
    way; the engine loses the claim (``store_rollback``) and starts the workflow again, at the
    same epoch number with a new token. The old drive is refused; the new claim stays held."""
    env = sqlite3_env
    own = env.ownership(engine_id="engine-a")
    snapshot = str(tmp_path / "before-start.db")
    with closing(sqlite3.connect(env.db_url)) as live, closing(sqlite3.connect(snapshot)) as s:
        live.backup(s)
    own.workflows.start("job-1", "report")
    first = own.registry.current_epoch_bytes("job-1")
    entered, go = threading.Event(), threading.Event()
    refusals: dict[str, BaseException | None] = {}

    def attempt(name: str, write: Callable[[], object]) -> None:
        try:
            write()
        except BaseException as exc:  # recorded for the assertions below
            refusals[name] = exc
        else:
            refusals[name] = None

    def old_drive() -> None:
        with closing(env.connect()) as conn, own.workflows.drive("job-1") as ctx:
            entered.set()
            assert go.wait(WAIT_S)

            def host_write() -> None:
                with own.fenced("job-1", conn) as fenced:
                    env.write(fenced, "row", "old drive")

            attempt("host", host_write)
            attempt("checkpoint", lambda: ctx.checkpoint(b"old drive"))
            attempt("complete", lambda: ctx.complete({"by": "old drive"}))

    thread = threading.Thread(target=old_drive)
    thread.start()
    try:
        assert entered.wait(WAIT_S)
        _put_back(snapshot, env.db_url)
        with pytest.warns(WorkflowClaimLostWarning):
            own.run_maintenance()
        assert own.registry.loss_cause("job-1") == "store_rollback"
        own.workflows.start("job-1", "report")
        second = own.registry.current_epoch_bytes("job-1")
        assert first is not None and second is not None
        assert decode_epoch(second) == decode_epoch(first) and second != first
        with closing(env.connect()) as conn, own.fenced("job-1", conn) as fenced:
            env.write(fenced, "row", "new claim")
    finally:
        go.set()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    assert set(refusals) == {"host", "checkpoint", "complete"}
    for name, error in refusals.items():
        assert isinstance(error, EngineDeposedError), (name, error)
        assert error.cause == "superseded", (name, error)
    assert env.rows()["row"] == "new claim"
    # The old drive's end leaves the new claim alone: held, and drivable here.
    assert own.registry.current_epoch_bytes("job-1") == second
    with own.workflows.drive("job-1") as ctx:
        ctx.complete({"by": "new driver"})
    record = own.workflows.get("job-1")
    assert record is not None and record.status == "completed"
