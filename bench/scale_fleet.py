"""The engines of ``bench/scale.py``: the other engines and the measured ones, on one store.

``Fleet`` opens ``OTHERS`` real engines whose ids the seeded holders name, and one measured
engine per discovery the library has (``old``: ``reclaim_discovery="scan"``; ``new``: the
default ``"auto"``), all with ``background="manual"`` and one shared clock that
:meth:`Fleet.heartbeat` moves on by one renew interval (never behind the wall clock), so that
every pass of every engine comes one interval after its previous one, as with the timer: each
writes its heartbeat, and the store changes between two passes of the measured engine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Literal

from bench.common import StoreSpec
from bench.scale_seed import SEED_TYPE, Seeder
from weft_sync import Ownership, OwnershipOptions, ReclaimedWorkflow, keys
from weft_sync.clock import ManualClock, system_clock

__all__ = [
    "Discovery",
    "OTHERS",
    "Fleet",
    "claim_id",
    "heartbeating",
    "modes",
    "options_for",
    "other_ids",
]

OTHERS = 8

Discovery = Literal["auto", "scan"]


def options_for(mode: Discovery | None, backend: str | None = None) -> OwnershipOptions:
    """Default claim timing; ``mode`` picks the discovery (``None``: the default one).

    On PostgreSQL (``backend``) claim time is the database's, as by default: an injected clock
    would otherwise make it the engine's own.
    """
    time_source: Literal["store"] | None = "store" if backend == "postgres" else None
    if mode is None:
        return OwnershipOptions(time_source=time_source)
    return OwnershipOptions(reclaim_discovery=mode, time_source=time_source)


def modes() -> dict[str, Discovery]:
    """Column name -> discovery option: the old full scan, and the default."""
    return {"old": "scan", "new": "auto"}


def claim_id(n: int) -> str:
    return f"wf-{n:07d}"


def other_ids() -> list[str]:
    return [f"scale-other-{n}" for n in range(OTHERS)]


def _refuse_drive(ctx: ReclaimedWorkflow) -> None:
    raise SystemExit(f"a measured engine drove {ctx.workflow_id!r}, a live claim of another engine")


class Fleet:
    """The other engines and one measured engine per discovery, all open on one store."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self.clock = ManualClock(system_clock())
        self._interval_ms = options_for(None).claim_renew_interval_ms
        self._stack = contextlib.ExitStack()
        others = options_for(None, spec.backend)
        self.others = [self._open(engine, others) for engine in other_ids()]
        self.measured = {
            column: self._open(
                f"scale-measured-{column}",
                options_for(mode, spec.backend),
                handlers={SEED_TYPE: _refuse_drive},
            )
            for column, mode in modes().items()
        }

    def _open(
        self, engine: str, options: OwnershipOptions, handlers: dict[str, Any] | None = None
    ) -> Ownership:
        ownership = Ownership.open(
            self.spec.url,
            options=options,
            background="manual",
            engine_id=engine,
            handlers=handlers,
            clock=self.clock,
        )
        self._stack.callback(ownership.close)
        return ownership

    @property
    def columns(self) -> list[str]:
        """Every measured column, retired ones included."""
        return list(modes())

    def retire(self, column: str) -> None:
        """Close a measured engine no longer measured: an engine that runs no passes would go
        stale and cost every other pass a read of its (empty) claims."""
        ownership = self.measured.pop(column, None)
        if ownership is not None:
            ownership.close()

    def heartbeat(self) -> None:
        """Move the clock on by one renew interval, then run one pass of every other engine."""
        self.clock.set(max(self.clock() + self._interval_ms, system_clock()))
        for ownership in self.others:
            ownership.run_maintenance()

    def wait_for_index_marker(self, seeder: Seeder) -> None:
        """Let the new engine's backfill mark the (still empty) store as fully indexed."""
        for _ in range(20):
            if seeder.read_prefix(keys.OWNER_INDEX_MARKER):
                return
            self.measured["new"].run_maintenance()
        raise SystemExit("the owner index backfill never set its marker on an empty store")

    def close(self) -> None:
        self._stack.close()


@contextlib.contextmanager
def heartbeating(fleet: Fleet) -> Iterator[None]:
    """Keep the other engines' heartbeats fresh (one pass each per renew interval) meanwhile.

    The first beat comes before this returns: an engine whose record went stale while the store
    was seeded would have every one of its claims read by the survivors' passes.
    """
    stop = threading.Event()
    renew_s = options_for(None).claim_renew_interval_ms / 1000
    fleet.heartbeat()

    def loop() -> None:
        while not stop.wait(renew_s):
            fleet.heartbeat()

    thread = threading.Thread(target=loop, name="scale-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(120)
