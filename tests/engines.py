"""Open several manual-maintenance engines on one real store in a test; all closed afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.claims.gated import WarningSink
from weft_sync import Ownership, OwnershipOptions
from weft_sync.clock import ManualClock
from weft_sync.storage import Storage

MakeOwnership = Callable[..., Ownership]
"""``make(engine_id, **open_kwargs) -> Ownership`` on the shared store."""


@contextmanager
def opened_engines(
    storage: Storage, clock: ManualClock, options: OwnershipOptions
) -> Iterator[MakeOwnership]:
    """Yield a factory of engines on ``storage`` (manual maintenance, ``clock``, ``options``,
    warnings collected by a :class:`WarningSink` unless given); close them all on exit."""
    opened: list[Ownership] = []

    def make(engine_id: str, **kwargs: Any) -> Ownership:
        kwargs.setdefault("options", options)
        kwargs.setdefault("clock", clock)
        kwargs.setdefault("background", "manual")
        kwargs.setdefault("warn", WarningSink())
        ownership = Ownership.open(storage, engine_id=engine_id, **kwargs)
        opened.append(ownership)
        return ownership

    try:
        yield make
    finally:
        for ownership in opened:
            ownership.close()


def adopt_claims(ownership: Ownership) -> None:
    """Make the calling thread the driver of every claim ``ownership`` holds (a host whose own
    threads drive what its handlers handed on, for tests about claiming rather than driving)."""
    for wid in ownership.registry.list_held_workflow_ids():
        epoch = ownership.registry.current_epoch(wid)
        if epoch is not None:
            ownership.drivers.enter(wid, epoch, "test thread")
