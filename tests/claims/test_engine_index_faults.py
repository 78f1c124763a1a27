"""The by-engine entry never outlives or misses its holder, whatever a commit does.

A commit can fail before it reaches the store (nothing written) or raise after it committed (an
ambiguous commit that landed); either way the entry and the holder moved together, because they
are written in one conditional batch. A property test runs random transitions of two engines,
with faults injected into random commits, and checks the invariant after every step.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.claims.conftest import Factory
from tests.claims.gated import PAST_GRACE_MS, GatedStorage, WarningSink, new_registry
from tests.claims.index_checks import assert_index_exact, entries
from weft_sync import keys
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.errors import (
    EngineDeposedError,
    StorageError,
    WorkflowClaimUnavailableError,
)
from weft_sync.storage import Storage
from weft_sync.workflows import WorkflowNotFoundError, Workflows, WorkflowStateError

WF = "wf-1"
HOLDER = keys.workflow_owner_holder(WF)

Step = Callable[[ClaimRegistry, ClaimRegistry, Workflows, Workflows], object]

# Each case: how to set the store up (not faulted), then the transition whose commit is faulted.
CASES: dict[str, tuple[Step, Step]] = {
    "acquire": (lambda a, b, la, out: None, lambda a, b, la, out: a.acquire(WF)),
    "takeover": (lambda a, b, la, out: a.acquire(WF), lambda a, b, la, out: b.takeover(WF)),
    "takeover_many": (
        lambda a, b, la, out: a.acquire(WF),
        lambda a, b, la, out: _raise_first(b.takeover_many([WF])),
    ),
    "dead-engine takeover": (
        lambda a, b, la, out: a.acquire(WF),
        lambda a, b, la, out: b.takeover(WF, dead_engines={"engine-a"}),
    ),
    "release": (lambda a, b, la, out: a.acquire(WF), lambda a, b, la, out: a.release(WF)),
    "start": (lambda a, b, la, out: None, lambda a, b, la, out: la.start(WF, "import")),
    "complete": (
        lambda a, b, la, out: la.start(WF, "import"),
        lambda a, b, la, out: la.complete(WF, "done"),
    ),
    "cancel": (
        lambda a, b, la, out: la.start(WF, "import"),
        lambda a, b, la, out: out.cancel(WF),
    ),
    "purge": (
        lambda a, b, la, out: la.start(WF, "import"),
        lambda a, b, la, out: out.purge(WF),
    ),
}
# The takeovers need the first holder expired (the dead-engine one does not).
_NEEDS_EXPIRY = {"takeover", "takeover_many"}


def _raise_first(outcomes: Sequence[object]) -> object:
    if isinstance(outcomes[0], Exception):
        raise outcomes[0]
    return outcomes[0]


@pytest.mark.parametrize("landed", [False, True], ids=["failed", "landed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failed_or_ambiguous_commit_moves_entry_and_holder_together(
    make: Factory, gated: GatedStorage, clock: ManualClock, case: str, landed: bool
) -> None:
    a, b = make("engine-a"), make("engine-b")
    ledger = Workflows(gated, a, clock=clock, warn=WarningSink())
    outsider = Workflows(gated, None, clock=clock, warn=WarningSink())
    setup, step = CASES[case]
    setup(a, b, ledger, outsider)
    if case in _NEEDS_EXPIRY:
        clock.advance(PAST_GRACE_MS)
    before = gated.get(HOLDER)
    gated.raise_on_next_cas(StorageError("connection lost during COMMIT"), after_commit=landed)
    with contextlib.suppress(StorageError):
        step(a, b, ledger, outsider)
    # The commit did what it says: landed, or left the holder as it was.
    assert (gated.get(HOLDER) != before) is landed
    assert_index_exact(gated)


def test_an_ambiguous_renewal_leaves_the_entry_alone(
    reg: ClaimRegistry, gated: GatedStorage, clock: ManualClock
) -> None:
    reg.acquire(WF)
    clock.advance(1_000)
    gated.raise_on_next_cas(StorageError("lost during COMMIT"), after_commit=True)
    with pytest.raises(StorageError):
        reg.renew(WF)
    assert entries(gated) == {("engine-a", WF): 1}
    assert reg.renew(WF).status == "renewed"
    assert_index_exact(gated)


# -- property: random transitions of two engines, random faults ---------------------------------

ENGINES = ("engine-a", "engine-b")
OPS = (
    "acquire",
    "renew",
    "release",
    "takeover",
    "dead-takeover",
    "takeover_many",
    "start",
    "complete",
    "cancel",
    "suspend",
    "purge",
    "forget",
    "advance",
)
steps = st.lists(
    st.tuples(
        st.sampled_from(OPS),
        st.integers(0, 1),  # engine
        st.integers(0, 1),  # workflow
        st.sampled_from([None, None, "before", "after"]),  # fault on the step's next commit
    ),
    min_size=1,
    max_size=14,
)
_runs = itertools.count()
REFUSALS: tuple[type[Exception], ...] = (
    StorageError,  # the injected fault
    EngineDeposedError,  # a write by an engine that lost the claim
    WorkflowClaimUnavailableError,  # a start while another engine holds the claim
    WorkflowNotFoundError,  # a finish or an outsider's transition before any start
    WorkflowStateError,  # a finish or transition from the wrong status
)


def _run_step(
    op: str,
    registry: ClaimRegistry,
    other: str,
    ledger: Workflows,
    outsider: Workflows,
    wid: str,
    clock: ManualClock,
) -> None:
    if op == "acquire":
        registry.acquire(wid)
    elif op == "renew":
        registry.renew_many([wid]) if registry.current_epoch(wid) else None
    elif op == "release":
        registry.release(wid)
    elif op == "takeover":
        registry.takeover(wid)
    elif op == "dead-takeover":
        registry.takeover(wid, dead_engines={other})
    elif op == "takeover_many":
        _raise_first(registry.takeover_many([wid]))
    elif op == "start":
        ledger.start(wid, "import")
    elif op == "complete":
        ledger.complete(wid, "done")
    elif op in ("cancel", "suspend", "purge"):
        getattr(outsider, op)(wid)
    elif op == "forget":
        registry.forget_local_claim(wid)
    else:
        clock.advance(PAST_GRACE_MS)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=steps)
def test_random_transitions_and_faults_keep_the_index_exact(
    storage: Storage, plan: list[tuple[str, int, int, str | None]]
) -> None:
    run = next(_runs)
    clock = ManualClock(1_000_000)
    gated = GatedStorage(storage)
    registries = [new_registry(gated, clock, engine, WarningSink()) for engine in ENGINES]
    ledgers = [Workflows(gated, r, clock=clock, warn=WarningSink()) for r in registries]
    outsider = Workflows(gated, None, clock=clock, warn=WarningSink())
    ids = [f"run{run}-w{n}" for n in range(2)]
    try:
        for op, engine, workflow, fault in plan:
            if fault is not None:
                gated.raise_on_next_cas(StorageError("injected"), after_commit=fault == "after")
            # Refused transitions (wrong state, deposed, faulted) are part of the plan; any
            # other exception is a bug and fails the test.
            with contextlib.suppress(*REFUSALS):
                _run_step(
                    op,
                    registries[engine],
                    ENGINES[1 - engine],
                    ledgers[engine],
                    outsider,
                    ids[workflow],
                    clock,
                )
            # An armed fault that no commit used must not leak into the next step.
            gated.clear_intercepts()
            assert_index_exact(gated)
    finally:
        for registry in registries:
            registry.close()
    assert_index_exact(gated)
