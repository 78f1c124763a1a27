"""Bare claims never strand: ``claim()`` takes over an expired holder, and ``claim(wait=)`` retries.

A bare claim has no workflow record, so no reclaim pass clears it; a crashed process's claim is
taken over by the next ``claim()`` once it expired past the grace, on both backends, whatever
the engine's eligibility settings.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines import MakeOwnership, opened_engines
from tests.support.waiting import wait_until
from tests.workflows.helpers import expires_at, holder_engine, stored_epoch
from weft_sync.clock import ManualClock, system_clock
from weft_sync.errors import ClosedError, WorkflowClaimUnavailableError
from weft_sync.options import OwnershipOptions
from weft_sync.ownership.bare_claims import ClaimAttempt, claim_with_wait
from weft_sync.ownership.facade import Ownership
from weft_sync.storage import Storage

TTL_MS = 3_000
RENEW_MS = 1_000
GRACE_MS = 2 * RENEW_MS
OPTIONS = OwnershipOptions(claim_ttl=TTL_MS, claim_renew_interval=RENEW_MS)
HOUR_MS = 3_600_000
WAIT_S = 30.0
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000)


@pytest.fixture
def make_ownership(storage: Storage, clock: ManualClock) -> Iterator[MakeOwnership]:
    """Open manual-maintenance engines on the test's store; all closed afterwards."""
    with opened_engines(storage, clock, OPTIONS) as make:
        yield make


def _crash_holding(ownership: Ownership, workflow_id: str) -> None:
    """Leave ``workflow_id`` claimed by ``ownership`` as a killed process would: unreleased."""
    ownership.registry.acquire(workflow_id)
    ownership.registry.forget_local_claim(workflow_id)


# -- takeover of an expired bare claim --------------------------------------------------------


@pytest.mark.parametrize("eligibility", ["none", "is_eligible", "handlers"])
def test_claim_takes_over_a_bare_claim_that_expired_past_the_grace(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage, eligibility: str
) -> None:
    choices: dict[str, dict[str, Any]] = {
        "none": {},
        "is_eligible": {"is_eligible": lambda workflow_type, revision: workflow_type == "report"},
        "handlers": {"handlers": {"report": lambda ctx: None}},
    }
    settings = choices[eligibility]
    _crash_holding(make_ownership("engine-dead"), "nightly")
    survivor = make_ownership("engine-b", **settings)
    clock.advance(TTL_MS + GRACE_MS + 1)

    with survivor.claim("nightly") as handle:
        assert handle.epoch == 2
        assert (holder_engine(storage, "nightly"), stored_epoch(storage, "nightly")) == (
            "engine-b",
            2,
        )
        handle.assert_held()

    assert holder_engine(storage, "nightly") is None
    attempts = survivor.metrics.snapshot().attempts
    assert (attempts["takeover"], attempts["acquired"], attempts["lost_race"]) == (1, 0, 0)


def test_claim_of_a_live_or_merely_expired_bare_claim_is_unavailable(
    make_ownership: MakeOwnership, clock: ManualClock, storage: Storage
) -> None:
    _crash_holding(make_ownership("engine-dead"), "nightly")
    survivor = make_ownership("engine-b")
    # Expired, but not yet past the grace: its owner may only be late renewing.
    clock.advance(TTL_MS + GRACE_MS)

    with pytest.raises(WorkflowClaimUnavailableError) as caught, survivor.claim("nightly"):
        pytest.fail("the block must not run")

    assert caught.value.held_by == "engine-dead"
    assert (holder_engine(storage, "nightly"), stored_epoch(storage, "nightly")) == (
        "engine-dead",
        1,
    )
    assert survivor.metrics.snapshot().attempts["lost_race"] == 1


def test_a_sigkilled_process_bare_claim_is_taken_over_by_an_engine_with_is_eligible(
    storage_url: str, storage: Storage
) -> None:
    child_code = textwrap.dedent(
        """
        import sys, time
        from weft_sync import Ownership, OwnershipOptions
        ownership = Ownership.open(
            sys.argv[1], options=OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
        )
        with ownership.claim("nightly-report"):
            print("held", flush=True)
            time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", child_code, storage_url],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "held\n"
        held_by = holder_engine(storage, "nightly-report")
        assert held_by is not None
        expiry = expires_at(storage, "nightly-report")
        assert expiry is not None
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=WAIT_S)
    assert child.returncode == -signal.SIGKILL
    # An hour later on this engine's clock the dead holder is long past its grace.
    later = ManualClock(system_clock() + HOUR_MS)
    with Ownership.open(
        storage,
        options=OPTIONS,
        clock=later,
        background="manual",
        is_eligible=lambda workflow_type, revision: workflow_type == "report",
        engine_id="engine-b",
    ) as survivor:
        # The reclaim pass leaves a bare claim alone (there is no record to drive) ...
        survivor.run_maintenance()
        assert holder_engine(storage, "nightly-report") == held_by
        # ... and claim() takes it over.
        with survivor.claim("nightly-report") as handle:
            assert handle.epoch == 2
            assert holder_engine(storage, "nightly-report") == "engine-b"
    assert stored_epoch(storage, "nightly-report") == 2


# -- claim(wait=) -----------------------------------------------------------------------------


def test_claim_with_wait_acquires_once_the_holder_lets_go(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    holder = make_ownership("engine-a")
    waiter = make_ownership("engine-b")
    release = threading.Event()
    acquired = threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with holder.claim("leader"):
                acquired.set()
                release.wait(WAIT_S)
        except BaseException as exc:  # re-raised in the test below
            errors.append(exc)

    thread = threading.Thread(target=hold, name="test-holder")
    thread.start()
    try:
        assert acquired.wait(WAIT_S)

        def let_go_after_a_refusal() -> None:
            wait_until(lambda: waiter.metrics.snapshot().attempts["lost_race"] >= 1, "refusal")
            release.set()

        releaser = threading.Thread(target=let_go_after_a_refusal, name="test-releaser")
        releaser.start()
        with waiter.claim("leader", wait=WAIT_S) as handle:
            assert handle.epoch == 2
            assert holder_engine(storage, "leader") == "engine-b"
        releaser.join(WAIT_S)
    finally:
        release.set()
        thread.join(WAIT_S)
    assert errors == []
    attempts = waiter.metrics.snapshot().attempts
    assert attempts["acquired"] == 1 and attempts["lost_race"] >= 1


def test_claim_with_wait_raises_unavailable_once_the_wait_runs_out(
    make_ownership: MakeOwnership, storage: Storage
) -> None:
    holder = make_ownership("engine-a")
    waiter = make_ownership("engine-b")
    with holder.claim("leader"):
        with (
            pytest.raises(WorkflowClaimUnavailableError) as caught,
            waiter.claim("leader", wait=0.2),
        ):
            pytest.fail("the block must not run")
        assert caught.value.held_by == "engine-a"
        assert holder_engine(storage, "leader") == "engine-a"
    # How many retries fit in the wait depends on the machine; the delays are tested below.
    assert waiter.metrics.snapshot().attempts["lost_race"] >= 1


def test_claim_with_wait_stops_when_the_ownership_closes(
    make_ownership: MakeOwnership,
) -> None:
    holder = make_ownership("engine-a")
    waiter = make_ownership("engine-b")
    outcome: list[BaseException] = []

    def wait_for_leader() -> None:
        try:
            with waiter.claim("leader", wait=WAIT_S):
                pass
        except BaseException as exc:  # inspected below
            outcome.append(exc)

    with holder.claim("leader"):
        thread = threading.Thread(target=wait_for_leader, name="test-waiter")
        thread.start()
        wait_until(lambda: waiter.metrics.snapshot().attempts["lost_race"] >= 1, "refusal")
        waiter.close()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ClosedError)


def test_wait_delays_grow_with_jitter_and_stop_at_the_first_success() -> None:
    results = iter([ClaimAttempt(None, "a"), ClaimAttempt(None, "a"), ClaimAttempt(7)])
    pauses: list[float] = []
    checks: list[int] = []

    outcome = claim_with_wait(
        lambda: next(results), WAIT_S, lambda: checks.append(1), sleep=pauses.append
    )

    assert outcome == ClaimAttempt(7)
    assert len(checks) == 3  # the open check runs before every attempt
    assert len(pauses) == 2
    assert 0.025 <= pauses[0] <= 0.05 and 0.05 <= pauses[1] <= 0.1


def test_no_wait_makes_exactly_one_attempt() -> None:
    calls: list[int] = []

    def attempt() -> ClaimAttempt:
        calls.append(1)
        return ClaimAttempt(None, "a")

    for wait_s in (None, 0.0):
        calls.clear()
        outcome = claim_with_wait(attempt, wait_s, lambda: None, sleep=_never_sleep)
        assert outcome == ClaimAttempt(None, "a")
        assert calls == [1]


def _never_sleep(seconds: float) -> None:
    pytest.fail(f"slept {seconds} s without a wait")


@pytest.mark.parametrize(
    ("wait", "error"),
    [
        (-1, ValueError),
        (-0.001, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        ("5", TypeError),
        (True, TypeError),
        ([1], TypeError),
    ],
)
def test_claim_rejects_a_bad_wait_naming_it(
    make_ownership: MakeOwnership, wait: Any, error: type[Exception]
) -> None:
    ownership = make_ownership("engine-a")
    expected = r"wait must be a (finite )?number of seconds >= 0"
    with pytest.raises(error, match=expected), ownership.claim("leader", wait=wait):
        pytest.fail("the block must not run")
    assert ownership.registry.list_held_workflow_ids() == []


def test_ownership_metrics_count_start_and_claim_as_acquired(
    make_ownership: MakeOwnership,
) -> None:
    ownership = make_ownership("engine-a")
    ownership.workflows.start("wf-1", "report")
    with ownership.claim("leader"):
        pass
    assert ownership.metrics.snapshot().attempts["acquired"] == 2
