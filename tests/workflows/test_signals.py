"""Durable signals: buffered by anyone, consumed exactly once by the owner, woken by the poll."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Sequence

import pytest

from tests.claims.gated import PAST_GRACE_MS, WarningSink, Worker
from tests.support.waiting import wait_set
from tests.workflows.helpers import WAIT_S, ReadHooks, snapshot
from tests.workflows.workers import send_signals
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.errors import (
    EngineDeposedError,
    WorkflowWakeDiscardedWarning,
)
from weft_sync.ledger.records import signal_prefix
from weft_sync.maintenance.polls import run_owner_side_signal_poll
from weft_sync.maintenance.targets import ParkedSignalWait, SignalPollStatus
from weft_sync.storage import Batch, Delete
from weft_sync.workflows import WorkflowNotFoundError, Workflows, WorkflowStateError

WF = "wf-1"
GO = signal_prefix(WF, "go")


def _buffered(store: ReadHooks, name: str = "go") -> list[str]:
    return [key for key, _ in store.scan(signal_prefix(WF, name))]


def _park(store: ReadHooks, ledger: Workflows, timeout: float = WAIT_S) -> Worker[object]:
    """Start a waiter for ``go`` and return once it looked for a signal and is about to park."""
    scanned = threading.Event()
    store.after_next_scan_of(GO, scanned.set)
    waiter: Worker[object] = Worker(lambda: ledger.wait_for_signal(WF, "go", timeout), "waiter")
    wait_set(scanned, "the waiter's first look at its signals")
    return waiter


def _consumes_a_signal(batches: Sequence[Batch]) -> bool:
    return any(isinstance(op, Delete) and ":signal:" in op.key for _, ops in batches for op in ops)


def test_a_buffered_signal_is_returned_at_once_and_consumed(
    ledger: Workflows, client: Workflows, gated: ReadHooks
) -> None:
    ledger.start(WF, "import")
    client.send_signal(WF, "go", {"by": "ann"})
    assert ledger.wait_for_signal(WF, "go", timeout=0) == {"by": "ann"}
    assert _buffered(gated) == []


def test_signals_of_one_name_are_consumed_oldest_first_and_others_stay(
    ledger: Workflows, client: Workflows, gated: ReadHooks
) -> None:
    ledger.start(WF, "import")
    for n in range(3):
        client.send_signal(WF, "go", n)
    client.send_signal(WF, "stop")
    assert [ledger.wait_for_signal(WF, "go", timeout=0) for _ in range(3)] == [0, 1, 2]
    assert len(_buffered(gated, "stop")) == 1


def test_wait_times_out_without_consuming_anything(
    ledger: Workflows, client: Workflows, gated: ReadHooks
) -> None:
    ledger.start(WF, "import")
    client.send_signal(WF, "other")
    with pytest.raises(TimeoutError, match="'go'"):
        ledger.wait_for_signal(WF, "go", timeout=0.02)
    assert len(_buffered(gated, "other")) == 1
    assert ledger.signal_poll_target.list_parked_signal_waits() == []


def test_only_the_owner_may_wait(
    ledger: Workflows, ledger_b: Workflows, client: Workflows, sink_b: WarningSink
) -> None:
    ledger.start(WF, "import")
    client.send_signal(WF, "go")
    with pytest.raises(EngineDeposedError) as refused:
        ledger_b.wait_for_signal(WF, "go", timeout=0)
    # Engine B never held the claim: refused, but no claim of B's was lost.
    assert refused.value.cause == "not_held"
    assert sink_b.received == []


def test_signals_need_an_active_workflow(
    ledger: Workflows, client: Workflows, gated: ReadHooks
) -> None:
    with pytest.raises(WorkflowNotFoundError):
        client.send_signal("ghost", "go")
    ledger.start(WF, "import")
    ledger.complete(WF)
    with pytest.raises(WorkflowStateError, match="'completed'"):
        client.send_signal(WF, "go")
    assert _buffered(gated) == []


@pytest.mark.parametrize(
    ("name", "payload", "error"),
    [("", None, ValueError), (3, None, TypeError), ("go", {1, 2}, ValueError)],
)
def test_send_validates_name_and_payload(
    ledger: Workflows,
    client: Workflows,
    gated: ReadHooks,
    name: object,
    payload: object,
    error: type,
) -> None:
    ledger.start(WF, "import")
    before = snapshot(gated)
    with pytest.raises(error):
        client.send_signal(WF, name, payload)  # type: ignore[arg-type]
    assert snapshot(gated) == before


def test_wait_rejects_a_bad_timeout(ledger: Workflows) -> None:
    ledger.start(WF, "import")
    with pytest.raises(ValueError, match="timeout"):
        ledger.wait_for_signal(WF, "go", timeout=-1)


def test_a_send_in_this_process_wakes_the_parked_waiter(
    ledger: Workflows, gated: ReadHooks
) -> None:
    ledger.start(WF, "import")
    waiter = _park(gated, ledger)
    assert ledger.signal_poll_target.list_parked_signal_waits() == [ParkedSignalWait(WF, "go")]
    ledger.send_signal(WF, "go", 7)
    assert waiter.result() == 7


def test_the_signal_poll_wakes_a_waiter_for_a_signal_sent_elsewhere(
    ledger: Workflows, client: Workflows, gated: ReadHooks, clock: ManualClock
) -> None:
    ledger.start(WF, "import")
    waiter = _park(gated, ledger)
    target = ledger.signal_poll_target
    assert not target.has_buffered_signal(WF, "go")
    client.send_signal(WF, "go", "from afar")
    assert target.has_buffered_signal(WF, "go")
    result = run_owner_side_signal_poll(target, clock)
    assert [(o.workflow_id, o.signal_name, o.status) for o in result.outcomes] == [
        (WF, "go", SignalPollStatus.WOKEN)
    ]
    assert waiter.result() == "from afar"
    assert _buffered(gated) == []


def test_a_deposed_engine_discards_the_wake_and_the_new_owner_consumes(
    ledger: Workflows,
    ledger_b: Workflows,
    registry: ClaimRegistry,
    registry_b: ClaimRegistry,
    client: Workflows,
    gated: ReadHooks,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    ledger.start(WF, "import")
    waiter = _park(gated, ledger)
    clock.advance(PAST_GRACE_MS)
    assert registry_b.takeover(WF).status == "acquired"
    client.send_signal(WF, "go", 1)
    woke = threading.Event()
    gated.after_next_scan_of(GO, woke.set, thread_name="waiter")
    ledger.signal_poll_target.wake_workflow(WF)
    assert [(type(w), getattr(w, "wake_kind", None)) for w in sink.received] == [
        (WorkflowWakeDiscardedWarning, "signal")
    ]
    assert not woke.wait(0.05), "the deposed engine's waiter was woken"
    assert ledger_b.wait_for_signal(WF, "go", timeout=0) == 1
    assert registry.renew(WF).status == "lost"
    assert ledger.signal_poll_target.list_parked_signal_waits() == []
    # A local send reaches the stale waiter, which now finds it has no claim.
    ledger.send_signal(WF, "go", 2)
    assert isinstance(waiter.error(), EngineDeposedError)
    assert ledger_b.wait_for_signal(WF, "go", timeout=0) == 2


def test_a_consume_racing_a_takeover_is_refused_and_the_signal_kept_for_the_new_owner(
    ledger: Workflows,
    ledger_b: Workflows,
    registry_b: ClaimRegistry,
    client: Workflows,
    gated: ReadHooks,
    clock: ManualClock,
    sink: WarningSink,
) -> None:
    ledger.start(WF, "import")
    client.send_signal(WF, "go", "once")
    gate = gated.pause_next_cas(match=_consumes_a_signal)
    stale = Worker(lambda: ledger.wait_for_signal(WF, "go", WAIT_S), "stale-consumer")
    gate.wait_reached()
    clock.advance(PAST_GRACE_MS)
    assert registry_b.takeover(WF).status == "acquired"
    assert ledger_b.wait_for_signal(WF, "go", timeout=0) == "once"
    gate.open()
    assert isinstance(stale.error(), EngineDeposedError)
    assert sink.lost_ids() == [WF]
    assert _buffered(gated) == []


def test_concurrent_consumers_take_each_signal_exactly_once(
    ledger: Workflows, client: Workflows, gated: ReadHooks
) -> None:
    ledger.start(WF, "import")
    per_sender, senders = 15, 2
    total = per_sender * senders
    # lock guards consumed.
    lock = threading.Lock()
    consumed: list[object] = []
    done = threading.Event()

    def consume() -> None:
        while not done.is_set():
            try:
                payload = ledger.wait_for_signal(WF, "go", timeout=0.05)
            except TimeoutError:
                continue
            with lock:
                consumed.append(payload)
                if len(consumed) == total:
                    done.set()

    def send(sender: int) -> None:
        for n in range(per_sender):
            client.send_signal(WF, "go", f"{sender}-{n}")

    consumers = [Worker(consume, f"consumer-{n}") for n in range(3)]
    producers = [Worker(lambda s=s: send(s), f"sender-{s}") for s in range(senders)]  # type: ignore[misc]
    for worker in [*producers, *consumers]:
        worker.result()
    expected = sorted(f"{s}-{n}" for s in range(senders) for n in range(per_sender))
    assert sorted(consumed) == expected  # type: ignore[type-var]
    assert _buffered(gated) == []


def test_signals_sent_from_two_processes_are_each_consumed_once(
    ledger: Workflows, gated: ReadHooks, storage_url: str, clock: ManualClock
) -> None:
    ledger.start(WF, "import")
    count = 10
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(target=send_signals, args=(storage_url, WF, "go", f"p{n}", count))
        for n in range(2)
    ]
    stop = threading.Event()

    def poll() -> None:
        # Stands in for the maintenance task's signal-poll slot.
        while not stop.wait(0.01):
            run_owner_side_signal_poll(ledger.signal_poll_target, clock)

    poller = Worker(poll, "signal-poll")
    for child in children:
        child.start()
    try:
        consumed = [ledger.wait_for_signal(WF, "go", timeout=60) for _ in range(2 * count)]
    finally:
        stop.set()
        for child in children:
            child.join(60)
    poller.result()
    assert [child.exitcode for child in children] == [0, 0]
    assert sorted(map(str, consumed)) == sorted(f"p{p}-{n}" for p in range(2) for n in range(count))
    # Each process's signals arrive in the order it sent them.
    for p in range(2):
        mine = [c for c in consumed if str(c).startswith(f"p{p}-")]
        assert mine == [f"p{p}-{n}" for n in range(count)]
    assert _buffered(gated) == []
