"""Drivers: a claim is held for a driver, and one whose driver failed or is gone is redriven.

Engines share a ``ManualClock`` and one real store (SQLite and PostgreSQL) and run maintenance
by hand; moving the clock past one renew interval is what "no driver for longer than the grace"
means. Handlers run on the engines' handler threads; ``run_maintenance()`` waits for them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence

import msgpack
import pytest

from tests.claims.gated import GatedStorage
from tests.engines import MakeOwnership, handler_running, opened_engines
from tests.workflows.helpers import holder_engine, stored_epoch
from weft_sync import keys
from weft_sync.clock import ManualClock
from weft_sync.errors import EngineDeposedError, WorkflowClaimUnavailableError
from weft_sync.metrics import serialize_prometheus
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.facade import ReclaimedWorkflow
from weft_sync.reclaim.engine_records import UndrivenClaims, decode_engine_record
from weft_sync.storage import Storage
from weft_sync.storage.base import Batch, Delete
from weft_sync.workflows import WorkflowNotFoundError

TTL_MS = 3_000
RENEW_MS = 1_000
PAST_GRACE_MS = TTL_MS + 2 * RENEW_MS + 1
OPTIONS = OwnershipOptions(
    claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS, handler_stuck_after="10s"
)
WAIT_S = 10.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000)


@pytest.fixture
def make_ownership(storage: Storage, clock: ManualClock) -> Iterator[MakeOwnership]:
    with opened_engines(storage, clock, OPTIONS) as make:
        yield make


def _completing(seen: list[str]) -> object:
    def handler(ctx: ReclaimedWorkflow) -> None:
        seen.append(threading.current_thread().name)
        ctx.workflows.complete(ctx.workflow_id, {"by": "handler"})

    return handler


# -- drive() -------------------------------------------------------------------------------------


def test_a_drive_block_that_raises_releases_the_claim_and_a_handler_completes_the_workflow(
    make_ownership: MakeOwnership, storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []
    engine = make_ownership("engine-a", handlers={"job": _completing(seen)})
    engine.workflows.start("job-1", "job")

    def job() -> None:
        with engine.workflows.drive("job-1") as ctx:
            ctx.checkpoint(b"step 1")
            raise OSError("the host's API timed out")

    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: _capture(job, errors), name="job-thread")
    with caplog.at_level(logging.WARNING):
        worker.start()
        worker.join(WAIT_S)
    assert [type(e) for e in errors] == [OSError]
    # Released at once for a redrive: running, nobody holds it, the epoch kept.
    assert (holder_engine(storage, "job-1"), stored_epoch(storage, "job-1")) == (None, 1)
    assert engine.drivers.attempts("job-1") == 1
    assert any("raised OSError" in r.getMessage() for r in caplog.records)

    engine.run_maintenance()
    record = engine.workflows.get("job-1")
    assert record is not None and record.status == "completed"
    assert len(seen) == 1 and seen[0].startswith("weft-handler-")
    assert engine.workflows.load_checkpoint("job-1") == b"step 1"
    assert engine.metrics.snapshot().redrives == 1


def test_a_drive_block_left_without_finishing_releases_the_claim(
    make_ownership: MakeOwnership, storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_ownership("engine-a")
    engine.workflows.start("job-1", "job")
    with caplog.at_level(logging.WARNING), engine.workflows.drive("job-1") as ctx:
        assert (ctx.workflow_id, ctx.epoch) == ("job-1", 1)
    assert holder_engine(storage, "job-1") is None
    assert engine.workflows.get("job-1").status == "running"  # type: ignore[union-attr]
    assert any("returned without finishing" in r.getMessage() for r in caplog.records)


def test_a_drive_block_that_completes_keeps_no_state_and_counts_no_attempt(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    engine = make_ownership("engine-a")
    engine.workflows.start("job-1", "job")
    with engine.workflows.drive("job-1") as ctx:
        ctx.complete({"rows": 3})
    assert engine.workflows.get("job-1").status == "completed"  # type: ignore[union-attr]
    assert engine.drivers.attempts("job-1") == 0
    assert engine.metrics.snapshot().redrives == 0
    assert holder_engine(storage, "job-1") is None


def test_drive_claims_a_running_workflow_nobody_holds_and_refuses_one_held_elsewhere(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    a = make_ownership("engine-a")
    b = make_ownership("engine-b")
    a.workflows.start("job-1", "job")
    with pytest.raises(WorkflowClaimUnavailableError), b.workflows.drive("job-1"):
        pytest.fail("entered a drive of a workflow another engine holds")
    a.registry.release("job-1")
    with b.workflows.drive("job-1") as ctx:
        assert ctx.epoch == 2 and holder_engine(storage, "job-1") == "engine-b"
        ctx.complete()


def test_a_second_thread_cannot_drive_a_workflow_already_driven(
    make_ownership: MakeOwnership,
) -> None:
    engine = make_ownership("engine-a")
    engine.workflows.start("job-1", "job")
    errors: list[BaseException] = []
    with engine.workflows.drive("job-1") as ctx:

        def second() -> None:
            with engine.workflows.drive("job-1"):
                pass

        worker = threading.Thread(target=lambda: _capture(second, errors))
        worker.start()
        worker.join(WAIT_S)
        ctx.complete()
    assert [type(e) for e in errors] == [WorkflowClaimUnavailableError]
    assert getattr(errors[0], "held_by", None) == engine.engine_id
    assert "already held by this engine" in str(errors[0])
    assert "retry later" not in str(errors[0])


# -- claims with no live driver ------------------------------------------------------------------


def test_a_started_workflow_nobody_drives_goes_to_its_handler_after_one_renew_interval(
    make_ownership: MakeOwnership,
    storage: Storage,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []
    engine = make_ownership("engine-a", handlers={"job": _completing(seen)})
    engine.workflows.start("job-1", "job")
    engine.run_maintenance()
    assert holder_engine(storage, "job-1") == "engine-a", "released within its grace"
    assert seen == []

    clock.advance(RENEW_MS + 1)
    with caplog.at_level(logging.WARNING):
        engine.run_maintenance()
    # Handed to this engine's handler at its epoch: no release, no attempt, no warning.
    assert len(seen) == 1
    assert engine.workflows.get("job-1").status == "completed"  # type: ignore[union-attr]
    assert stored_epoch(storage, "job-1") == 1
    assert engine.drivers.attempts("job-1") == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert engine.metrics.snapshot().claims_without_driver == 0


def test_the_handler_gets_a_started_workflow_even_when_one_attempt_is_allowed(
    storage: Storage, clock: ManualClock
) -> None:
    seen: list[str] = []
    options = OwnershipOptions(
        claim_ttl=OPTIONS.claim_ttl_ms,
        claim_renew_interval=OPTIONS.claim_renew_interval_ms,
        handler_max_attempts=1,
    )
    with opened_engines(storage, clock, options) as make:
        engine = make("engine-a", handlers={"job": _completing(seen)})
        engine.workflows.start("job-1", "job")
        clock.advance(RENEW_MS + 1)
        engine.run_maintenance()
        assert len(seen) == 1
        assert engine.workflows.get("job-1").status == "completed"  # type: ignore[union-attr]


def test_a_started_workflow_with_no_handler_here_is_released_after_one_renew_interval(
    make_ownership: MakeOwnership,
    storage: Storage,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_ownership("engine-a", handlers={"other": _completing([])})
    engine.workflows.start("job-1", "job")
    clock.advance(RENEW_MS + 1)
    with caplog.at_level(logging.WARNING):
        engine.run_maintenance()
    assert engine.metrics.snapshot().claims_without_driver == 1
    released = [r for r in caplog.records if "no live driver" in r.getMessage()]
    assert [r.levelno for r in released] == [logging.WARNING]
    assert "'job-1'" in released[0].getMessage()
    assert "(nothing drove it)" in released[0].getMessage()
    text = serialize_prometheus(engine.metrics.snapshot())
    assert "weft_workflow_claims_without_driver 1" in text.splitlines()
    assert holder_engine(storage, "job-1") is None
    assert engine.drivers.attempts("job-1") == 1


def test_a_handler_that_returns_without_finishing_is_not_given_the_claim_again_by_the_check(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    calls: list[int] = []
    engine = make_ownership("engine-a", handlers={"job": lambda ctx: calls.append(ctx.epoch)})
    engine.workflows.start("job-1", "job")
    clock.advance(RENEW_MS + 1)
    engine.run_maintenance()  # handed to the handler, which hands the claim on
    assert calls == [1]
    clock.advance(RENEW_MS + 1)
    engine.run_maintenance()  # nobody drove it after the handler: released, one attempt
    assert calls == [1]
    assert holder_engine(storage, "job-1") is None
    assert engine.drivers.attempts("job-1") == 1


def test_drive_refuses_an_id_held_only_by_a_bare_claim_and_keeps_that_claim(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    engine = make_ownership("engine-a")
    with engine.claim("job") as handle:
        with pytest.raises(WorkflowNotFoundError), engine.workflows.drive("job"):
            pass
        assert not handle.lost.is_set()
        assert holder_engine(storage, "job") == "engine-a"
        handle.assert_held()


def test_a_driver_thread_that_is_gone_leaves_its_claim_to_a_redrive(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    engine = make_ownership("engine-a")
    engine.workflows.start("job-1", "job")
    # A thread that registered as driver and ended without leaving (as a forked child's or an
    # interpreter-shutdown thread does).
    worker = threading.Thread(target=lambda: engine.drivers.enter("job-1", 1, "drive() block"))
    worker.start()
    worker.join(WAIT_S)
    engine.run_maintenance()
    assert holder_engine(storage, "job-1") is None
    assert engine.drivers.attempts("job-1") == 1


def test_a_workflow_no_driver_can_finish_is_failed_after_the_bounded_attempts(
    storage: Storage, clock: ManualClock
) -> None:
    options = OwnershipOptions(
        claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS, handler_max_attempts=3
    )
    epochs: list[int] = []

    def broken(ctx: ReclaimedWorkflow) -> None:
        epochs.append(ctx.epoch)
        raise RuntimeError("always broken")

    with opened_engines(storage, clock, options) as make:
        engine = make("engine-a", handlers={"job": broken})
        engine.workflows.start("job-1", "job")
        with pytest.raises(RuntimeError), engine.workflows.drive("job-1"):
            raise RuntimeError("the host's own drive failed")
        for _ in range(4):
            clock.advance(RENEW_MS * 3)
            engine.run_maintenance()
        record = engine.workflows.get("job-1")
        assert record is not None and record.status == "failed"
        outcome = engine.workflows.get_outcome("job-1")
        assert outcome is not None
        assert len(epochs) == 2  # attempt 1 was the host's drive, 2 and 3 the handler's


# -- handlers on their own threads ---------------------------------------------------------------


def test_a_hanging_handler_does_not_stop_other_reclaimed_workflows_from_being_driven(
    make_ownership: MakeOwnership,
    storage: Storage,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = make_ownership("engine-dead")
    for i in range(6):
        dead.workflows.start(f"job-{i}", "hang" if i == 0 else "job")
    clock.advance(PAST_GRACE_MS)
    hanging = threading.Event()
    release = threading.Event()

    def hang(ctx: ReclaimedWorkflow) -> None:
        hanging.set()
        release.wait(WAIT_S)

    seen: list[str] = []
    survivor = make_ownership("engine-b", handlers={"hang": hang, "job": _completing(seen)})
    try:
        survivor.run_maintenance(wait_handlers=0)
        assert hanging.wait(WAIT_S)
        # One pass drove every other workflow although a handler hangs.
        survivor.run_maintenance(wait_handlers=WAIT_S / 2)
        assert len(seen) == 5
        for i in range(1, 6):
            assert survivor.workflows.get(f"job-{i}").status == "completed"  # type: ignore[union-attr]
        # Renewal goes on meanwhile; past handler_stuck_after the hang is reported, once.
        clock.advance(11_000)
        with caplog.at_level(logging.WARNING):
            survivor.run_maintenance(wait_handlers=0)
            survivor.run_maintenance(wait_handlers=0)
        stuck = [r for r in caplog.records if "has been running for more than" in r.getMessage()]
        assert len(stuck) == 1 and "'job-0'" in stuck[0].getMessage()
        assert survivor.metrics.snapshot().handler_stuck == {"hang": 1}
        assert holder_engine(storage, "job-0") == "engine-b"
    finally:
        release.set()


def test_close_stays_within_its_timeout_whatever_a_handler_does(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    import time

    dead = make_ownership("engine-dead")
    dead.workflows.start("job-0", "hang")
    clock.advance(PAST_GRACE_MS)
    hanging = threading.Event()
    release = threading.Event()

    def hang(ctx: ReclaimedWorkflow) -> None:
        hanging.set()
        release.wait(WAIT_S)

    survivor = make_ownership("engine-b", handlers={"hang": hang})
    survivor.run_maintenance(wait_handlers=0)
    assert hanging.wait(WAIT_S)
    (thread,) = [t for t in threading.enumerate() if t.name.startswith("weft-handler-")]
    assert thread.daemon
    started = time.monotonic()
    survivor.close(timeout=0.5)
    assert time.monotonic() - started < 1.0
    assert holder_engine(storage, "job-0") is None  # its claim was released
    release.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_handler_that_forks_cannot_run_weft_code_in_the_child(
    make_ownership: MakeOwnership, clock: ManualClock
) -> None:
    dead = make_ownership("engine-dead")
    dead.workflows.start("job-1", "job")
    clock.advance(PAST_GRACE_MS)
    codes: list[int] = []

    def forking(ctx: ReclaimedWorkflow) -> None:
        pid = os.fork()
        if pid == 0:  # the child: every inherited weft object refuses
            code = 0
            for attempt in (
                lambda: ctx.workflows.save_checkpoint(ctx.workflow_id, b"child"),
                lambda: ctx.ownership.run_maintenance(),
                lambda: ctx.workflows.complete(ctx.workflow_id),
            ):
                try:
                    attempt()
                except Exception as exc:
                    if type(exc).__name__ != "ClosedError":
                        code = 2
                else:
                    code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
        ctx.workflows.complete(ctx.workflow_id)

    survivor = make_ownership("engine-b", handlers={"job": forking})
    survivor.run_maintenance()
    assert codes == [0]
    assert survivor.workflows.get("job-1").status == "completed"  # type: ignore[union-attr]


# -- deposed before state ------------------------------------------------------------------------


@pytest.mark.parametrize("operation", ["complete", "fail"])
def test_a_deposed_owner_finishing_a_cancelled_workflow_gets_engine_deposed(
    make_ownership: MakeOwnership, operation: str
) -> None:
    owner = make_ownership("engine-a")
    other = make_ownership("engine-b")
    owner.workflows.start("job-1", "job")
    other.workflows.cancel("job-1")  # rotates the epoch; the status is no longer running
    finish = getattr(owner.workflows, operation)
    with pytest.raises(EngineDeposedError):
        finish("job-1", "x")


def _capture(body: object, errors: list[BaseException]) -> None:
    try:
        body()  # type: ignore[operator]
    except BaseException as exc:
        errors.append(exc)


def test_handler_runs_queued_behind_a_busy_executor_are_not_taken_for_undriven_claims(
    storage: Storage, clock: ManualClock
) -> None:
    options = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS, handler_workers=1)
    release = threading.Event()
    started: list[str] = []

    def slow(ctx: ReclaimedWorkflow) -> None:
        started.append(ctx.workflow_id)
        release.wait(WAIT_S)
        ctx.workflows.complete(ctx.workflow_id)

    with opened_engines(storage, clock, options) as make:
        dead = make("engine-dead")
        for i in range(3):
            dead.workflows.start(f"job-{i}", "job")
        clock.advance(PAST_GRACE_MS)
        survivor = make("engine-b", handlers={"job": slow})
        try:
            survivor.run_maintenance(wait_handlers=0)
            clock.advance(RENEW_MS * 3)  # far past the grace, two runs still queued
            survivor.run_maintenance(wait_handlers=0)
            assert survivor.metrics.snapshot().claims_without_driver == 0
            assert sorted(survivor.registry.list_held_workflow_ids()) == [
                "job-0",
                "job-1",
                "job-2",
            ]
        finally:
            release.set()
        survivor.run_maintenance(wait_handlers=WAIT_S)
        assert sorted(started) == ["job-0", "job-1", "job-2"]
        for i in range(3):
            assert survivor.workflows.get(f"job-{i}").status == "completed"  # type: ignore[union-attr]


def test_a_handler_can_hand_its_claim_to_host_code_that_drives_it_after_it_returned(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    dead = make_ownership("engine-dead")
    dead.workflows.start("job-1", "job")
    clock.advance(PAST_GRACE_MS)
    handed: list[str] = []

    survivor = make_ownership(
        "engine-b", handlers={"job": lambda ctx: handed.append(ctx.workflow_id)}
    )
    survivor.run_maintenance()  # returns once the handler returned
    assert handed == ["job-1"]
    assert holder_engine(storage, "job-1") == "engine-b"  # handed on, not released

    # The host's own thread enters drive() within the grace and finishes it.
    with survivor.workflows.drive("job-1") as ctx:
        ctx.complete({"by": "host thread"})
    assert survivor.workflows.get("job-1").status == "completed"  # type: ignore[union-attr]
    assert survivor.drivers.attempts("job-1") == 0


def test_host_code_cannot_drive_a_workflow_while_its_handler_runs(
    make_ownership: MakeOwnership, clock: ManualClock
) -> None:
    with (
        handler_running(
            make_ownership, clock, past_grace_ms=PAST_GRACE_MS, wait_s=WAIT_S
        ) as survivor,
        pytest.raises(WorkflowClaimUnavailableError),
        survivor.workflows.drive("job-1"),
    ):
        pytest.fail("two drivers of one claim")
    assert survivor.workflows.get("job-1").status == "completed"  # type: ignore[union-attr]


# -- the driver state the heartbeat publishes ----------------------------------------------------


def test_a_driver_thread_that_is_gone_is_published_as_no_driver_until_its_claim_is_released(
    make_ownership: MakeOwnership,
) -> None:
    engine = make_ownership("engine-a")
    engine.workflows.start("job-1", "job")
    assert engine.drivers.undriven_claims() == UndrivenClaims(("job-1",), (), 1)
    worker = threading.Thread(target=lambda: engine.drivers.enter("job-1", 1, "drive() block"))
    worker.start()
    worker.join(WAIT_S)
    assert engine.drivers.undriven_claims() == UndrivenClaims((), ("job-1",), 1)
    engine.run_maintenance()
    assert engine.drivers.undriven_claims() is None


def test_a_claim_its_handler_handed_on_is_published_as_awaiting_until_host_code_drives_it(
    make_ownership: MakeOwnership, storage: Storage, clock: ManualClock
) -> None:
    dead = make_ownership("engine-dead")
    dead.workflows.start("job-1", "job")
    clock.advance(PAST_GRACE_MS)
    survivor = make_ownership("engine-b", handlers={"job": lambda ctx: None})
    survivor.run_maintenance()  # the handler returned without finishing: handed on
    survivor.run_maintenance()
    assert _published(storage, "engine-b") == UndrivenClaims(("job-1",), (), 1)
    with survivor.workflows.drive("job-1") as ctx:
        assert survivor.drivers.undriven_claims() is None
        survivor.run_maintenance()
        assert _published(storage, "engine-b") is None
        ctx.complete()


def test_an_engine_whose_claims_are_all_driven_writes_its_record_no_more_often(
    storage: Storage, clock: ManualClock
) -> None:
    gated = GatedStorage(storage)
    with opened_engines(gated, clock, OPTIONS) as make:
        engine = make("engine-a")
        engine.workflows.start("job-1", "job")
        with engine.workflows.drive("job-1") as ctx:
            engine.run_maintenance()  # the new claim count is written
            puts = gated.calls["put"]
            raw = storage.get(keys.engine_liveness("engine-a"))
            for _ in range(3):
                clock.advance(RENEW_MS // 4)
                engine.run_maintenance()
            # No put within the refresh age, and the record is the one an engine without
            # driver state writes: no undriven key.
            assert gated.calls["put"] == puts
            assert storage.get(keys.engine_liveness("engine-a")) == raw
            assert "undriven" not in msgpack.unpackb(raw or b"\xc0")
            ctx.complete()


def _published(storage: Storage, engine_id: str) -> UndrivenClaims | None:
    record = decode_engine_record(storage.get(keys.engine_liveness(engine_id)))
    assert record is not None
    return record.undriven


def _releases(workflow_id: str) -> Callable[[Sequence[Batch]], bool]:
    """Match a CAS that deletes ``workflow_id``'s holder: its release."""
    holder = keys.workflow_owner_holder(workflow_id)
    return lambda batches: any(
        isinstance(op, Delete) and op.key == holder
        for _, operations in batches
        for op in operations
    )


def test_a_drive_entered_while_its_undriven_claim_is_being_released_is_refused(
    storage: Storage, clock: ManualClock
) -> None:
    gated = GatedStorage(storage)
    with opened_engines(gated, clock, OPTIONS) as make:
        engine = make("engine-a")
        engine.workflows.start("job-1", "job")
        clock.advance(RENEW_MS + 1)
        gate = gated.pause_next_cas(match=_releases("job-1"))
        errors: list[BaseException] = []
        maintenance = threading.Thread(
            target=lambda: _capture(engine.run_maintenance, errors), name="maintenance"
        )
        maintenance.start()
        try:
            # The check judged the claim undriven and is releasing it (its CAS is paused): a
            # drive entered now would drive a claim about to go.
            gate.wait_reached()
            with (
                pytest.raises(WorkflowClaimUnavailableError),
                engine.workflows.drive("job-1"),
            ):
                pytest.fail("a drive entered a claim being released as undriven")
        finally:
            gate.open()
            maintenance.join(WAIT_S)
        assert errors == [] and not maintenance.is_alive()
        assert holder_engine(storage, "job-1") is None
        assert stored_epoch(storage, "job-1") == 1
        assert engine.drivers.attempts("job-1") == 1
        # Once released, drive() claims it afresh, at the next epoch.
        with engine.workflows.drive("job-1") as ctx:
            assert ctx.epoch == 2
            ctx.complete()
