"""Open several manual-maintenance engines on one real store in a test; all closed afterwards."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.claims.gated import WarningSink
from weft_sync import Ownership, OwnershipOptions
from weft_sync.clock import ManualClock
from weft_sync.ownership.facade import ReclaimedWorkflow
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


@contextmanager
def handler_running(
    make: MakeOwnership, clock: ManualClock, *, past_grace_ms: int, wait_s: float
) -> Iterator[Ownership]:
    """Yield ``engine-b`` while its handler drives ``job-1``, a workflow it took over from a dead
    engine (``clock`` advanced by ``past_grace_ms`` first); on exit the handler completes the
    workflow and ``engine-b`` runs a pass that waits for it (up to ``wait_s``)."""
    dead = make("engine-dead")
    dead.workflows.start("job-1", "job")
    clock.advance(past_grace_ms)
    inside = threading.Event()
    release = threading.Event()

    def slow(ctx: ReclaimedWorkflow) -> None:
        inside.set()
        release.wait(wait_s)
        ctx.workflows.complete(ctx.workflow_id)

    survivor = make("engine-b", handlers={"job": slow})
    survivor.run_maintenance(wait_handlers=0)
    try:
        assert inside.wait(wait_s), "the handler never started"
        yield survivor
    finally:
        release.set()
    survivor.run_maintenance(wait_handlers=wait_s)
