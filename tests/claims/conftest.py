"""Fixtures of the claim tests: a manual clock, a gated real store, a warning sink, registries.

``reg`` is engine A's registry on the gated store, holding nothing yet; ``make`` builds more
registries sharing the clock (another engine, another store, another sink). A test module that
needs another wrapper overrides ``gated``, and one whose tests start from a held claim overrides
``reg``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.claims.gated import START_MS, GatedStorage, WarningSink, new_registry
from weft_sync.claims.registry import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.storage import Storage

Factory = Callable[..., ClaimRegistry]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def gated(storage: Storage) -> GatedStorage:
    return GatedStorage(storage)


@pytest.fixture
def sink() -> WarningSink:
    return WarningSink()


@pytest.fixture
def make(gated: GatedStorage, clock: ManualClock, sink: WarningSink) -> Factory:
    """Build a registry on the gated store (or ``store``) sharing the test clock.

    Its warnings go to ``warn``, or to the ``sink`` fixture when ``warn`` is not given.
    """

    def _make(
        engine_id: str = "engine-a",
        warn: WarningSink | None = None,
        *,
        store: Storage | None = None,
    ) -> ClaimRegistry:
        return new_registry(
            gated if store is None else store,
            clock,
            engine_id,
            sink if warn is None else warn,
        )

    return _make


@pytest.fixture
def reg(make: Factory) -> ClaimRegistry:
    """Engine A's registry on the gated store."""
    return make()
