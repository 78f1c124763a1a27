"""Fixtures of the workflow-ledger tests: two engines and a client on one gated real store.

Engine A (``registry``/``ledger``) and engine B (``registry_b``/``ledger_b``) share the store and
the manual clock; ``client`` is a ledger without a registry (a process that only reads, sends
signals and updates, and runs external transitions).
"""

from __future__ import annotations

import pytest

from tests.claims.gated import START_MS, GatedStorage, WarningSink, new_registry
from tests.workflows.helpers import ReadHooks
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def gated(storage: Storage) -> ReadHooks:
    return ReadHooks(storage)


@pytest.fixture
def sink() -> WarningSink:
    return WarningSink()


@pytest.fixture
def sink_b() -> WarningSink:
    return WarningSink()


@pytest.fixture
def registry(gated: GatedStorage, clock: ManualClock, sink: WarningSink) -> ClaimRegistry:
    return new_registry(gated, clock, "engine-a", sink)


@pytest.fixture
def ledger(
    gated: GatedStorage, registry: ClaimRegistry, clock: ManualClock, sink: WarningSink
) -> Workflows:
    return Workflows(gated, registry, clock=clock, warn=sink)


@pytest.fixture
def registry_b(gated: GatedStorage, clock: ManualClock, sink_b: WarningSink) -> ClaimRegistry:
    return new_registry(gated, clock, "engine-b", sink_b)


@pytest.fixture
def ledger_b(
    gated: GatedStorage, registry_b: ClaimRegistry, clock: ManualClock, sink_b: WarningSink
) -> Workflows:
    return Workflows(gated, registry_b, clock=clock, warn=sink_b)


@pytest.fixture
def client(gated: GatedStorage, clock: ManualClock) -> Workflows:
    return Workflows(gated, None, clock=clock, warn=WarningSink())
