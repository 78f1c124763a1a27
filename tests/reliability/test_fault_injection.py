"""Transient storage faults never kill maintenance and never drop a claim silently.

One engine runs the real renewal task (``bootstrap_workflow_lease_ownership``) over a
:class:`FaultyStorage` that fails ~2 % of its calls — before they reach the store, after they
committed, or after a short delay. Ticks come from a hand-fired scheduler and ``run_once()``.
A second registry on a clean instance of the same store (with a clock far ahead, so it sees the
first engine's claims as expired) takes claims over, releases them and rotates epochs, and the
test itself acquires, releases, renews and takes over through the faulty store.

After every tick, and again at the end, the test checks that:

- no exception reached ``threading.excepthook`` and every tick produced one renewal and one
  reclaim result (the background passes never die);
- every claim that left the registry was released on purpose or reported lost with exactly one
  :class:`WorkflowClaimLostWarning`; a renewal that failed with a transient error kept its claim;
- the metrics count every failed renewal outcome and every lost claim;
- once faults stop, every claim the engine still believes it holds is really its own in the store.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.claims.gated import WarningSink
from tests.maintenance.helpers import ManualScheduler, PassRecorder
from tests.reliability.faulty import FaultyStorage, InjectedFault
from weft_sync import keys
from weft_sync.claims import ClaimRegistry, build_external_rotation_transition
from weft_sync.claims.renewal_target import ClaimRenewalLostError
from weft_sync.clock import ManualClock
from weft_sync.codec import WorkflowRecord, decode_holder, encode_workflow_record
from weft_sync.errors import StorageError, WorkflowClaimLostWarning
from weft_sync.maintenance.bootstrap import OwnershipBootstrap, bootstrap_workflow_lease_ownership
from weft_sync.maintenance.targets import (
    PassKind,
    PassResult,
    ReclaimOutcomeStatus,
    ReclaimPassStatus,
    RenewalStatus,
)
from weft_sync.storage import Put, Storage

TTL_MS = 30_000
RENEW_MS = 5_000
START_MS = 1_700_000_000_000
# The second engine's clock runs this far ahead, so it judges every claim of the first expired.
SKEW_MS = TTL_MS + 2 * RENEW_MS + 1
WORKFLOW_IDS = tuple(f"wf-{n:02d}" for n in range(24))
TICKS = 300
CLEAN_TICKS = 2
FAULT_RATE = 0.02
WAIT_S = 30.0


@dataclass
class Ledger:
    """What the test saw happen to the faulty engine's claims."""

    lost: Counter[str] = field(default_factory=Counter)
    failed_outcomes: int = 0
    lost_outcomes_in_passes: int = 0
    deadline_losses: int = 0
    transient_failures: int = 0
    released_on_purpose: int = 0
    b_takeovers: int = 0
    rotations: int = 0


def _engine(
    storage: Storage, clock: ManualClock, warn: WarningSink, **kwargs: Any
) -> OwnershipBootstrap:
    """An engine on ``storage`` with this module's timing, ticked by hand unless told otherwise."""
    kwargs.setdefault("scheduler", ManualScheduler())
    return bootstrap_workflow_lease_ownership(
        storage=storage,
        clock=clock,
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
        warn=warn,
        **kwargs,
    )


class Harness:
    """The faulty engine ``a``, the clean competitor ``b`` and the checks run after each tick."""

    def __init__(
        self, storage: Storage, clean: Storage, clock: ManualClock, rng: random.Random
    ) -> None:
        self.clock = clock
        self.rng = rng
        self.clean = clean
        self.faulty = FaultyStorage(storage, rate=0.0, seed=rng.randrange(2**32))
        self.scheduler = ManualScheduler()
        self.recorder = PassRecorder()
        self.sink_a = WarningSink()
        self.sink_b = WarningSink()
        self.ledger = Ledger()
        self.engine = _engine(
            self.faulty,
            clock,
            self.sink_a,
            scheduler=self.scheduler,
            on_pass_complete=self.recorder,
            engine_id="engine-a",
        )
        self.b = ClaimRegistry(
            clean,
            engine_id="engine-b",
            clock=lambda: clock() + SKEW_MS,
            claim_ttl_ms=TTL_MS,
            claim_renew_interval_ms=RENEW_MS,
            warn=self.sink_b,
        )

    @property
    def a(self) -> ClaimRegistry:
        return self.engine.registry

    def held_a(self) -> set[str]:
        return set(self.a.list_held_workflow_ids())

    # -- actions between ticks -------------------------------------------------------------

    def act(self) -> set[str]:
        """Run one random action; return the ids the faulty engine released on purpose."""
        wid = self.rng.choice(WORKFLOW_IDS)
        held = sorted(self.held_a())
        action = self.rng.choice(
            ["a-acquire", "a-release", "a-renew-many", "a-takeover", "b-takeover", "b-takeover",
             "b-release", "b-acquire", "b-renew", "rotate", "none"]
        )  # fmt: skip
        released: set[str] = set()
        if action == "a-release" and held:
            target = self.rng.choice(held)
            released.add(target)
            self.ledger.released_on_purpose += 1
            self._tolerate(lambda: self.a.release(target))
        elif action == "a-acquire":
            self._tolerate(lambda: self.a.acquire(wid))
        elif action == "a-takeover":
            self._tolerate(lambda: self.a.takeover(wid))
        elif action == "a-renew-many" and held:
            self._direct_renew_many(self.rng.sample(held, min(len(held), 5)))
        elif action == "b-takeover":
            result = self.b.takeover(wid)
            if result.status == "acquired" and wid in held:
                self.ledger.b_takeovers += 1
        elif action == "b-release":
            for b_held in self.b.list_held_workflow_ids()[:2]:
                self.b.release(b_held)
        elif action == "b-acquire":
            self.b.acquire(wid)
        elif action == "b-renew":
            self.b.renew_many(self.b.list_held_workflow_ids())
        elif action == "rotate":
            self._rotate(wid)
        return released

    def _tolerate(self, call: Callable[[], object]) -> None:
        warned = len(self.sink_a.received)
        with contextlib.suppress(InjectedFault):
            call()
        # Only renewals report lost claims: a direct acquire, release or takeover never does.
        assert len(self.sink_a.received) == warned

    def _direct_renew_many(self, ids: list[str]) -> None:
        warned = len(self.sink_a.received)
        try:
            results = self.a.renew_many(ids)
        except InjectedFault:
            # One chunk, one transaction: when it fails, no renewal settled, none was lost.
            assert len(self.sink_a.received) == warned
            return
        for result in results:
            if result.status == "lost":
                self.ledger.lost[result.workflow_id] += 1

    def _rotate(self, wid: str) -> None:
        observed = self.clean.get(keys.workflow_owner_epoch(wid))
        fragment = build_external_rotation_transition(
            workflow_id=wid, observed_epoch_bytes=observed
        )
        if self.clean.conditional_batch(fragment.conditions, fragment.operations):
            self.ledger.rotations += 1

    # -- steps and checks ------------------------------------------------------------------

    def step(self, *, manual: bool, act: bool = True) -> None:
        """Run one action, advance the clock, run one pass, and check what happened to claims."""
        held_before = self.held_a()
        warned = len(self.sink_a.received)
        released = self.act() if act else set()
        held_before |= self.held_a()
        self.clock.advance(RENEW_MS if self.rng.random() < 0.9 else 2 * TTL_MS)
        seen = len(self.recorder.results)
        if manual:
            self.engine.renewal_task.run_once()
        else:
            self.scheduler.fire()
        assert self.engine.renewal_task.wait_idle(WAIT_S), "a maintenance pass never finished"
        new_results = self.recorder.results[seen:]
        held_after = self.held_a()
        newly_warned = {getattr(w, "workflow_id", None) for w in self.sink_a.received[warned:]}
        assert all(isinstance(w, WorkflowClaimLostWarning) for w in self.sink_a.received[warned:])

        kinds = Counter(r.kind for r in new_results)
        expected_kinds = (
            {PassKind.FULL: 1} if manual else {PassKind.RENEWAL: 1, PassKind.RECLAIM: 1}
        )
        assert kinds == expected_kinds, f"passes reported this tick: {kinds}"

        transient: set[str] = set()
        for result in new_results:
            transient |= self._record_pass(result)
        dropped = held_before - held_after
        silent = dropped - released - newly_warned
        assert not silent, f"claims dropped with neither a release nor a lost warning: {silent}"
        kept = transient - held_after
        assert not kept, f"a transient renewal error dropped the claims {kept}"

    def _record_pass(self, result: PassResult) -> set[str]:
        """Count one pass's outcomes; return the ids whose renewal failed transiently."""
        transient: set[str] = set()
        for outcome in result.outcomes:
            if outcome.status is RenewalStatus.RENEWED:
                continue
            self.ledger.failed_outcomes += 1
            if isinstance(outcome.error, ClaimRenewalLostError):
                self.ledger.lost[outcome.workflow_id] += 1
                self.ledger.lost_outcomes_in_passes += 1
                # A fault after a clock jump past the renew deadline gives the claim up locally.
                if outcome.error.cause == "deadline":
                    self.ledger.deadline_losses += 1
            else:
                assert isinstance(outcome.error, InjectedFault), repr(outcome.error)
                self.ledger.transient_failures += 1
                transient.add(outcome.workflow_id)
        reclaim = result.reclaim
        if reclaim is not None:
            if reclaim.status is ReclaimPassStatus.DISCOVERY_FAILED:
                assert isinstance(reclaim.error, InjectedFault), repr(reclaim.error)
            for attempt in reclaim.outcomes:
                if attempt.status is ReclaimOutcomeStatus.ERROR:
                    assert isinstance(attempt.error, InjectedFault), repr(attempt.error)
        return transient

    def assert_beliefs_are_true(self) -> None:
        """Every claim the engine tracks is its own, at the tracked epoch, in the store."""
        for wid in self.held_a():
            holder = decode_holder(self.clean.get(keys.workflow_owner_holder(wid)))
            stored_epoch = self.clean.get(keys.workflow_owner_epoch(wid))
            assert holder is not None, wid
            assert (holder.engine_id, holder.epoch) == ("engine-a", self.a.current_epoch(wid))
            assert stored_epoch == self.a.current_epoch_bytes(wid)


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BaseException | None]]:
    """Every exception that escaped a thread during the test."""
    errors: list[BaseException | None] = []
    # lock guards errors.
    lock = threading.Lock()

    def capture(args: threading.ExceptHookArgs) -> None:
        with lock:
            errors.append(args.exc_value)

    monkeypatch.setattr(threading, "excepthook", capture)
    yield errors


def _seed_running_workflows(store: Storage) -> None:
    ops: list[Put] = []
    for wid in WORKFLOW_IDS:
        record = WorkflowRecord(wid, "import", "running", created_at=START_MS, updated_at=START_MS)
        ops.append(Put(keys.workflow(wid), encode_workflow_record(record)))
        ops.append(Put(keys.workflow_status_index("running", wid), b""))
    store.batch(ops)


def test_transient_faults_never_kill_maintenance_or_drop_a_claim_silently(
    storage: Storage,
    open_store: Callable[[], Storage],
    thread_errors: list[BaseException | None],
) -> None:
    rng = random.Random(20240607)
    clean = open_store()
    _seed_running_workflows(clean)
    harness = Harness(storage, clean, ManualClock(START_MS), rng)
    task = harness.engine.renewal_task
    try:
        task.start()
        harness.faulty.rate = FAULT_RATE
        for n in range(TICKS):
            harness.step(manual=n % 10 == 9)
        harness.faulty.rate = 0.0
        for n in range(CLEAN_TICKS):
            harness.step(manual=n % 2 == 1, act=False)
        harness.assert_beliefs_are_true()
    finally:
        assert task.close(timeout=WAIT_S)

    ledger = harness.ledger
    faulty = harness.faulty
    assert thread_errors == []
    # Enough happened for the checks above to mean something.
    assert faulty.total_calls >= 2_000, faulty.calls
    assert faulty.fault_count("before", writes_only=True) > 0, faulty.faults
    assert faulty.fault_count("after", writes_only=True) > 0, faulty.faults
    assert faulty.fault_count("delay") > 0, faulty.faults
    assert ledger.transient_failures > 0
    assert ledger.b_takeovers > 0 and ledger.lost_outcomes_in_passes > 0
    assert ledger.rotations > 0 and ledger.released_on_purpose > 0
    # Exactly one warning per lost claim, and no warning without a lost claim.
    warned = Counter(getattr(w, "workflow_id", None) for w in harness.sink_a.received)
    assert warned == ledger.lost
    snapshot = harness.engine.metrics.snapshot()
    assert snapshot.renewal_failures == ledger.failed_outcomes
    deposed = ledger.lost_outcomes_in_passes - ledger.deadline_losses
    assert snapshot.attempts["deposed"] == deposed
    assert snapshot.lost == {
        "deposed": deposed,
        "deadline": ledger.deadline_losses,
        "store_identity": 0,
        "store_rollback": 0,
    }
    assert snapshot.active_claims == len(harness.held_a())


def test_a_renewal_whose_commit_landed_but_raised_is_adopted_by_the_next_pass(
    storage: Storage, thread_errors: list[BaseException | None]
) -> None:
    clock = ManualClock(START_MS)
    faulty = FaultyStorage(storage, rate=0.0, kinds=("after",), methods=["compare_and_set_many"])
    sink = WarningSink()
    recorder = PassRecorder()
    engine = _engine(faulty, clock, sink, on_pass_complete=recorder)
    task = engine.renewal_task
    try:
        assert engine.registry.acquire("wf-1").status == "acquired"
        assert engine.registry.acquire("wf-2").status == "acquired"
        faulty.rate = 1.0
        clock.advance(RENEW_MS)
        first = task.run_once()
        # The renewal landed in the store, but the engine only saw an error: claims kept, no
        # warning yet.
        assert [o.status for o in first.outcomes] == ["failed", "failed"]
        assert all(isinstance(o.error, StorageError) for o in first.outcomes)
        assert sorted(engine.registry.list_held_workflow_ids()) == ["wf-1", "wf-2"]
        assert sink.received == []
        faulty.rate = 0.0
        clock.advance(RENEW_MS)
        second = task.run_once()
        # The holder no longer matches the cached bytes, but it is the value the failed renewal
        # wrote: the registry adopts it and renews from it, with no loss reported.
        assert [o.status for o in second.outcomes] == ["renewed", "renewed"]
        assert sink.received == []
        assert sorted(engine.registry.list_held_workflow_ids()) == ["wf-1", "wf-2"]
        for wid in ("wf-1", "wf-2"):
            holder = decode_holder(storage.get(keys.workflow_owner_holder(wid)))
            assert holder is not None
            assert (holder.engine_id, holder.expires_at) == (
                engine.registry.engine_id,
                clock() + TTL_MS,
            )
        clock.advance(RENEW_MS)
        assert [o.status for o in task.run_once().outcomes] == ["renewed", "renewed"]
        snapshot = engine.metrics.snapshot()
        assert snapshot.renewal_failures == 2
        assert snapshot.attempts["deposed"] == 0
    finally:
        assert task.close(timeout=WAIT_S)
    assert thread_errors == []


def test_a_renewal_that_failed_before_reaching_the_store_keeps_the_claim_and_warns_nothing(
    storage: Storage, thread_errors: list[BaseException | None]
) -> None:
    clock = ManualClock(START_MS)
    faulty = FaultyStorage(storage, rate=0.0, kinds=("before",), methods=["compare_and_set_many"])
    sink = WarningSink()
    engine = _engine(faulty, clock, sink)
    task = engine.renewal_task
    try:
        assert engine.registry.acquire("wf-1").status == "acquired"
        faulty.rate = 1.0
        for _ in range(3):
            clock.advance(RENEW_MS)
            assert [o.status for o in task.run_once().outcomes] == ["failed"]
        faulty.rate = 0.0
        clock.advance(RENEW_MS)
        assert [o.status for o in task.run_once().outcomes] == ["renewed"]
        assert engine.registry.current_epoch("wf-1") == 1
        assert sink.received == []
        snapshot = engine.metrics.snapshot()
        assert (snapshot.renewal_failures, snapshot.attempts["deposed"]) == (3, 0)
    finally:
        assert task.close(timeout=WAIT_S)
    assert thread_errors == []
